"""Analysis figures: the model cosine (its arithmetic, and that the multi-model base logs it for
the trained models), its plot over rounds, and loss-landscape slices of a small saved run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from flwr.app import ConfigRecord, MetricRecord, RecordDict

from analysis import figures as F
from fedmm.config import compose, to_container
from fedmm.protocol import model_to_record, record_to_model
from strategies.fedmr import FedMR
from strategies.multimodel import MultiModel, cosine_summary, pairwise_cosine
from tests.fakes import FakeGrid


def model(w, b=(0.0,), count=0) -> dict:
    return {"w": np.asarray(w, np.float32), "b": np.asarray(b, np.float32), "bn.num_batches_tracked": np.array(count, np.int64)}


def naive_cosine(x: dict, y: dict) -> float:
    fx = np.concatenate([v.ravel() for v in x.values() if v.dtype.kind == "f"]).astype(np.float64)
    fy = np.concatenate([v.ravel() for v in y.values() if v.dtype.kind == "f"]).astype(np.float64)
    return float(fx @ fy / np.linalg.norm(fx) / np.linalg.norm(fy))


# ---------------------------------------------------------------------- the cosine itself
def test_pairwise_cosine_hand_cases() -> None:
    m = model([1.0, 2.0, 0.0], [3.0])
    cos = pairwise_cosine([m, m, {k: v * 2.5 for k, v in m.items()}, {k: -v for k, v in m.items()}])
    np.testing.assert_allclose(cos[0], [1.0, 1.0, 1.0, -1.0], atol=1e-12)  # identical, scaled, negated
    assert pairwise_cosine([model([0, 0, 1]), model([1, 0, 0])])[0, 1] == 0.0  # orthogonal
    assert pairwise_cosine([model([1, 0, 0]), model([1, 1, 0])])[0, 1] == pytest.approx(2**-0.5, abs=1e-15)
    # the integer buffer is no direction: equal weights with different counts are identical
    assert pairwise_cosine([model([1, 2, 3], count=0), model([1, 2, 3], count=10**6)])[0, 1] == pytest.approx(1.0, abs=1e-12)
    # both entries count, in one vector: w parts orthogonal, b parts equal -> 1/2
    assert pairwise_cosine([model([1, 0, 0], [1.0]), model([0, 1, 0], [1.0])])[0, 1] == pytest.approx(0.5, abs=1e-12)
    assert np.isnan(pairwise_cosine([model([0, 0, 0]), model([1, 0, 0])])[0, 1])  # undefined for a zero model


def test_blocks_smaller_than_a_tensor_give_the_full_result_and_the_summary_is_over_pairs() -> None:
    rng = np.random.default_rng(0)
    models = [{"a": rng.normal(size=(7, 5)).astype(np.float32), "n": np.array(3), "b": rng.normal(size=11).astype(np.float32)}
              for _ in range(5)]
    blocked = pairwise_cosine(models, block_bytes=8 * 5 * 3)  # 3 columns per block: blocks straddle entries
    expected = np.array([[naive_cosine(x, y) for y in models] for x in models])
    np.testing.assert_allclose(blocked, expected, rtol=1e-12, atol=1e-12)
    pairs = expected[np.triu_indices(5, k=1)]
    summary = cosine_summary(models)
    assert summary["model_cosine"] == pytest.approx(pairs.mean(), rel=1e-12)
    assert (summary["model_cosine_min"], summary["model_cosine_max"]) == pytest.approx((pairs.min(), pairs.max()), rel=1e-12)
    assert cosine_summary(models[:1]) == {}  # no pair


# ---------------------------------------------------------------------- logged by the strategy
def initial():
    return model_to_record({"a.weight": np.zeros((4, 3), np.float32), "a.bias": np.zeros(4, np.float32),
                            "bn.num_batches_tracked": np.array(0, np.int64)})


def test_the_multi_model_base_logs_the_cosine_of_the_trained_models_before_the_update() -> None:
    returned: dict[str, dict] = {}

    def node(msg, key):  # each node returns its own random model
        rng = np.random.default_rng(int(key.split(":")[1]))
        out = {k: (rng.normal(size=v.shape).astype(np.float32) + 1.0 if v.dtype.kind == "f" else v + 1)
               for k, v in record_to_model(msg.content["arrays"]).items()}
        returned[key] = out
        return RecordDict({"arrays": model_to_record(out), "metrics": MetricRecord({"num-examples": 5.0})})

    dropped = "partition:000000002"
    strategy = FedMR(clients_per_round=4, seed=0, log_model_cosine=True)  # recombination changes the models after the log
    grid = FakeGrid(node, num_nodes=4, drop=[dropped])
    msgs = list(strategy.configure_train(1, initial(), ConfigRecord({}), grid))
    strategy.aggregate_train(1, grid.send_and_receive(msgs))
    trained = [returned[grid.keys[m.metadata.dst_node_id]] for m in msgs if grid.keys[m.metadata.dst_node_id] != dropped]
    assert len(trained) == 3  # the dropped node's slot (the model it was given) is not in the log
    pairs = [naive_cosine(trained[i], trained[j]) for i in range(3) for j in range(i + 1, 3)]
    log = strategy.round_log
    assert log["model_cosine"] == pytest.approx(np.mean(pairs), rel=1e-12)
    assert (log["model_cosine_min"], log["model_cosine_max"]) == pytest.approx((min(pairs), max(pairs)), rel=1e-12)

    quiet = MultiModel(clients_per_round=4, seed=0)  # the default: not logged (opt-in, it costs a Gram matrix)
    msgs = list(quiet.configure_train(1, initial(), ConfigRecord({}), grid))
    quiet.aggregate_train(1, grid.send_and_receive(msgs))
    assert not any(key.startswith("model_cosine") for key in quiet.round_log)


# ---------------------------------------------------------------------- the cosine plot
def write_run(root: Path, name: str, overrides: list[str], cosines: list[float] | None) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(to_container(compose(overrides))))
    with open(run / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"round": 0, "accuracy": 0.1, "loss": 2.3}) + "\n")
        for rnd, c in enumerate(cosines or [0.9, 0.8, 0.85], start=1):
            row = {"round": rnd, "accuracy": 0.5, "loss": 1.0, "replies": 10}
            if cosines is not None:
                row.update(model_cosine=c, model_cosine_min=c - 0.1, model_cosine_max=c + 0.05)
            f.write(json.dumps(row) + "\n")
    return run


def test_cosine_plot_draws_one_line_per_run_labelled_by_method(tmp_path: Path, capsys) -> None:
    runs = [write_run(tmp_path, "mr", ["strategy=fedmr"], [0.95, 0.7, 0.8]),
            write_run(tmp_path, "cross", ["strategy=fedcross"], [0.99, 0.97]),
            write_run(tmp_path, "avg", ["strategy=fedavg"], None)]  # no cosine: skipped with a warning
    out = tmp_path / "fig" / "cosine.png"
    assert F.main(["cosine", *map(str, runs), "--out", str(out), "--spread"]) == 0
    assert out.stat().st_size > 1000
    data = json.loads(out.with_suffix(".json").read_text())
    assert list(data) == ["FedMR", "FedCross"]
    assert data["FedMR"]["round"] == [1, 2, 3] and data["FedMR"]["model_cosine"] == [0.95, 0.7, 0.8]
    assert data["FedCross"]["model_cosine_min"] == pytest.approx([0.89, 0.87])
    assert "avg: no model_cosine" in capsys.readouterr().err


# ---------------------------------------------------------------------- landscape geometry
def test_interpolation_is_exact_at_the_ends_and_moves_floating_buffers_only() -> None:
    a = {"w": torch.tensor([0.1, -0.3]), "bn.running_var": torch.tensor([1.0]), "bn.num_batches_tracked": torch.tensor(5)}
    b = {"w": torch.tensor([0.7, 0.2]), "bn.running_var": torch.tensor([3.0]), "bn.num_batches_tracked": torch.tensor(9)}
    assert all(torch.equal(F.interpolate(a, b, 0.0)[k], a[k]) for k in a)
    assert torch.equal(F.interpolate(a, b, 1.0)["w"], b["w"])
    half = F.interpolate(a, b, 0.5)
    assert half["bn.running_var"].item() == 2.0 and half["w"].dtype == torch.float32  # statistics move like weights
    assert F.interpolate(a, b, 1.0)["bn.num_batches_tracked"].item() == 5  # integer buffers are a's
    assert F.interpolate(a, b, -0.5)["w"].tolist() == pytest.approx([-0.2, -0.55])


def test_plane_basis_is_orthonormal_and_holds_the_three_models() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b, c = ({"w": torch.randn(6, 4, generator=gen, dtype=torch.float64), "n": torch.tensor(1)} for _ in range(3))
    u, v, where = F.plane_basis(a, b, c)
    assert F.inner(u, u) == pytest.approx(1.0) and F.inner(v, v) == pytest.approx(1.0) and abs(F.inner(u, v)) < 1e-12
    assert where["a"] == (0.0, 0.0) and where["b"][0] == pytest.approx(float((b["w"] - a["w"]).norm()))
    for point, target in (("b", b), ("c", c)):
        x, y = where[point]
        assert (F.affine([(1.0, a), (x, u), (y, v)], a)["w"] - target["w"]).abs().max() < 1e-12
    with pytest.raises(ValueError, match="identical"):
        F.plane_basis(a, a, c)
    with pytest.raises(ValueError, match="line"):
        F.plane_basis(a, b, F.interpolate(a, b, 2.0))


def test_filter_normalized_direction_matches_each_filter_and_ignores_vectors() -> None:
    w = {"conv": torch.randn(3, 2, 5, 5), "bias": torch.randn(3), "n": torch.tensor(1)}
    d = F.filter_normalized_direction(w, torch.Generator().manual_seed(1))
    assert set(d) == {"conv", "bias"} and torch.count_nonzero(d["bias"]) == 0
    norm = torch.linalg.vector_norm
    assert norm(d["conv"], dim=(1, 2, 3)).tolist() == pytest.approx(norm(w["conv"].double(), dim=(1, 2, 3)).tolist(), rel=1e-12)


# ---------------------------------------------------------------------- landscape of a saved run
@pytest.fixture(autouse=True)
def one_torch_thread():
    """LeNet on 200 images is ~20 ms on one thread, but ~20x slower when torch's threads wait
    on cores other processes keep busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """A LeNet run directory on the embedded mnist5k: config, three saved models and their mean."""
    from fedmm.data import input_spec
    from fedmm.models import model_for

    run = tmp_path_factory.mktemp("run")
    cfg = to_container(compose(["strategy=fedmr", "model=lenet", "clients_per_round=3"]))
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    torch.manual_seed(0)
    base = model_for(cfg, input_spec(cfg["dataset"])).state_dict()
    gen = torch.Generator().manual_seed(1)
    models = [{k: (v + 0.05 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v) for k, v in base.items()}
              for _ in range(3)]
    np.savez(run / "final_models.npz", **{f"{i}/{k}": v.numpy() for i, m in enumerate(models) for k, v in m.items()})
    torch.save({k: sum(m[k] for m in models) / 3 for k in base}, run / "final_model.pt")
    return run, models


