"""The sweep report: method names, rounds-to-target and the summary table from run directories."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from fedmm.config import compose, to_container
from fedmm.report import load_runs, method_label, rounds_to_reach, summarise


def write_run(root: Path, name: str, overrides: list[str], accs: list[float], status: str = "completed") -> None:
    cfg = to_container(compose([f"num_rounds={len(accs) - 1}", *overrides]))
    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    with open(run / "metrics.jsonl", "w") as f:
        for rnd, acc in enumerate(accs):
            f.write(json.dumps({"round": rnd, "accuracy": acc, "loss": 1.0, "seconds": 2.0 * rnd,
                                "bytes_sent": 1048576 * rnd, "bytes_received": 1048576 * rnd}) + "\n")
    (run / "summary.json").write_text(json.dumps({"status": status}))


def test_method_labels() -> None:
    label = lambda *o: method_label(to_container(compose(list(o))))  # noqa: E731
    assert label() == "FedAvg"
    assert label("strategy=fedmr_two_stage") == "FedMR (first stage 5)"
    assert label("strategy=indep") == "Indep"
    assert label("strategy=fedcross_accel") == "FedCross (PM 5 + DA 5)"
    assert label("strategy=fedrl") == "FedRL"
    assert label("strategy=fedmr", "objective=fedprox") == "FedProx (FedMR)"
    assert label("strategy=clusamp") == "CluSamp" and label("strategy=clusamp_fedmr_repo") == "CluSamp (FedMR port)"
    assert label("strategy=fedexp", "selection=clustered", "selection.algorithm=1") == "FedExP + CluSamp (Alg. 1)"
    assert label("strategy=fedmut") == "FedMut" and label("strategy=solo") == "SOLO"
    assert label("strategy=fedasam") == "FedASAM" and label("strategy=fedsam") == "FedSAM"
    assert label("strategy=fedasam_fedmr_repo") == "FedASAM (ρ 0.1, η 0.0)"
    assert label("strategy=fedmr", "strategy.secure.enabled=true") == "FedMR (secure both, r_s 2)"
    assert label("strategy=fedmr", "strategy.secure.enabled=false") == "FedMR"


def test_rounds_to_reach_and_summary(tmp_path: Path) -> None:
    rows = [{"round": r, "accuracy": a} for r, a in enumerate([0.1, 0.5, 0.7, 0.8])]
    assert rounds_to_reach(rows, 0.7) == 2 and rounds_to_reach(rows, 0.9) is None
    write_run(tmp_path, "a", ["seed=0"], [0.1, 0.4, 0.6, 0.7])
    write_run(tmp_path, "b", ["seed=0", "strategy=fedmr"], [0.1, 0.7, 0.8, 0.9])
    write_run(tmp_path, "c", ["seed=1", "strategy=fedmr"], [0.1, 0.2, 0.3, 0.4])
    (tmp_path / "c" / "metrics.jsonl").write_text((tmp_path / "c" / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    refused: list = []
    runs = load_runs(tmp_path, refused)  # "c" stopped after round 0: not counted
    assert len(runs) == 2
    assert [(p.name, "stops at round 0" in why) for p, why in refused] == [("c", True)]
    table, data = summarise(runs, "FedAvg")
    assert data["Dir(0.5) / FedAvg"]["final"] == [70.0]
    assert data["Dir(0.5) / FedMR"]["rounds_to_reference"] == [1]  # reaches FedAvg's 0.7 in round 1
    assert "3.00×" in table  # 3 rounds of FedAvg vs 1 of FedMR
    assert data["Dir(0.5) / FedMR"]["mb_per_round"] == 1.0


def test_runs_that_differ_in_any_key_are_never_averaged_and_failed_runs_are_refused(tmp_path: Path) -> None:
    write_run(tmp_path, "a0", ["seed=0"], [0.9, 0.4, 0.6])
    write_run(tmp_path, "a1", ["seed=1"], [0.9, 0.5, 0.8])
    write_run(tmp_path, "b0", ["seed=0", "training.lr=0.05"], [0.1, 0.2, 0.3])
    write_run(tmp_path, "f", ["seed=2"], [0.1, 0.2, 0.9], status="failed")
    refused: list = []
    runs = load_runs(tmp_path, refused)
    assert [p.name for p, _ in refused] == ["f"] and "failed" in refused[0][1]
    table, data = summarise(runs, None)
    assert set(data) == {"Dir(0.5) / FedAvg / training.lr=0.01", "Dir(0.5) / FedAvg / training.lr=0.05"}
    a = data["Dir(0.5) / FedAvg / training.lr=0.01"]
    assert a["n"] == 2 and a["final"] == [60.0, 80.0]
    assert a["best"] == [60.0, 80.0]  # round 0's 90 % does not count as "best"
    assert "70.00 ± 14.14" in table  # sample std (ddof = 1): |80 - 60| / sqrt(2)
