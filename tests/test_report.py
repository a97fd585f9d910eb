"""The sweep report: method names, rounds-to-target, the summary table from run directories and
the papers' layout (``--paper``)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

from fedmm.config import compose, to_container
from tests.conftest import composed
from analysis.paper_numbers import PAPER_TABLES
from analysis.report import (load_runs, main, method_label, paper_maps, paper_table, render_paper, rounds_to_reach,
                          summarise)


def write_run(root: Path, name: str, overrides: list[str], accs: list[float], status: str = "completed") -> None:
    # composed once per config (hydra is slow): the seed override only sets cfg["seed"]
    seeds = [int(o.split("=", 1)[1]) for o in overrides if o.startswith("seed=")]
    cfg = to_container(composed(f"num_rounds={len(accs) - 1}", *(o for o in overrides if not o.startswith("seed="))))
    if seeds:
        cfg["seed"] = seeds[-1]
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
    assert label("strategy=scaffold") == "SCAFFOLD" and label("strategy=scaffold_lab") == "SCAFFOLD (lab)"
    assert label("strategy=moon") == "MOON" and label("strategy=fedmr", "objective=moon") == "MOON (FedMR)"
    assert label("strategy=fedgen") == "FedGen" and label("strategy=fedgen_original") == "FedGen (original)"
    assert label("strategy=fedmut_fedmr_repo") == "FedMut (radius 5.0, bound 100)"
    assert label("strategy=fedexp_fedmr_repo") == "FedExP (ε 0.1 constant, buffers extrapolated)"
    assert label("strategy=fednova") == "FedNova"  # its objective is selected with it, not a variant
    assert label("server_optimizer=fedavgm", "server_optimizer.server_momentum=0.9") == "FedAvg + FedAvgM (β 0.9)"
    assert label("strategy=scaffold", "server_optimizer=fedadam") == "SCAFFOLD + FedAdam"
    assert method_label({"strategy": {"name": "fedavg"}}) == "FedAvg"  # a run written before the newer groups


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
    assert table.startswith("| partition | method | n |")  # nothing else differs: no setting column
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
    assert "| Dir(0.5) | FedAvg | training.lr=0.05 | 1 |" in table

    # a key that only one method sets (CluSamp's selector) is said by the method column, and the
    # method is still measured against FedAvg; a key that varies within a method stays named
    write_run(tmp_path, "c0", ["seed=0", "strategy=clusamp"], [0.1, 0.7, 0.9])
    _, data = summarise(load_runs(tmp_path), "FedAvg")
    assert "Dir(0.5) / CluSamp / training.lr=0.01" in data
    assert data["Dir(0.5) / CluSamp / training.lr=0.01"]["rounds_to_reference"] == [1]


# --- the papers' layout -----------------------------------------------------------------------

CIFAR_01 = ["model=lenet", "dataset=cifar10", "partition.alpha=0.1"]  # KDD Table 1: CNN CIFAR-10 0.1
CIFAR_IID = ["model=lenet", "dataset=cifar10", "partition=iid"]       # KDD Table 1: CNN CIFAR-10 IID


def write_cifar_sweep(root: Path) -> None:
    """3 methods x 2 seeds x 2 settings of KDD Table 1, one run outside it, one failed run."""
    finals = {"fedavg": (0.6, 0.8), "fedprox": (0.5, 0.55), "fedmr": (0.7, 0.9)}
    for setting, tag in ((CIFAR_01, "a01"), (CIFAR_IID, "iid")):
        for strategy, (f0, f1) in finals.items():
            for seed, final in enumerate((f0, f1)):
                write_run(root, f"{strategy}_{tag}_s{seed}", [f"seed={seed}", f"strategy={strategy}", *setting],
                          [0.1, final - 0.1, final])
    write_run(root, "mnist5k_s0", ["seed=0"], [0.1, 0.5, 0.6])                    # CNN mnist5k Dir(0.5): no row
    write_run(root, "failed_s2", ["seed=2", "strategy=fedavg", *CIFAR_01], [0.1, 0.2, 0.3], status="failed")


def test_paper_layout_in_markdown_csv_and_latex(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_cifar_sweep(tmp_path / "sweep")
    main([str(tmp_path / "sweep"), "--out", str(tmp_path / "out" / "r"), "--paper", "kdd_table1"])
    out = tmp_path / "out"
    # ours: final accuracies 60 and 80 -> mean 70, sample std 14.14; the paper's FedAvg: 50.66
    cell = "70.00 ± 14.14 (50.66) n=2"
    rows = list(csv.reader((out / "r_kdd_table1.csv").open(encoding="utf-8")))
    assert rows[0] == ["model", "dataset", "α", "FedAvg", "FedProx", "FedMR"]  # the paper's order; no column we did not run
    assert [r[:3] for r in rows[1:]] == [["CNN", "CIFAR-10", "0.1"], ["CNN", "CIFAR-10", "IID"]]  # nor a row
    assert rows[1][3] == cell
    assert rows[2][5] == "80.00 ± 14.14 (63.74) n=2"  # FedMR, IID: the paper's 63.74
    md = (out / "r_kdd_table1.md").read_text(encoding="utf-8")
    assert f"| CNN | CIFAR-10 | 0.1 | {cell} |" in md
    assert "after 2 rounds of ours" in md and "the paper's own horizon" in md  # the two horizons, said
    # the run whose setting is not a row is listed, with why; the failed one as refused
    assert "- CNN mnist5k α=0.5 / FedAvg (1 run: mnist5k_s0): setting CNN mnist5k α=0.5" in md
    assert "is not in kdd_table1" in md and "failed_s2: status failed" in md
    tex = (out / "r_kdd_table1.tex").read_text(encoding="utf-8")
    assert r"CNN & CIFAR-10 & 0.1 & 70.00 $\pm$ 14.14 (50.66) n=2 & " in tex and r"\begin{tabular}{lllccc}" in tex
    cells = json.loads((out / "r_kdd_table1.json").read_text())["cells"]
    assert next(c for c in cells if c["method"] == "FedAvg" and c["setting"][2] == "0.1")["ours"] == [60.0, 80.0]
    # the summary of the sweep is still written, and one learning-curve figure per setting
    assert (out / "r.md").is_file() and "refused" in capsys.readouterr().out
    assert sorted(p.name for p in (out / "r_curves").iterdir()) == [
        "cnn_mnist5k_Dir_0.5.png", "lenet_cifar10_Dir_0.1.png", "lenet_cifar10_iid.png"]
    # --all-rows: every row and column of the paper, "–" where we have no runs
    full = render_paper(paper_table("kdd_table1"), load_runs(tmp_path / "sweep"), all_rows=True)
    assert len(full.body) == 27 and full.header[3:] == list(PAPER_TABLES["kdd_table1"].methods)
    assert full.body[8][:4] == ["CNN", "FEMNIST", "–", "– (82.97)"]


def test_unknown_paper_table_and_bad_map_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    allowed = "allowed: kdd_table1, arxiv_table1, fedrl_table1, fedrl_table2, fedrl_table3"
    with pytest.raises(ValueError, match=f"unknown paper table 'kdd'; {allowed}"):
        paper_table("kdd")
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--out", str(tmp_path / "r"), "--paper", "kdd"])
    assert f"unknown paper table 'kdd'; {allowed}" in capsys.readouterr().err
    with pytest.raises(ValueError, match="expected KIND.OURS=PAPER with KIND one of model, dataset, method"):
        paper_maps(["mnist5k=MNIST"])


def test_fedrl_table2_rounds_to_fedavg_final_accuracy_beside_the_papers(tmp_path: Path) -> None:
    fedrl_setting = ["num_clients=10", "clients_per_round=10"]  # mnist5k, Dir(0.5); named MNIST below
    curves = {"fedavg": ([0.1, 0.5, 0.6, 0.7], [0.1, 0.5, 0.7, 0.7]),   # target 0.7, reached at 3 and 2
              "fedrl": ([0.1, 0.7, 0.8, 0.9], [0.1, 0.6, 0.7, 0.8]),    # at 1 (3x) and 2 (1x)
              "fedprox": ([0.1, 0.4, 0.5, 0.6], [0.1, 0.5, 0.6, 0.75])}  # never, and 3 (2/3 x)
    for strategy, per_seed in curves.items():
        for seed, accs in enumerate(per_seed):
            write_run(tmp_path, f"{strategy}_s{seed}", [f"seed={seed}", f"strategy={strategy}", *fedrl_setting], accs)
    layout = render_paper(paper_table("fedrl_table2"), load_runs(tmp_path), paper_maps(["dataset.mnist5k=MNIST"]))
    assert layout.header == ["method", "MNIST α=0.5 #rounds", "MNIST α=0.5 speed-up"]  # methods as rows, as printed
    assert layout.body == [
        ["FedAvg", "2.5 ± 0.7 (120) n=2", "1.00 ± 0.00× (1.00×)"],
        ["FedProx", "3.0 (86) n=2, 1 not reached", "0.67× (1.40×)"],
        ["FedRL", "1.5 ± 0.7 (51) n=2", "2.00 ± 1.41× (2.35×)"],
    ]
    assert "after 3 rounds of ours" in layout.caption and "120 rounds" in layout.caption


def test_two_groups_of_runs_for_one_cell_are_an_error_unless_one_is_preferred(tmp_path: Path) -> None:
    write_run(tmp_path / "lr", "a", ["seed=0"], [0.1, 0.5, 0.6])
    write_run(tmp_path / "lr", "b", ["seed=0", "training.lr=0.05"], [0.1, 0.5, 0.6])
    with pytest.raises(ValueError, match="would hold runs that differ in training.lr"):  # never averaged
        render_paper(paper_table("fedrl_table1"), load_runs(tmp_path / "lr"), paper_maps(["dataset.mnist5k=MNIST"]))
    # the paper's FedMR on ResNet-20 is two-stage: map that variant to the column and prefer it
    write_run(tmp_path / "mr", "plain", ["seed=0", "strategy=fedmr"], [0.1, 0.5, 0.6])
    write_run(tmp_path / "mr", "two_stage", ["seed=0", "strategy=fedmr_two_stage"], [0.1, 0.5, 0.7])
    runs = load_runs(tmp_path / "mr")
    maps = paper_maps(["dataset.mnist5k=CIFAR-10", "method.FedMR (first stage 5)=FedMR"])
    with pytest.raises(ValueError, match="keep one with --prefer"):
        render_paper(paper_table("kdd_table1"), runs, maps)
    layout = render_paper(paper_table("kdd_table1"), runs, maps, prefer=["FedMR (first stage 5)"])
    assert layout.body == [["CNN", "CIFAR-10", "0.5", "70.00 (59.81) n=1"]]
    assert layout.outside == ["CNN CIFAR-10 α=0.5 / FedMR (1 run: plain): its cell holds 'FedMR (first stage 5)' (--prefer)"]


def test_labels_come_from_the_settings_that_differ_from_their_defaults() -> None:
    from analysis.report import method_label
    from fedmm.config import compose

    def label(*overrides: str) -> str:
        return method_label(compose(list(overrides)).to_dict())

    assert label() == "FedAvg"
    assert label("strategy=indep") == "Indep"
    assert label("strategy=fedmr", "strategy.first_stage_rounds=7") == "FedMR (first stage 7)"
    assert label("strategy=feddyn") == "FedDyn" and label("strategy=feddyn", "strategy.alpha=0.1") == "FedDyn (α 0.1)"
    assert label("strategy=scaffold_lab") == "SCAFFOLD (lab)" and label("strategy=fedgen_original") == "FedGen (original)"
    assert label("strategy=fedasam_fedmr_repo") == "FedASAM (ρ 0.1, η 0.0)" and label("strategy=fedsam") == "FedSAM"
    assert label("strategy=fedrl") == "FedRL" and label("strategy=fedmr", "objective=fedrl") == "FedRL (FedMR)"
    assert label("strategy=fedprox", "objective.mu=0.1") == "FedProx (μ 0.1)"
    assert label("strategy=clusamp_fedmr_repo") == "CluSamp (FedMR port)"
    assert label("strategy=fedcross", "strategy.alpha=0.9") == "FedCross (α 0.9)"
    # a run written before a key existed reads it at its default; an undeclared option keeps its name
    old = compose(["strategy=fedmr"]).to_dict()
    del old["strategy"]["secure"]
    assert method_label(old) == "FedMR"
    assert method_label({**old, "strategy": {"name": "gone"}}) == "gone"
