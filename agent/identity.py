"""Who a bus client is, as the broker sees it: the identity its requests' topics must name.

docs/security.md: the broker's user name is the identity (a password user, or the client
certificate's CN with `use_identity_as_username`), and the ACL lets each identity write only the
request and reply topics that end in its own name. A requester that names another identity in
its topics is refused by the broker; one that names its own receives its replies on
`replies/<identity>/+`. So a tool derives its identity the way the broker does:

1. the configured user name;
2. else the CN of its client certificate;
3. else (no authentication at all: private test brokers) its MQTT client id.

Reading the CN: `ssl._ssl._test_decode_cert` is the stdlib's own PEM decoder (CPython uses it in
its tests); it needs no new dependency and no subprocess. It is a private name, so it is guarded,
and `openssl x509 -noout -subject` is the fallback where it is missing.
"""

from __future__ import annotations

import re
import subprocess
from typing import Optional

from agent import topics

__all__ = ["IdentityError", "certificate_cn", "identity"]


class IdentityError(ValueError):
    """No usable identity: an unreadable certificate, or a name that is no topic segment."""


def certificate_cn(cert_file: str) -> Optional[str]:
    """The subject CN of the first certificate in a PEM file, or None if it has none."""
    decode = getattr(getattr(__import__("ssl"), "_ssl", None), "_test_decode_cert", None)
    if decode is not None:
        try:
            decoded = decode(cert_file)
        except Exception as exc:  # ssl.SSLError, OSError: one line for the user
            raise IdentityError(f"cannot read the certificate {cert_file}: {exc}") from None
        for rdn in decoded.get("subject", ()):
            for key, value in rdn:
                if key == "commonName":
                    return str(value)
        return None
    try:
        out = subprocess.run(["openssl", "x509", "-noout", "-subject", "-nameopt", "RFC2253", "-in", cert_file],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise IdentityError(f"cannot read the certificate {cert_file}: {exc}") from None
    m = re.search(r"(?:^|[=,])\s*CN=([^,]+)", out.strip().removeprefix("subject="))
    return m.group(1).strip() if m else None


def identity(username: Optional[str], cert_file: Optional[str], client_id: str) -> str:
    """The identity of a client (see the module doc for the order), checked as a topic segment."""
    name = username or (certificate_cn(cert_file) if cert_file else None) or client_id
    try:
        return topics._check(name)
    except ValueError:
        raise IdentityError(f"identity {name!r} cannot name a topic level (no '/', '+', '#')") from None
