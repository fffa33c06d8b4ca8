"""central.toml loading (located errors) and the batch scheduler's decisions (pure, no Spark)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.central_config import load_central_config
from agent.collector.service import BatchScheduler
from agent.schema import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_example_central_toml_loads() -> None:
    cfg = load_central_config(ROOT / "examples" / "central.toml")
    assert cfg.collector.cluster == "demo" and cfg.analytics.master == "local[*]"
    assert cfg.mqtt.port == 8883 and cfg.mqtt.tls is not None  # TLS on, as the broker's role renders it
    assert cfg.mqtt.tls.cert_file == "/etc/fog-agent/collector-tls/collector.crt" and cfg.mqtt.username is None


@pytest.mark.parametrize("text, where", [
    ('[collector]\nclustr = "x"\n', "[collector].clustr: unknown key"),
    ('[analytics]\nschedule_seconds = -1\n', "[analytics].schedule_seconds: expected seconds >= 0"),
    ('[collector]\ncluster = "a/b"\n', "[collector].cluster"),
    # [mqtt.tls] is the agent's own section: the same located errors
    ('[mqtt.tls]\ncert_file = "c.crt"\n', "[mqtt.tls].ca_file: missing required key"),
    ('[mqtt.tls]\nca_file = 3\n', "[mqtt.tls].ca_file: expected a string, got 3"),
    ('[mqtt.tls]\nca_file = "a"\ncafile = "b"\n', "[mqtt.tls].cafile: unknown key"),
    ('[mqtt.tls]\nca_file = "a"\nkey_file = "k"\n', "[mqtt.tls]: key_file needs cert_file"),
])
def test_errors_name_file_and_key(tmp_path: Path, text: str, where: str) -> None:
    p = tmp_path / "central.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_central_config(p)
    assert str(exc.value).startswith("central.toml: ") and where in str(exc.value)


def test_scheduler_runs_by_count_or_by_time_never_without_new_files() -> None:
    s = BatchScheduler("L", "O", "local[2]", schedule_seconds=60, trigger_files=3, now=0.0)
    assert not s.due(1000.0)  # nothing new landed: no run however long ago the last one was
    s.landed(2)
    assert not s.due(10.0) and s.due(60.0)  # by time
    s.landed(1)
    assert s.due(10.0)  # by count
    assert s.command()[-6:] == ["--landing", "L", "--out", "O", "--master", "local[2]"]
    off = BatchScheduler("L", "O", "local", schedule_seconds=0, trigger_files=0, now=0.0)
    off.landed(100)
    assert not off.due(1e9)


def test_tls_files_that_do_not_load_name_file_key_and_what_was_expected(tmp_path: Path) -> None:
    from agent.config import check_tls

    ca = tmp_path / "ca.crt"
    ca.write_text("not a certificate\n")
    p = tmp_path / "central.toml"
    p.write_text(f'[mqtt.tls]\nca_file = "{tmp_path}/missing.crt"\n')
    with pytest.raises(ConfigError) as exc:
        check_tls(load_central_config(p).mqtt, str(p))
    assert str(exc.value) == (f'central.toml: [mqtt.tls].ca_file: expected a readable PEM file (No such file or '
                              f'directory), got "{tmp_path}/missing.crt"')
    p.write_text(f'[mqtt.tls]\nca_file = "{ca}"\n')
    with pytest.raises(ConfigError, match=r"^central.toml: \[mqtt.tls\].ca_file: expected a PEM CA certificate "):
        check_tls(load_central_config(p).mqtt, str(p))
