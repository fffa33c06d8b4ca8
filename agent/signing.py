"""Pipeline specs signed by an admin key (Ed25519; docs/security.md, "Signed pipeline specs").

Why: a spec reaches an agent from many hands: an admin's spawn, a neighbour's peer spawn (the
protocol's createNode, a hand-over), a dead node's retained hosted record (re-home), the agent's
own state dir (re-adoption). The broker's ACL proves who wrote the last hop, not who wrote the
pipeline. An admin's signature over the pipeline's text, name, generation and issue time proves the
pipeline whoever forwards it: a node's key can neither forge one nor alter a signed text, and the
issue time lets an agent refuse an older signed deploy replayed over a newer one it has seen.

What is signed is what an admin decides: the pipeline's TOML text (every operator, function, params,
MQTT topic allow-list, scaling section), its name, the deploy's generation and the issue time. Not
signed: the fields the protocol sets per incarnation (instance id, node, neighbours, epoch floor),
which the agent bounds itself (agent.operators.admission). The data path is not signed: a batch's
topic proves its writer (docs/security.md, "Data channels").

Two libraries: signing and key generation (`Signer`, `generate_keypair`, `load_signer`: the
admin's side, fogctl and deploy) use the `cryptography` package; verification (`Verifier`,
`load_verifier`: every agent) uses the libcrypto the interpreter already loads (agent.ed25519), so
an agent's process never imports `cryptography` (9.7 MB resident: docs/runtime.md, "Memory").

Sans-IO apart from the key files (`generate_keypair`, `load_signer`, `load_verifier`): the
statement, the signature's wire forms and the replay rule (`SpecTrust`) take their inputs.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple, Union

__all__ = ["SIGNATURE_KEY", "Signature", "Signer", "SpecTrust", "Verifier", "generate_keypair", "key_id",
           "load_signer", "load_verifier", "statement"]

SIGNATURE_KEY = "signature"  # in InstanceSpec.extra, next to records.GENERATION_KEY
# The record's second line (after `# fog-generation: ...`): a TOML comment, so every reader of the
# pipeline reads the same pipeline.
_LINE = re.compile(r"# fog-signature: ([0-9a-f]{16}) ([0-9]{1,16}) ([A-Za-z0-9_-]{86})\r?$")
_DOMAIN = "fog-pipeline-spec/1"  # a signature over a spec is never valid as anything else


def statement(pipeline: str, generation: Optional[str], issued_at: int, text: str) -> bytes:
    """The canonical bytes an admin signs: a JSON header (domain, pipeline name, generation, issue
    time in ms) on one line, then the pipeline's text as UTF-8, byte for byte (no re-rendering of
    the TOML: the text is what every agent parses)."""
    head = json.dumps([_DOMAIN, pipeline, generation or "", int(issued_at)], separators=(",", ":"), ensure_ascii=True)
    return head.encode("ascii") + b"\n" + text.encode("utf-8")


def key_id(public_raw: bytes) -> str:
    """A short name for a public key (16 hex digits of its SHA-256): which key signed, in logs."""
    return hashlib.sha256(public_raw).hexdigest()[:16]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class Signature:
    """One admin signature: which key, when (ms since the epoch), the 64 signature bytes."""

    key: str
    issued_at: int
    sig: bytes = field(repr=False)

    def to_extra(self) -> Dict[str, Any]:
        """The form a spec carries in `extra["signature"]` (JSON)."""
        return {"key": self.key, "issued_at": self.issued_at, "sig": _b64(self.sig)}

    def line(self) -> str:
        """The form the retained pipeline record carries (`records.stamp`)."""
        return f"# fog-signature: {self.key} {self.issued_at} {_b64(self.sig)}"

    @classmethod
    def from_extra(cls, value: Any) -> "Signature":
        """Parse `extra["signature"]` (bus input); ValueError naming what is wrong."""
        if not isinstance(value, Mapping):
            raise ValueError("signature: expected an object {key, issued_at, sig}")
        key, issued, sig = value.get("key"), value.get("issued_at"), value.get("sig")
        if not isinstance(key, str) or not re.fullmatch(r"[0-9a-f]{16}", key):
            raise ValueError("signature: key is not a key id")
        if isinstance(issued, bool) or not isinstance(issued, int) or not 0 <= issued < 10**16:
            raise ValueError("signature: issued_at is not a time in ms")
        if not isinstance(sig, str) or not re.fullmatch(r"[A-Za-z0-9_-]{86}", sig):
            raise ValueError("signature: sig is not 64 bytes of base64")
        try:
            raw = _unb64(sig)
        except (binascii.Error, ValueError):
            raise ValueError("signature: sig is not base64") from None
        return cls(key, issued, raw)

    @classmethod
    def from_line(cls, line: str) -> Optional["Signature"]:
        """The signature of a record's line, None if the line is not one."""
        m = _LINE.match(line)
        if m is None:
            return None
        try:
            return cls(m.group(1), int(m.group(2)), _unb64(m.group(3)))
        except (binascii.Error, ValueError):
            return None


