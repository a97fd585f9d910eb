"""The run's mean through byzfl's aggregators (strategies/aggregators.py): each the library's own
call on the same stack, the chain of pre-aggregators, the refusals before the first round."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from fedmm.config import compose
from fedmm.errors import ConfigError
from strategies.aggregation import mean_models, weighted_mean_models
from strategies.aggregators import AGGREGATORS, PRE_AGGREGATORS, TAKES_F, AggregationRefused, Mean

#: Five models of two float32 entries and a batch counter around a reference; model 4 is far out.
REFERENCE = {"w": np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], np.float32), "b": np.array([0.5, -0.5], np.float32),
             "n": np.array(7)}


def stack() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    models = []
    for i in range(5):
        step = rng.standard_normal(8) * (40.0 if i == 4 else 1.0)
        models.append({"w": (REFERENCE["w"] + step[:6].reshape(2, 3)).astype(np.float32),
                       "b": (REFERENCE["b"] + step[6:]).astype(np.float32), "n": np.array(7 + i)})
    return models


def by_hand(cls_name: str, models: list[dict[str, np.ndarray]], pre: tuple[str, ...] = (), **kwargs: object) -> dict:
    """byzfl called directly on the flattened updates (model − reference), the reference added
    back, reshaped; the counter: the median."""
    import byzfl

    rows = np.stack([np.concatenate([(m["w"] - REFERENCE["w"]).ravel(), (m["b"] - REFERENCE["b"]).ravel()])
                     for m in models]).astype(np.float32)
    for name in pre:
        cls = getattr(byzfl, PRE_AGGREGATORS[name])
        rows = np.asarray(cls(**{k: v for k, v in kwargs.items() if k in inspect.signature(cls).parameters})(rows.copy()))
    cls = getattr(byzfl, cls_name)
    out = np.asarray(cls(**{k: v for k, v in kwargs.items() if k in inspect.signature(cls).parameters})(rows))
    return {"w": (out[:6].reshape(2, 3) + REFERENCE["w"]).astype(np.float32), "b": (out[6:] + REFERENCE["b"]).astype(np.float32),
            "n": np.array(9)}


def test_the_names_that_take_f_are_byzfls() -> None:
    import byzfl

    takes = {name for name, cls in {**AGGREGATORS, **PRE_AGGREGATORS}.items()
             if "f" in inspect.signature(getattr(byzfl, cls).__init__).parameters}
    assert takes == set(TAKES_F)


@pytest.mark.parametrize("name", sorted(AGGREGATORS))
def test_each_aggregator_is_byzfls_on_the_same_stack(name: str) -> None:
    """Our call of every aggregator equals byzfl's own on the updates of a small stack."""
    models = stack()
    f = 1
    mean = Mean(name, (), f, reference=REFERENCE)
    np.random.seed(0)
    ours = mean(models, [1.0, 2.0, 3.0, 4.0, 5.0])  # weights play no part in a robust aggregator
    np.random.seed(0)
    theirs = by_hand(AGGREGATORS[name], models, f=f)
    for key in ("w", "b"):
        np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-6, atol=1e-6)
        assert ours[key].dtype == np.float32
    assert ours["n"] == 9 and ours["n"].dtype == np.asarray(7).dtype


@pytest.mark.parametrize("pre", sorted(PRE_AGGREGATORS))
def test_each_pre_aggregator_then_trmean_is_byzfls(pre: str) -> None:
    models = stack()
    mean = Mean("trmean", (pre,), 1, bucket_size=2, clip_threshold=3.0, reference=REFERENCE)
    np.random.seed(1)
    ours = mean(models)
    np.random.seed(1)
    theirs = by_hand("TrMean", models, (pre,), f=1, s=2, c=3.0)
    for key in ("w", "b"):
        np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-6, atol=1e-6)


def test_the_robust_chain_acts_on_updates_not_models() -> None:
    """Clipping bounds the update (model − the model it was sent), not the model: models far from
    the origin with small updates pass unclipped."""
    models = stack()[:4]
    clipped = Mean("average", ("clipping",), 0, clip_threshold=100.0, reference=REFERENCE)(models)
    np.testing.assert_allclose(clipped["w"], mean_models(models)["w"], rtol=1e-6)
    # with deltas=True the vectors are the updates themselves
    deltas = [{k: (m[k] - REFERENCE[k]).astype(np.float32) for k in ("w", "b")} for m in models]
    direct = Mean("average", (), 0, reference=REFERENCE)(deltas, deltas=True)
    np.testing.assert_allclose(direct["w"], np.mean([d["w"] for d in deltas], axis=0), rtol=1e-6)


