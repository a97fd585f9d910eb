"""Checkpoints and metrics lines survive a crash at any moment: never half-written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fedmm.results import read_metrics
from server_app.checkpoint import CHECKPOINT_FILE, load_checkpoint, save_checkpoint
from server_app.recording import RunRecorder
from strategies import FedMR


def test_a_failed_write_leaves_the_previous_checkpoint_and_no_temp_file(tmp_path: Path, monkeypatch) -> None:
    save_checkpoint(tmp_path, {"round": 1})

    def crash(obj, f):  # writes part of the file, then the process "dies"
        f.write(b"partial bytes")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, {"round": 2})
    monkeypatch.undo()
    assert load_checkpoint(tmp_path)["round"] == 1
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT_FILE]


def test_a_truncated_last_metrics_line_is_not_a_row_and_resume_rewrites_the_file(tmp_path: Path) -> None:
    recorder = RunRecorder(tmp_path, {"seed": 0})
    for rnd in range(3):
        recorder.on_metrics({"round": rnd, "accuracy": 0.5, "loss": float("nan") if rnd == 2 else 1.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"round": 3, "accu')  # a run killed in the middle of a line
    rows = read_metrics(tmp_path)
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert rows[2]["loss"] is None  # non-finite numbers are written as null, valid JSON
    RunRecorder(tmp_path, {"seed": 0}).restore(rows[:2], {})
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2
    assert [json.loads(line)["round"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1]


def test_strategy_state_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    strategy = FedMR(clients_per_round=3, seed=4)
    model = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.array(2, dtype=np.int64)}
    strategy.initialize(model)
    strategy.rng.random(5)  # move the method's RNG
    save_checkpoint(tmp_path, {"round": 7, "strategy": strategy.context.state_dict()})
    other = FedMR(clients_per_round=3, seed=4)
    other.load_state_dict(load_checkpoint(tmp_path)["strategy"])
    assert other.models[0] is other.models[2]  # shared references stay shared
    np.testing.assert_array_equal(other.models[1]["w"], model["w"])
    assert other.rng.random() == strategy.rng.random()  # the RNG continues where it stopped


def test_a_run_directory_in_use_is_refused_and_free_again_after(tmp_path: Path) -> None:
    from fedmm.errors import ConfigError
    from server_app.recording import RunLock

    first = RunLock(tmp_path)
    with pytest.raises(ConfigError) as info:
        RunLock(tmp_path)
    assert info.value.key == "output_dir" and f"pid {__import__('os').getpid()}" in str(info.value)
    first.release()
    RunLock(tmp_path).release()  # free again


def test_waiting_for_nodes_has_a_deadline() -> None:
    from strategies.selection import NotEnoughNodes, SeededRosterSelector

    class TwoNodes:
        def get_node_ids(self):
            return [1, 2]

    with pytest.raises(NotEnoughNodes) as info:
        SeededRosterSelector(0, min_nodes_timeout=0.2).ordered_nodes(TwoNodes(), minimum=3)
    assert "only 2 node(s) connected within min_nodes_timeout=0.2s" in str(info.value)


def test_metrics_csv_and_tensorboard_follow_every_round(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recorder = RunRecorder(tmp_path, {"seed": 0})
    recorder.on_metrics({"round": 0, "accuracy": 0.1, "loss": 2.3})
    recorder.on_metrics({"round": 1, "accuracy": 0.5, "loss": 1.2, "replies": 3, "federated_accuracy": 0.4})
    recorder.close()
    lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert lines[0] == "round,accuracy,loss,replies,federated_accuracy"
    assert lines[1] == "0,0.1,2.3,," and lines[2] == "1,0.5,1.2,3,0.4"
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("global/accuracy")] == [(0, 0.1), (1, 0.5)]  # float32
    assert [e.step for e in events.Scalars("federated/accuracy")] == [1]


def test_time_left_uses_the_steady_state_rounds_and_titles_name_model_and_alpha() -> None:
    from fedmm.config import compose, to_container
    from server_app.runner import plot_title, time_left

    history = [{"round": 0, "seconds": 1.0}, {"round": 1, "seconds": 20.0}, {"round": 2, "seconds": 24.0}, {"round": 3, "seconds": 28.0}]
    assert time_left(history, 10) == "~28s left"  # 4 s per round after round 1's warm-up, 7 rounds left
    assert time_left(history[:1], 10) == "starting"
    cfg = compose(["strategy=fedmr", "partition.alpha=0.1", "model=lenet"])
    assert plot_title(cfg) == "fedmr · lenet · mnist5k · Dir(α=0.1) · seed 0"


@pytest.mark.parametrize(("args", "message"), [(["--rsa-bits", "1024"], "at least 2048"), (["--days", "0"], "at least 1")])
def test_the_certificate_script_refuses_weak_keys_and_empty_lifetimes(tmp_path: Path, args: list, message: str) -> None:
    import subprocess

    script = Path(__file__).resolve().parent.parent / "deploy" / "generate_certs.sh"
    proc = subprocess.run(["bash", str(script), "--out", str(tmp_path / "certs"), *args], capture_output=True, text=True)
    assert proc.returncode == 2 and message in proc.stderr
    assert not (tmp_path / "certs").exists()


class _Boom:
    def __reduce__(self):  # what a crafted checkpoint carries: code run when unpickled
        return (os.system, ("touch PWNED",))


def test_a_crafted_checkpoint_is_refused_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from fedmm.errors import ConfigError

    torch.save({"version": 2, "round": 1, "payload": _Boom()}, tmp_path / "checkpoint.pt")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="resume"):
        load_checkpoint(tmp_path)
    assert not (tmp_path / "PWNED").exists()


def test_every_checkpointed_value_round_trips(tmp_path: Path) -> None:
    import random

    from server_app.checkpoint import rng_states

    shared = {"w": np.arange(4, dtype=np.uint32)}
    payload = {"round": 3, "rng": rng_states(), "models": [shared, shared], "t": (1, "a", None, b"x"),
               "scalars": np.float32(1.5), 3: [np.zeros((0, 2), np.float16), np.array(True)]}
    save_checkpoint(tmp_path, payload)
    back = load_checkpoint(tmp_path)
    assert back["models"][0] is back["models"][1] and back["models"][0]["w"].dtype == np.uint32
    assert back["t"] == (1, "a", None, b"x") and back["scalars"] == 1.5 and back[3][0].shape == (0, 2)
    random.setstate(back["rng"]["python"])  # the RNG states are usable as they were
    np.random.set_state(back["rng"]["numpy"])
    with pytest.raises(TypeError, match="checkpoint.bad"):
        save_checkpoint(tmp_path, {"bad": object()})


def test_output_dir_is_new_empty_or_hydras_never_a_folder_with_other_files(tmp_path: Path) -> None:
    from fedmm.config import compose
    from fedmm.errors import ConfigError
    from server_app.recording import create_run_dir

    def run_dir(path: Path) -> Path:
        return create_run_dir(compose([f"output_dir={path}"]))

    assert run_dir(tmp_path / "new").is_dir()
    (tmp_path / "hydra_job" / ".hydra").mkdir(parents=True)  # what a multirun job dir holds at start
    (tmp_path / "hydra_job" / "main.log").write_text("")
    assert run_dir(tmp_path / "hydra_job").is_dir()
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text("x: 1")
    (tmp_path / "conf" / "strategy").mkdir()
    with pytest.raises(ConfigError, match="'strategy'"):  # e.g. output_dir=conf/
        run_dir(tmp_path / "conf")
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "metrics.jsonl").write_text('{"round": 0}\n')
    with pytest.raises(ConfigError, match="resume"):  # a run directory is never reused
        run_dir(tmp_path / "done")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="a directory"):
        run_dir(tmp_path / "file")


# ------------------------------------------------------------------ two generations, a resume that falls back
def test_two_generations_are_kept_and_a_failed_write_touches_neither(tmp_path: Path, monkeypatch) -> None:
    from server_app.checkpoint import PREVIOUS_CHECKPOINT_FILE, read_checkpoint

    for rnd in (1, 2, 3):
        save_checkpoint(tmp_path, {"round": rnd})
    assert read_checkpoint(tmp_path / CHECKPOINT_FILE)["round"] == 3
    assert read_checkpoint(tmp_path / PREVIOUS_CHECKPOINT_FILE)["round"] == 2

    def crash(obj, f):  # the process dies while writing round 4's
        f.write(b"partial bytes")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, {"round": 4})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [PREVIOUS_CHECKPOINT_FILE, CHECKPOINT_FILE]  # no temp file
    assert read_checkpoint(tmp_path / CHECKPOINT_FILE)["round"] == 3
    assert read_checkpoint(tmp_path / PREVIOUS_CHECKPOINT_FILE)["round"] == 2


@pytest.mark.parametrize(("damage", "why"), [
    (lambda raw: raw[: len(raw) // 2], "checkpoint.pt is truncated: its end is missing"),
    (lambda raw: b"", "checkpoint.pt is empty (0 bytes)"),
    (lambda raw: raw[:2000] + bytes(b ^ 0xFF for b in raw[2000:2100]) + raw[2100:], "checkpoint.pt is corrupt: its part"),
], ids=["truncated", "empty", "bits-flipped"])
def test_an_unreadable_newest_checkpoint_falls_back_to_the_previous_with_a_warning(tmp_path: Path, caplog, damage,
                                                                                  why: str) -> None:
    from server_app.checkpoint import PREVIOUS_CHECKPOINT_FILE

    save_checkpoint(tmp_path, {"round": 1, "w": np.zeros(1000, np.float32)})
    save_checkpoint(tmp_path, {"round": 2, "w": np.ones(1000, np.float32)})
    newest = tmp_path / CHECKPOINT_FILE
    newest.write_bytes(damage(newest.read_bytes()))
    with caplog.at_level("WARNING"):
        state = load_checkpoint(tmp_path)
    assert state["round"] == 1 and state["loaded_from"] == PREVIOUS_CHECKPOINT_FILE
    np.testing.assert_array_equal(state["w"], np.zeros(1000, np.float32))
    assert why in caplog.text and f"resuming from the previous checkpoint, {PREVIOUS_CHECKPOINT_FILE} (round 1)" in caplog.text
    assert "written by this version" not in caplog.text


def test_both_generations_unreadable_is_one_refusal_naming_both(tmp_path: Path) -> None:
    from fedmm.errors import ConfigError
    from server_app.checkpoint import PREVIOUS_CHECKPOINT_FILE

    save_checkpoint(tmp_path, {"round": 1})
    save_checkpoint(tmp_path, {"round": 2})
    (tmp_path / CHECKPOINT_FILE).write_bytes((tmp_path / CHECKPOINT_FILE).read_bytes()[:100])
    (tmp_path / PREVIOUS_CHECKPOINT_FILE).write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError) as info:
        load_checkpoint(tmp_path)
    message = str(info.value)
    assert info.value.key == "resume" and "checkpoint.pt is truncated" in message
    assert f"{PREVIOUS_CHECKPOINT_FILE} is not a checkpoint" in message
    (tmp_path / PREVIOUS_CHECKPOINT_FILE).unlink()  # a run that wrote one checkpoint
    with pytest.raises(ConfigError, match=f"checkpoint.pt is truncated.*there is no {PREVIOUS_CHECKPOINT_FILE} to fall back to"):
        load_checkpoint(tmp_path)


def test_torchs_reason_is_quoted_in_whole_sentences(tmp_path: Path) -> None:
    """torch's own message (a crafted pickle, refused by weights_only) quoted by its specific
    sentence, never cut in the middle of one."""
    from server_app.checkpoint import read_checkpoint, UnreadableCheckpoint

    torch.save({"version": 2, "round": 1, "payload": _Boom()}, tmp_path / "checkpoint.pt")
    with pytest.raises(UnreadableCheckpoint) as info:
        read_checkpoint(tmp_path / "checkpoint.pt")
    message = str(info.value)
    assert message.startswith("checkpoint.pt is unreadable: it does not load as tensors and plain values (torch: ")
    quoted = message.split("(torch: ", 1)[1][:-1]
    assert quoted.endswith(".") and "posix.system" in quoted and "In PyTorch 2.6" not in quoted, message


def test_the_first_checkpoint_after_a_fallback_replaces_the_unreadable_one(tmp_path: Path) -> None:
    """A run resumed from the previous generation keeps it as the previous one: the unreadable
    newest is replaced, never kept as the fallback."""
    from server_app.checkpoint import PREVIOUS_CHECKPOINT_FILE, Checkpointer, read_checkpoint

    save_checkpoint(tmp_path, {"round": 1})
    save_checkpoint(tmp_path, {"round": 2})
    (tmp_path / CHECKPOINT_FILE).write_bytes(b"PK\x03\x04 cut")
    state = load_checkpoint(tmp_path)

    class Context:
        evaluation = type("Evaluation", (), {"last_evaluate_metrics": None})()

        def state_dict(self) -> dict:
            return {}

    class Strategy:
        context = Context()

    recorder = type("Recorder", (), {"history": [], "federated": {}})()
    grid = type("Grid", (), {"bytes_sent": 0, "bytes_received": 0})()
    checkpoints = Checkpointer(tmp_path, Strategy(), recorder, grid, lambda: 0.0, 1, 5, state["round"], state["loaded_from"])
    checkpoints.on_round_end(2)
    assert read_checkpoint(tmp_path / CHECKPOINT_FILE)["round"] == 2
    assert read_checkpoint(tmp_path / PREVIOUS_CHECKPOINT_FILE)["round"] == 1
    checkpoints.on_round_end(3)  # and from then on, two generations again
    assert read_checkpoint(tmp_path / PREVIOUS_CHECKPOINT_FILE)["round"] == 2


def test_a_resume_falls_back_from_a_truncated_checkpoint_loses_nothing_and_writes_into_its_run(tmp_path: Path) -> None:
    """``fedmm resume=<run>`` whose newest checkpoint a disk fault truncated: it warns naming the
    file, continues from the previous generation and ends with the metrics of the run it resumes,
    to the last digit; its log goes on in the run's own cli.log, and no folder appears under
    outputs/. A refused resume (a change it does not allow, a folder that holds no run) also
    writes nothing outside the run, and leaves the run's summary.json as it was."""
    import subprocess
    import sys

    fedmm = [str(Path(sys.executable).parent / "fedmm")]
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0")
    run = tmp_path / "outputs" / "run"

    def fedmm_in(args: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([*fedmm, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)

    first = fedmm_in(["num_rounds=3", "num_clients=4", "clients_per_round=2", "model=lenet", "training.local_steps=5",
                      "checkpoint_every=1", f"hydra.run.dir={run}"])
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    recorded = [{k: v for k, v in row.items() if k != "seconds"} for row in read_metrics(run)]
    hydra_record = (run / ".hydra" / "overrides.yaml").read_text()
    log_lines = (run / "cli.log").read_text().count("\n")
    newest = run / CHECKPOINT_FILE
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 3])

    resumed = fedmm_in(["resume=outputs/run"])
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-3000:]
    assert "checkpoint.pt is truncated" in output and "resuming from the previous checkpoint" in output
    assert "resuming at round 3/3" in output
    assert [{k: v for k, v in row.items() if k != "seconds"} for row in read_metrics(run)] == recorded  # nothing lost
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == ["run"]  # no stray hydra folder
    log = (run / "cli.log").read_text()
    assert log.count("\n") > log_lines and "checkpoint.pt is truncated" in log and "resuming at round 3/3" in log
    assert (run / ".hydra" / "overrides.yaml").read_text() == hydra_record  # the run's own record kept

    summary = (run / "summary.json").read_text()
    refused = fedmm_in(["resume=outputs/run", "training.lr=0.5"])
    assert refused.returncode == 1 and "no change when resuming" in refused.stderr, refused.stdout + refused.stderr
    assert "no change when resuming" in (run / "cli.log").read_text()  # the refusal in the run's log
    assert (run / "summary.json").read_text() == summary
    missing = fedmm_in(["resume=outputs/missing"])
    assert missing.returncode == 1 and "the directory of a fedmm run" in missing.stderr
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == ["run"]
