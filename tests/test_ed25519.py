"""Ed25519 verification through the interpreter's libcrypto (agent.ed25519), which every agent
uses to check an admin's signature of a spec (agent.signing): the RFC 8032 test vectors, the same
verdicts as the `cryptography` package on its own signatures and on altered ones, refused
signatures and keys, and the PEM public key files fogctl and openssl write."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519 as c_ed25519, rsa

from agent import ed25519, signing

# RFC 8032 section 7.1: (secret key, public key, message, signature), hex
RFC8032 = [
    ("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60",
     "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a", "",
     "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe"
     "24655141438e7a100b"),
    ("4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb",
     "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c", "72",
     "92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da085ac1e43e15996e458f3613d0f11d8c387b2eaeb430"
     "2aeeb00d291612bb0c00"),
    ("c5aa8df43f9f837bedb7442f31dcb7b166d38535076f094b85ce3a2e0b4458f7",
     "fc51cd8e6218a1a38da47ed00230f0580816ed13ba3303ac5deb911548908025", "af82",
     "6291d657deec24024827e69c3abe01a30ce548a284743a445e3680d7db5ac3ac18ff9b538d16f290ae67f760984dc6594a7c15e9716e"
     "d28dc027beceea1ec40a"),
    ("833fe62409237b9d62ec77587520911e9a759cec1d19755b7da901b96dca3d42",  # TEST SHA(abc)
     "ec172b93ad5e563bf4932c70e1245034c35467ef2efd4d64ebf819683467e2bf", hashlib.sha512(b"abc").hexdigest(),
     "dc2a4459e7369633a52b1bf277839a00201009a3efbf3ecb69bea2186c26b58909351fc9ac90b3ecfdfbc7c66431e0303dca179c138a"
     "c17ad9bef1177331a704"),
]
L = 2 ** 252 + 27742317777372353535851937790883648493  # the group order


def _raw(pub: c_ed25519.Ed25519PublicKey) -> bytes:
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _c_verify(pub: bytes, sig: bytes, msg: bytes) -> bool:
    try:
        c_ed25519.Ed25519PublicKey.from_public_bytes(pub).verify(sig, msg)
        return True
    except (InvalidSignature, ValueError):
        return False


@pytest.mark.parametrize("secret,public,message,signature", RFC8032)
def test_the_rfc_8032_vectors_verify_and_any_changed_bit_does_not(secret: str, public: str, message: str,
                                                                  signature: str) -> None:
    pub, msg, sig = bytes.fromhex(public), bytes.fromhex(message), bytes.fromhex(signature)
    # the vector is the RFC's: the same key and (deterministic) signature from its secret
    key = c_ed25519.Ed25519PrivateKey.from_private_bytes(bytes.fromhex(secret))
    assert _raw(key.public_key()) == pub and key.sign(msg) == sig
    assert ed25519.verify(pub, sig, msg) is True
    for i in (0, 17, 31, 32, 45, 63):
        bad = bytearray(sig)
        bad[i] ^= 0x04
        assert ed25519.verify(pub, bytes(bad), msg) is False
    assert ed25519.verify(pub, sig, msg + b"\x00") is False
    other = bytearray(pub)
    other[3] ^= 0x01
    assert ed25519.verify(bytes(other), sig, msg) is False


def test_the_same_verdicts_as_cryptography_on_its_signatures_and_altered_ones() -> None:
    rng = random.Random(8032)
    for n in range(60):
        key = c_ed25519.Ed25519PrivateKey.generate()
        pub = _raw(key.public_key())
        msg = bytes(rng.getrandbits(8) for _ in range(rng.choice([0, 1, 31, 64, 200, 5000])))
        sig = key.sign(msg)
        assert ed25519.verify(pub, sig, msg) is True
        cases = [(pub, sig, msg[:-1] if msg else b"x")]
        bad = bytearray(sig)
        bad[rng.randrange(64)] ^= 1 << rng.randrange(8)
        cases.append((pub, bytes(bad), msg))
        other = bytearray(pub)
        other[rng.randrange(32)] ^= 1 << rng.randrange(8)
        cases.append((bytes(other), sig, msg))
        for p, s, m in cases:
            assert ed25519.verify(p, s, m) is _c_verify(p, s, m) is False, n


def test_a_malleable_signature_and_keys_that_are_not_points_are_refused() -> None:
    _, public, message, signature = RFC8032[1]
    pub, msg, sig = bytes.fromhex(public), bytes.fromhex(message), bytes.fromhex(signature)
    s = int.from_bytes(sig[32:], "little")
    assert s < L
    # S + L satisfies the equation too: RFC 8032 (5.1.7) requires S < L, so it is refused
    plus_l = sig[:32] + (s + L).to_bytes(32, "little")
    assert ed25519.verify(pub, plus_l, msg) is False and _c_verify(pub, plus_l, msg) is False
    # wrong sizes, an all-zero signature, keys off the curve
    assert ed25519.verify(pub[:31], sig, msg) is False and ed25519.verify(pub + b"\0", sig, msg) is False
    assert ed25519.verify(pub, sig[:63], msg) is False and ed25519.verify(pub, bytes(64), msg) is False
    not_a_point = (2).to_bytes(32, "little")  # y = 2: x^2 = (y^2-1)/(d y^2+1) has no root
    assert ed25519.verify(not_a_point, sig, msg) is False and _c_verify(not_a_point, sig, msg) is False
    assert ed25519.verify(b"\xff" * 32, sig, msg) is False  # y >= p: not a canonical encoding
    assert ed25519.verify(pub, sig, msg) is True  # and the library still answers after those


def test_the_public_key_files_fogctl_and_openssl_write_and_others_refused(tmp_path: Path) -> None:
    key_id = signing.generate_keypair(tmp_path / "admin.key", tmp_path / "admin.pub")
    signer = signing.load_signer(tmp_path / "admin.key")
    raw = ed25519.raw_public_key_from_pem((tmp_path / "admin.pub").read_bytes())
    assert signing.key_id(raw) == key_id == signer.key
    # `openssl pkey -pubout` writes the same SubjectPublicKeyInfo, with CRLF line ends from some tools
    crlf = (tmp_path / "admin.pub").read_bytes().replace(b"\n", b"\r\n")
    assert ed25519.raw_public_key_from_pem(b"a comment\r\n" + crlf) == raw
    v = signing.load_verifier([tmp_path / "admin.pub"])
    v.verify("p", "g", "text", signer.sign("p", "g", "text"))
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    pem = serialization.Encoding.PEM
    others = {
        "1.2.840.10045.2.1": ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(pem, spki),
        "1.2.840.113549.1.1.1": rsa.generate_private_key(65537, 1024).public_key().public_bytes(pem, spki),
    }
    for oid, data in others.items():
        with pytest.raises(ValueError, match=f"not an Ed25519 key \\(algorithm {oid}\\)"):
            ed25519.raw_public_key_from_pem(data)
    for junk in (b"", b"not a key\n", b"-----BEGIN PUBLIC KEY-----\n!!!\n-----END PUBLIC KEY-----\n",
                 (tmp_path / "admin.key").read_bytes()):  # the private key is not a public key file
        with pytest.raises(ValueError):
            ed25519.raw_public_key_from_pem(junk)
    (tmp_path / "rsa.pub").write_bytes(others["1.2.840.113549.1.1.1"])
    with pytest.raises(ValueError, match="rsa.pub: not an Ed25519 key"):
        signing.load_verifier([tmp_path / "admin.pub", tmp_path / "rsa.pub"])
    with pytest.raises(ValueError, match="missing.pub: cannot read it"):
        signing.load_verifier([tmp_path / "missing.pub"])