def test_the_plain_mean_is_the_methods_own() -> None:
    models = stack()
    mean = Mean()
    assert not mean.robust
    np.testing.assert_array_equal(mean(models)["w"], mean_models(models)["w"])
    np.testing.assert_array_equal(mean(models, [1, 2, 3, 4, 5])["w"], weighted_mean_models(models, [1, 2, 3, 4, 5])["w"])


def test_the_median_resists_the_outlier_that_moves_the_plain_mean() -> None:
    models = stack()
    plain = mean_models(models)["w"]
    robust = Mean("median", reference=REFERENCE)(models)["w"]
    honest = mean_models(models[:4])["w"]
    assert np.abs(robust - honest).max() < np.abs(plain - honest).max() / 3


def test_a_round_with_fewer_updates_than_f_allows_is_refused_not_aggregated() -> None:
    with pytest.raises(AggregationRefused, match="f"):
        Mean("krum", (), 2, reference=REFERENCE)(stack()[:4])


@pytest.mark.parametrize(("overrides", "key", "words"), [
    (["strategy.defence.aggregator=bulyan"], "strategy.defence.aggregator", "mean, average, median"),
    (["strategy.defence.aggregator=krum", "strategy.defence.f=3", "clients_per_round=6"], "strategy.defence.f",
     "6 updates per aggregation (clients_per_round)"),
    (["strategy.defence.aggregator=trmean", "strategy.defence.f=5", "clients_per_round=10"], "strategy.defence.f", "byzfl"),
    (["strategy.defence.pre_aggregators=[bucketing]", "strategy.defence.aggregator=trmean", "strategy.defence.f=1",
      "strategy.defence.bucket_size=5", "clients_per_round=10"], "strategy.defence.f", "bucketing → trmean"),
    (["strategy.defence.pre_aggregators=[nnm]"], "strategy.defence.pre_aggregators", "aggregator=mean"),
    (["strategy.defence.f=1"], "strategy.defence.f", "takes f"),
    (["strategy.defence.bucket_size=3", "strategy.defence.aggregator=median"], "strategy.defence.bucket_size", "bucketing"),
    (["strategy.defence.krum_screen=true"], "strategy.defence.f", "at least 1"),
    (["strategy.defence.krum_screen=true", "strategy.defence.f=2", "clients_per_round=6"], "strategy.defence.f",
     "Krum needs n > 2f + 2"),
    (["strategy.defence.aggregator=mda", "strategy.defence.f=10", "num_clients=100", "clients_per_round=100"],
     "strategy.defence.aggregator", "subsets"),
    (["strategy=fedbuff", "strategy.defence.aggregator=krum", "strategy.defence.f=3", "clients_per_round=10"],
     "strategy.defence.f", "5 updates per aggregation (strategy.asynchronous.buffer_size)"),
])
def test_bad_values_are_refused_before_the_first_round_naming_them(overrides: list[str], key: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose(["num_clients=100", *overrides])
    assert err.value.key == key and words in str(err.value), err.value


def test_a_run_made_with_the_retired_robust_mean_resumes_as_it_ran() -> None:
    from strategies.defence import DefenceSettings

    base = {k: v for k, v in DefenceSettings().to_dict().items() if k not in ("aggregator",)}
    assert DefenceSettings.from_dict({**base, "robust_mean": "median", "trim_fraction": 0.1}).aggregator == "median"
    assert DefenceSettings.from_dict({**base, "robust_mean": "none", "trim_fraction": 0.1}).aggregator == "mean"
    with pytest.raises(ConfigError) as err:
        DefenceSettings.from_dict({**base, "robust_mean": "trimmed", "trim_fraction": 0.1})
    assert err.value.key == "strategy.defence.robust_mean" and "aggregator=trmean" in str(err.value)


@pytest.mark.parametrize(("preset", "strategies", "expected"), [
    ("one_model", ("fedavg", "fedprox", "scaffold", "fednova", "fedbuff", "fedexp", "feddyn", "fedmut"),
     {"screen": 0.0, "sign_screen": 0.5, "adaptive_clip": 2.0, "adaptive_clip_to": "median"}),
    ("per_model", ("fedmr", "fedcross", "fedmr_async"),
     {"sign_screen": 0.5, "adaptive_clip": 2.0, "adaptive_clip_to": "median", "norm_screen": 3.0, "refill": "median"}),
    ("trust", ("fedavg", "scaffold", "fedmr", "fedcross", "fedmut", "fedbuff"), {"trust_root": 100}),
])
def test_each_defence_preset_composes_with_its_methods_and_sets_what_it_says(preset: str, strategies: tuple[str, ...],
                                                                              expected: dict) -> None:
    """``+strategy/defence=<preset>`` (conf/strategy/defence/) passes validation with every method it is
    the default of, at the bench's K = 10, and sets exactly its values (the rest stay the defaults)."""
    from strategies.defence import DefenceSettings

    defaults = DefenceSettings().to_dict()
    for strategy in strategies:
        defence = compose([f"strategy={strategy}", "num_clients=10", "clients_per_round=10",
                           f"+strategy/defence={preset}"]).strategy.defence
        got = {k: v if isinstance(v, (str, int, float)) else list(v)
               for k, v in dict(defence).items() if k in defaults and v != defaults[k]}
        assert got == expected, (strategy, got)


@pytest.mark.parametrize("strategy", ["fedavg", "scaffold", "fedmr", "fedcross"])
def test_the_attack_bench_defence_is_the_preset_its_table_calls_default(strategy: str) -> None:
    """bench/faults.py's defence of each method composes to the same settings as the preset
    bench/field_attacks.py calls its default: the field table's "default" column is the preset."""
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location("field_attacks", bench / "field_attacks.py")
        field = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(field)
        import faults
    finally:
        sys.path.remove(str(bench))
    base = [f"strategy={strategy}", "num_clients=10", "clients_per_round=10"]
    preset = compose([*base, *field.defence_overrides(strategy, "default")]).strategy.defence
    assert dict(compose([*base, *faults.default_defence(strategy)]).strategy.defence) == dict(preset)


@pytest.mark.parametrize("overrides", [["strategy.defence.aggregator=krum"], ["strategy.defence.aggregator=trmean"],
                                       ["strategy.defence.aggregator=median", "strategy.defence.pre_aggregators=[nnm]"]])
def test_an_aggregator_that_tolerates_f_hostile_updates_refuses_to_run_without_f(overrides: list[str]) -> None:
    """``f`` left at 0 would make krum keep one update and trmean or nnm the plain mean, silently:
    refused before the first round, naming ``f`` and what takes it."""
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    taker = next(o.split("=")[1].strip("[]") for o in overrides if "krum" in o or "trmean" in o or "nnm" in o)
    assert err.value.key == "strategy.defence.f" and f"at least 1 with {taker}" in str(err.value)
    assert compose([*overrides, "strategy.defence.f=1"]).strategy.defence.f == 1


def test_a_run_whose_aggregator_refuses_every_round_ends_with_that_refusal_as_its_reason(tmp_path) -> None:  # noqa: ANN001
    """A real in-process run of three nodes, one of which fails every round: the trimmed mean with
    f = 1 takes the three updates it was configured for (n > 2f), never the two that come back.
    The run ends as failed after max_failed_rounds rounds, and summary.json and the error say
    that the aggregator refused the round's updates, not that a node did not answer."""
    import json

    from flwr.app import Context, Message
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp

    from client_app import client_app as real
    from fedmm.config import to_container
    from fedmm.local_engine import run_local_simulation
    from server_app.runner import run_experiment
    from strategies.ledger import RunFailed

    run_dir = tmp_path / "run"
    cfg = to_container(compose(["num_rounds=2", "num_clients=3", "clients_per_round=3", "training.local_epochs=1",
                                "max_failed_rounds=2", "strategy.defence.aggregator=trmean", "strategy.defence.f=1",
                                "simulation.vectorize=off", f"output_dir={run_dir}"]))
    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        if int(context.node_config["partition-id"]) == 0:
            raise RuntimeError("partition 0 is down")
        return real.train(msg, context)

    errors: list[BaseException] = []
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            run_experiment(grid, cfg, num_supernodes=3)
        except RunFailed as err:
            errors.append(err)

    run_local_simulation(server_app=server, client_app=client, num_supernodes=3)
    summary = json.loads((run_dir / "summary.json").read_text())
    # round 1 ran (evaluated, checkpointed) and aggregated nothing; round 2's failure ended the run
    assert summary["status"] == "failed" and summary["rounds_completed"] == 1, summary
    for said in (summary["reason"], str(errors[0])):
        # the refusal is the reason, first: not "no client reply was accepted", not the absent node
        assert said.removeprefix("RunFailed: ").startswith("strategy.defence.aggregator=trmean refused the round's 2 "
                                                           "updates (Cannot tolerate 2f ≥ n. Got f=1, n=2)"), said
        assert "no client reply" not in said and "partition 0 is down" not in said, said
