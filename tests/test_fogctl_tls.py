"""fogctl's TLS and credential options against a real Mosquitto with a TLS listener and a
password file (certificates made by openssl for this test): the right settings connect, a wrong
password is a one-line refusal (exit 1), an untrusted CA a one-line TLS error, never a traceback.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from agent.cli.fogctl import main
from tls_certs import OPENSSL, make_certs

pytestmark = pytest.mark.broker

PASSWD = shutil.which("mosquitto_passwd")


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory):
    if not OPENSSL or not PASSWD:
        pytest.skip("openssl or mosquitto_passwd missing")
    from conftest import MOSQUITTO, free_port, wait_port

    d = tmp_path_factory.mktemp("tls")
    make_certs(d, "good")
    make_certs(d, "other")
    _run(PASSWD, "-b", "-c", str(d / "passwd"), "ops", "s3cret")
    (d / "passwd").chmod(0o600)
    port = free_port()
    (d / "mosquitto.conf").write_text(
        f"listener {port} 127.0.0.1\ncafile {d}/good-ca.crt\ncertfile {d}/good-server.crt\n"
        f"keyfile {d}/good-server.key\nallow_anonymous false\npassword_file {d}/passwd\n"
        + ("user root\n" if os.geteuid() == 0 else ""))  # root: do not drop to a user who cannot read tmp
    proc = subprocess.Popen([MOSQUITTO, "-c", str(d / "mosquitto.conf")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_port("127.0.0.1", port)
        (d / "pw").write_text("s3cret\n")
        yield d, port
    finally:
        proc.terminate()
        proc.wait()


def test_tls_with_password_file_connects(capsys, tls_broker) -> None:
    d, port = tls_broker
    code = main(["--broker", f"localhost:{port}", "--cafile", str(d / "good-ca.crt"), "-u", "ops",
                 "--pw-file", str(d / "pw"), "--cluster", "tls", "status"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "no agents found" in out


def test_wrong_password_is_refused_exit_1(capsys, tls_broker) -> None:
    d, port = tls_broker
    code = main(["--broker", f"localhost:{port}", "--cafile", str(d / "good-ca.crt"), "-u", "ops",
                 "-P", "nope", "status"])
    err = capsys.readouterr().err
    assert code == 1 and "refused the connection" in err and f"localhost:{port}" in err
    assert len(err.strip().splitlines()) == 1


def test_untrusted_certificate_is_one_line_exit_3(capsys, tls_broker) -> None:
    d, port = tls_broker
    code = main(["--broker", f"localhost:{port}", "--cafile", str(d / "other-ca.crt"), "-u", "ops",
                 "--pw-file", str(d / "pw"), "status"])
    err = capsys.readouterr().err
    assert code == 3 and "TLS error" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
