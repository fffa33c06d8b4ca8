"""Filter `mosquitto_password_hash`: the `$7$` (PBKDF2-SHA512) line of mosquitto_passwd, in Jinja.

Why a filter instead of running mosquitto_passwd: the tool salts randomly, so every run would
rewrite the file and restart the broker (no `changed=0`). Here the salt is derived from a seed
(the user name and a per-site secret), so the same inputs render the same file.
"""

from __future__ import annotations

import base64
import hashlib

ITERATIONS = 101  # mosquitto_passwd's default


def mosquitto_password_hash(password: str, seed: str, iterations: int = ITERATIONS) -> str:
    salt = hashlib.sha256(("fog-mosquitto:" + str(seed)).encode()).digest()[:12]
    digest = hashlib.pbkdf2_hmac("sha512", str(password).encode(), salt, int(iterations))
    return "$7${}${}${}".format(
        int(iterations), base64.b64encode(salt).decode(), base64.b64encode(digest).decode()
    )


class FilterModule:
    def filters(self):
        return {"mosquitto_password_hash": mosquitto_password_hash}
