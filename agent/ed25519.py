"""Ed25519 signature verification through the OpenSSL libcrypto the interpreter has already loaded
(agent.signing: an agent verifies the admin's signature of every pipeline spec it runs).

Why not the `cryptography` package: importing it (its Rust extension and the modules around it)
cost an agent's process 9.7 MB resident after its other imports, a quarter of the 40 MB budget
(docs/runtime.md, "Memory"; docs/results.md, O28), for one call per spec. Python's `hashlib` and `ssl` (paho imports ssl) already map
OpenSSL's libcrypto, which has verified Ed25519 since 1.1.1: `ctypes` reaches it for about
0.4 MB. Signing and key generation stay with `cryptography` on the admin's side (fogctl), which
an agent never imports for this.

What is checked is what RFC 8032 says and OpenSSL implements (EVP_DigestVerify with a raw
Ed25519 key): the point encodings of the key and of R, S below the group order, and the
equation. Only public data goes in, so nothing here needs to be constant time.

Public key files: the PEM SubjectPublicKeyInfo that `fogctl keygen` and `openssl pkey -pubout`
write (`raw_public_key_from_pem`), parsed here: an Ed25519 key's DER is a fixed 12-byte header
and the 32 key bytes.
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import re
import sys
from typing import Any, Optional

__all__ = ["PUBLIC_KEY_BYTES", "SIGNATURE_BYTES", "Unavailable", "raw_public_key_from_pem", "verify"]

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
_EVP_PKEY_ED25519 = 1087  # NID_ED25519 (obj_mac.h), stable since OpenSSL 1.1.1
# SEQUENCE { SEQUENCE { OID 1.3.101.112 (id-Ed25519) }, BIT STRING (32 bytes) } (RFC 8410)
_SPKI_PREFIX = bytes.fromhex("302a300506032b6570032100")
_PEM = re.compile(rb"-----BEGIN PUBLIC KEY-----\s*([A-Za-z0-9+/=\s]+?)\s*-----END PUBLIC KEY-----")


class Unavailable(RuntimeError):
    """No libcrypto with Ed25519 (OpenSSL older than 1.1.1, or a Python without OpenSSL)."""


class _Lib:
    """libcrypto's functions, typed once (the first verification)."""

    def __init__(self, lib: Any) -> None:
        vp, sz, cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
        self.new_key = lib.EVP_PKEY_new_raw_public_key
        self.new_key.restype, self.new_key.argtypes = vp, [ctypes.c_int, vp, cp, sz]
        self.free_key = lib.EVP_PKEY_free
        self.free_key.restype, self.free_key.argtypes = None, [vp]
        self.new_ctx = lib.EVP_MD_CTX_new
        self.new_ctx.restype, self.new_ctx.argtypes = vp, []
        self.free_ctx = lib.EVP_MD_CTX_free
        self.free_ctx.restype, self.free_ctx.argtypes = None, [vp]
        self.init = lib.EVP_DigestVerifyInit
        self.init.restype, self.init.argtypes = ctypes.c_int, [vp, vp, vp, vp, vp]
        self.verify = lib.EVP_DigestVerify
        self.verify.restype, self.verify.argtypes = ctypes.c_int, [vp, cp, sz, cp, sz]
        self.clear_errors = lib.ERR_clear_error
        self.clear_errors.restype, self.clear_errors.argtypes = None, []


_lib: Optional[_Lib] = None


def _candidates() -> list:
    """Where libcrypto is: through the extension modules that link it (a handle's symbols include
    its dependencies'), then the libcrypto this process has mapped (Linux), then by name."""
    out = []
    for name in ("_hashlib", "_ssl"):
        try:
            mod = __import__(name)
        except ImportError:
            continue
        if getattr(mod, "__file__", None):
            out.append(mod.__file__)
    try:
        with open("/proc/self/maps", "rb") as fh:
            for line in fh:
                fields = line.split(None, 5)  # address, perms, offset, device, inode, path
                path = fields[5].strip().decode(errors="replace") if len(fields) == 6 else ""
                if "/libcrypto" in path and path not in out:
                    out.append(path)
    except OSError:
        pass
    return out


def _load() -> _Lib:
    global _lib
    if _lib is not None:
        return _lib
    tried = []
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
            _lib = _Lib(lib)
            return _lib
        except (OSError, AttributeError) as exc:
            tried.append(f"{path}: {exc}")
    from ctypes import util  # not before it is needed: it imports subprocess and shutil (about 1.6 MB)

    name = util.find_library("crypto")
    if name:
        try:
            _lib = _Lib(ctypes.CDLL(name))
            return _lib
        except (OSError, AttributeError) as exc:
            tried.append(f"{name}: {exc}")
    raise Unavailable("no OpenSSL libcrypto with Ed25519 (1.1.1 or later) found"
                      + (f" ({'; '.join(tried)})" if tried else "") + f" for Python {sys.version.split()[0]}")


def verify(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """True when `signature` is the Ed25519 signature of `message` by `public_key` (32 raw bytes),
    False otherwise (a wrong size, a key that is not a point, a forged or altered signature).
    Unavailable when this process has no libcrypto that can tell."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    lib = _load()
    key = lib.new_key(_EVP_PKEY_ED25519, None, bytes(public_key), PUBLIC_KEY_BYTES)
    if not key:
        lib.clear_errors()
        return False
    ctx = lib.new_ctx()
    try:
        if not ctx:
            raise MemoryError("EVP_MD_CTX_new")
        ok = (lib.init(ctx, None, None, None, key) == 1
              and lib.verify(ctx, bytes(signature), SIGNATURE_BYTES, bytes(message), len(message)) == 1)
        if not ok:
            lib.clear_errors()  # the error queue is the thread's: leave it as ssl expects it
        return ok
    finally:
        if ctx:
            lib.free_ctx(ctx)
        lib.free_key(key)


def raw_public_key_from_pem(pem: bytes) -> bytes:
    """The 32 key bytes of an Ed25519 public key in PEM (SubjectPublicKeyInfo, RFC 8410);
    ValueError saying why it is not one."""
    m = _PEM.search(pem)
    if m is None:
        raise ValueError("no PEM public key (-----BEGIN PUBLIC KEY-----) in it")
    try:
        der = base64.b64decode(b"".join(m.group(1).split()), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("its PEM body is not base64") from None
    if len(der) == len(_SPKI_PREFIX) + PUBLIC_KEY_BYTES and der.startswith(_SPKI_PREFIX):
        return der[len(_SPKI_PREFIX):]
    raise ValueError(f"not an Ed25519 key (algorithm {_algorithm(der)})")


def _algorithm(der: bytes) -> str:
    """The algorithm OID of a SubjectPublicKeyInfo, dotted, for the error message; "unknown"."""
    try:
        i = der.index(b"\x06", 2)  # the first OID: the algorithm's
        n = der[i + 1]
        body = der[i + 2:i + 2 + n]
        if n >= 0x80 or len(body) != n or not body:
            return "unknown"
        parts, value = [body[0] // 40, body[0] % 40], 0
        for b in body[1:]:
            value = (value << 7) | (b & 0x7F)
            if not b & 0x80:
                parts.append(value)
                value = 0
        return ".".join(map(str, parts))
    except (ValueError, IndexError):
        return "unknown"
