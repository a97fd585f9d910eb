"""This user's local SuperLink ports, its stop command, and the outcome check for scripts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from fedmm.results import main as results_main
from fedmm.superlink import local_superlinks, stop, user_ports


def test_ports_differ_between_users_and_never_collide() -> None:
    pairs = {uid: user_ports(uid) for uid in range(1, 10000)}
    assert user_ports(0) == (39091, 39093)  # root keeps Flower's defaults
    ports = [p for pair in pairs.values() for p in pair]
    assert len(set(ports)) == len(ports) and all(40000 <= p < 65536 for p in ports)


def test_stop_ends_only_this_users_superlink_on_its_port(tmp_path: Path) -> None:
    # a stand-in process whose command line looks like a local SuperLink's
    fake = tmp_path / "flower-superlink"
    fake.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    fake.chmod(0o755)
    proc = subprocess.Popen([str(fake), "--insecure", "--simulation", "--port", "45999"])
    other = subprocess.Popen([str(fake), "--insecure", "--simulation", "--port", "45997"])
    try:
        deadline = time.time() + 10
        while not local_superlinks(45999) and time.time() < deadline:
            time.sleep(0.1)
        assert local_superlinks(45999) == [proc.pid]
        assert stop(45999) == [proc.pid]
        assert proc.wait(timeout=10) is not None
        assert other.poll() is None  # another port's SuperLink is left alone
    finally:
        for p in (proc, other):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_the_outcome_check_exits_zero_only_for_a_completed_run(tmp_path: Path, capsys) -> None:
    assert results_main(["check", str(tmp_path)]) == 1  # no summary.json
    (tmp_path / "summary.json").write_text(json.dumps({"status": "failed", "reason": "RunFailed: no replies"}))
    assert results_main(["check", str(tmp_path)]) == 1
    assert "failed (RunFailed: no replies)" in capsys.readouterr().out
    (tmp_path / "summary.json").write_text(json.dumps({"status": "completed"}))
    assert results_main(["check", str(tmp_path)]) == 0


def test_the_serverapp_names_where_it_runs_and_refuses_mixed_app_copies(monkeypatch, tmp_path: Path) -> None:
    import pytest

    import strategies
    from fedmm.errors import ConfigError
    from server_app.server_app import where_the_app_runs

    here = where_the_app_runs()
    assert f"uid {os.getuid()}" in here and sys.executable.split("/")[-1] in here
    monkeypatch.setattr(strategies, "__file__", str(tmp_path / "other-checkout" / "strategies" / "__init__.py"))
    with pytest.raises(ConfigError) as info:
        where_the_app_runs()
    assert info.value.key == "app" and "different folders" in str(info.value)