def test_landscape_of_three_saved_models(tiny_run, tmp_path: Path) -> None:
    from fedmm.data import input_spec, load_dataset
    from fedmm.evaluation import evaluate
    from fedmm.models import model_for

    run, models = tiny_run
    out = tmp_path / "landscape.png"
    argv = ["landscape", str(run), "--models", "0", "1", "2", "--max-examples", "200", "--grid", "3", "--steps", "5",
            "--device", "cpu", "--out", str(out)]
    assert F.main(argv) == 0
    assert out.stat().st_size > 1000
    result = json.loads(out.with_suffix(".json").read_text())
    line, plane = result["line"], result["plane"]
    assert line["t"] == [-0.5, 0.0, 0.5, 1.0, 1.5] and result["examples"] == 200 and result["evaluations"] == 3 + 5 + 9
    # known values: the line's ends are the models, and model 0's loss is its own evaluation
    assert line["loss"][1] == result["models"][0]["loss"] and line["loss"][3] == result["models"][1]["loss"]
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    net = model_for(cfg, input_spec(cfg["dataset"]))
    net.load_state_dict(models[0])
    subset = F.evaluation_subset(load_dataset(cfg["dataset"])[1], 200, seed=0)
    own = evaluate(net, subset, torch.device("cpu"))
    assert result["models"][0]["loss"] == pytest.approx(own["loss"], rel=1e-6)
    assert result["models"][0]["accuracy"] == own["accuracy"]
    assert len(plane["loss"]) == 3 and all(len(row) == 3 and all(np.isfinite(row)) for row in plane["loss"])
    assert plane["points"]["0"] == [0.0, 0.0] and plane["points"]["1"][1] == 0.0 and plane["points"]["2"][1] > 0


def test_landscape_of_one_model_uses_random_directions(tiny_run, tmp_path: Path) -> None:
    run, _ = tiny_run
    out = tmp_path / "global.png"
    assert F.main(["landscape", str(run), "--models", f"{run}:global", "--max-examples", "100", "--grid", "2", "--steps", "3",
                   "--device", "cpu", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["models"][0]["model"] == f"{run.name}:global"  # a model named by its run directory
    assert result["line"]["kind"] == "random direction" and result["plane"]["kind"] == "random directions"
    assert result["line"]["t"] == [-1.0, 0.0, 1.0] and result["line"]["loss"][1] == result["models"][0]["loss"]
    assert out.stat().st_size > 1000
