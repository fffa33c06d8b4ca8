"""Test certificates made by openssl: a CA, a server certificate for 127.0.0.1/localhost, and
client certificates whose CN is the MQTT identity (Mosquitto's `use_identity_as_username`).

Shared by the TLS tests (tests/test_fogctl_tls.py, tests/test_security_tls_acl.py) so that there is
one way to make test certificates. EC P-256 keys: fast to generate on a Pi-class machine.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Tuple

OPENSSL = shutil.which("openssl")

_EC = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def make_ca(d: Path, name: str) -> Tuple[Path, Path]:
    """A self-signed CA `<name>-ca.crt` / `<name>-ca.key` under `d`."""
    crt, key = d / f"{name}-ca.crt", d / f"{name}-ca.key"
    _run(OPENSSL, "req", "-x509", *_EC, "-days", "2", "-subj", f"/CN={name}-ca", "-keyout", str(key), "-out", str(crt))
    return crt, key


def make_cert(d: Path, ca: str, cn: str, server: bool = False, stem: str = "") -> Tuple[Path, Path]:
    """A certificate with common name `cn` signed by the CA `ca` (made by `make_ca(d, ca)`).

    `server`: add subjectAltName localhost/127.0.0.1 (hostname checking). Files:
    `<stem or ca-cn>.crt` / `.key` under `d`.
    """
    stem = stem or f"{ca}-{cn}"
    crt, key, csr = d / f"{stem}.crt", d / f"{stem}.key", d / f"{stem}.csr"
    _run(OPENSSL, "req", *_EC, "-subj", f"/CN={cn}", "-keyout", str(key), "-out", str(csr))
    cmd = [OPENSSL, "x509", "-req", "-in", str(csr), "-CA", str(d / f"{ca}-ca.crt"), "-CAkey", str(d / f"{ca}-ca.key"),
           "-CAcreateserial", "-days", "2", "-out", str(crt)]
    if server:
        ext = d / f"{stem}.ext"
        ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        cmd += ["-extfile", str(ext)]
    _run(*cmd)
    return crt, key


def make_certs(d: Path, name: str) -> None:
    """A CA and a server certificate: `<name>-ca.crt`, `<name>-server.crt`, `<name>-server.key`."""
    make_ca(d, name)
    make_cert(d, name, "localhost", server=True, stem=f"{name}-server")


__all__ = ["OPENSSL", "make_ca", "make_cert", "make_certs"]