class Signer:
    """An admin's private key: signs what a deploy publishes (`agent.node.deploy.run_deploy`)."""

    def __init__(self, private_key: Any) -> None:
        from cryptography.hazmat.primitives import serialization

        self._key = private_key
        raw = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.key = key_id(raw)

    def sign(self, pipeline: str, generation: Optional[str], text: str,
             issued_at: Optional[int] = None) -> Signature:
        at = int(time.time() * 1000) if issued_at is None else int(issued_at)
        return Signature(self.key, at, self._key.sign(statement(pipeline, generation, at, text)))


class Verifier:
    """The admin public keys a node trusts (`[security] admin_keys`): any one may sign. Keys are
    the 32 raw bytes of each Ed25519 public key; verification goes through the libcrypto the
    interpreter already loads (agent.ed25519), not the `cryptography` package (9.7 MB an
    agent's process does not hold for it: docs/runtime.md, "Memory")."""

    def __init__(self, public_keys: Iterable[bytes]) -> None:
        self.keys: Dict[str, bytes] = {}
        for raw in public_keys:
            raw = bytes(raw)
            if len(raw) != 32:
                raise ValueError(f"an Ed25519 public key is 32 bytes, not {len(raw)}")
            self.keys[key_id(raw)] = raw

    def verify(self, pipeline: str, generation: Optional[str], text: str, sig: Signature) -> None:
        """Raise ValueError unless `sig` is a trusted key's signature over this statement."""
        from agent import ed25519

        pub = self.keys.get(sig.key)
        if pub is None:
            raise ValueError(f"signed by key {sig.key}, which is not an admin key of this node")
        try:
            valid = ed25519.verify(pub, sig.sig, statement(pipeline, generation, sig.issued_at, text))
        except ed25519.Unavailable as exc:
            raise ValueError(f"the signature of key {sig.key} cannot be checked: {exc}") from None
        if not valid:
            raise ValueError(f"the signature of key {sig.key} does not match the pipeline's text, name and "
                             "generation (forged or altered)")


class SpecTrust:
    """The rule an agent applies to every pipeline it is asked to run (sans-IO).

    `verifier` None: signatures are not required (no `[security] admin_keys`: the embedded tests,
    a fleet without admin keys; docs/security.md says when). Otherwise every spec and every
    deployed record must carry a trusted signature over its text, name and generation, issued no
    earlier than the newest this agent has accepted for that pipeline (`newest`): an older signed
    deploy replayed over a newer one is refused even when the broker lost the newer record.
    """

    def __init__(self, verifier: Optional[Verifier]) -> None:
        self.verifier = verifier
        self.newest: Dict[str, Tuple[int, str]] = {}  # pipeline -> (issued_at, generation)

    @property
    def required(self) -> bool:
        return self.verifier is not None

    def check(self, pipeline: str, generation: Optional[str], text: str, sig: Any) -> Optional[str]:
        """Why this pipeline statement is refused, or None (then it counts as seen). `sig`: a
        Signature, the raw `extra["signature"]` value, or None."""
        if self.verifier is None:
            return None
        if sig is None:
            return f"pipeline {pipeline[:80]!r} carries no admin signature (this node requires one)"
        try:
            parsed = sig if isinstance(sig, Signature) else Signature.from_extra(sig)
            self.verifier.verify(pipeline, generation, text, parsed)
        except ValueError as exc:
            return f"pipeline {pipeline[:80]!r}: {exc}"
        seen = self.newest.get(pipeline)
        if seen is not None and parsed.issued_at < seen[0]:
            return (f"pipeline {pipeline[:80]!r}: signed deploy {generation or '-'} issued at {parsed.issued_at} is "
                    f"older than deploy {seen[1] or '-'} issued at {seen[0]} (a replay)")
        if seen is None or parsed.issued_at > seen[0]:
            self.newest[pipeline] = (parsed.issued_at, generation or "")
        return None


# ---- key files -------------------------------------------------------------------------------------


def generate_keypair(private_path: Union[str, Path], public_path: Union[str, Path]) -> str:
    """Write a new Ed25519 key pair as PEM (the private key mode 0600, never overwritten); returns
    its key id. `openssl genpkey -algorithm ed25519` makes the same files."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private_path, public_path = Path(private_path), Path(public_path)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    pub = key.public_key()
    public_path.write_bytes(pub.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return key_id(pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


def load_signer(path: Union[str, Path]) -> Signer:
    """The admin's private key file; ValueError saying why it is not an Ed25519 PEM private key."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except OSError as exc:
        raise ValueError(f"cannot read it ({exc.strerror})") from None
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"not an Ed25519 key ({type(key).__name__})")
    return Signer(key)


def load_verifier(paths: Iterable[Union[str, Path]]) -> Verifier:
    """The admin public key files (PEM, as `generate_keypair` and `openssl pkey -pubout` write
    them); ValueError naming the first one that is not an Ed25519 PEM public key. Parsed here
    (agent.ed25519), without the `cryptography` package."""
    from agent import ed25519

    keys = []
    for p in paths:
        try:
            data = Path(p).read_bytes()
        except OSError as exc:
            raise ValueError(f"{p}: cannot read it ({exc.strerror})") from None
        try:
            keys.append(ed25519.raw_public_key_from_pem(data))
        except ValueError as exc:
            raise ValueError(f"{p}: {exc}") from None
    return Verifier(keys)
