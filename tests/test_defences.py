"""The optional defences: update-norm bounding and robust means, off by default."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from fedmm import protocol
from fedmm.config import compose, discover
from strategies import build_strategy
from fedmm.errors import ConfigError
from fedmm.protocol import ClientUpdate
from strategies.defence import Defence, DefenceSettings, defend
from tests.fakes import FakeGrid


def update(w: list[float], sent: list[float], node: int = 0) -> ClientUpdate:
    return ClientUpdate(node, node, {"w": np.array(w, np.float32), "n": np.array(6)}, 10.0, {})


def test_the_stage_by_hand() -> None:
    """Fixed bound, adaptive bound (× the median norm) and the screen (cosine to the median
    update), each against the model the update was sent; integer buffers are not updates."""
    sent = {"w": np.zeros(2, np.float32), "n": np.array(5)}
    stage = Defence(DefenceSettings(clip_update_norm=1.0))
    verdict = stage.screen_and_bound([update([3.0, 4.0], sent), update([0.3, 0.4], sent)], [sent, sent])
    np.testing.assert_allclose(verdict.kept[0].model["w"], [0.6, 0.8], rtol=1e-6)
    np.testing.assert_array_equal(verdict.kept[1].model["w"], np.array([0.3, 0.4], np.float32))
    assert verdict.kept[0].model["n"] == 6 and verdict.log == {"largest_update_norm": 5.0, "updates_scaled": 1.0}

    sents = [sent, {"w": np.ones(2, np.float32), "n": np.array(5)}, sent, sent]  # per model: the second was sent 1s
    honest = [update([0.6, 0.8], sent), update([1.6, 1.8], sents[1]), update([0.0, 1.0], sent)]
    scaled = update([60.0, 80.0], sent)
    verdict = Defence(DefenceSettings(adaptive_clip=2.0)).screen_and_bound([*honest, scaled], sents)
    assert len(verdict.kept) == 4 and verdict.log["update_norm_bound"] == pytest.approx(2.0)  # median norm 1
    np.testing.assert_allclose(verdict.kept[3].model["w"], [1.2, 1.6], rtol=1e-6)

    flipped, free_rider = update([-6.0, -8.0], sent), update([0.0, 0.0], sent)
    verdict = Defence(DefenceSettings(screen=0.0)).screen_and_bound([*honest, flipped, free_rider], [*sents, sent])
    assert [u.model["w"].tolist() for u in verdict.kept] == [u.model["w"].tolist() for u in honest]
    assert [reason.split(":")[0] for _, reason in verdict.rejected] == ["defence.screen"] * 2
    # fewer than 3 updates: no median to screen against
    assert len(Defence(DefenceSettings(screen=0.0)).screen_and_bound([honest[0], flipped], [sent, sent]).kept) == 2


def test_the_class_screen_rejects_an_update_that_learns_a_class_from_anothers_features() -> None:
    """An output layer of 3 classes on 4 features (class k's images have feature k). Honest
    updates raise the bias of the classes they hold and move those rows towards the class's
    feature; the hostile one holds class 0's images labelled 2: it raises class 2 and moves row 2
    towards feature 0. An update raising a class no other update raises is not compared."""
    sent = {"body": np.zeros(4, np.float32), "out.weight": np.zeros((3, 4), np.float32), "out.bias": np.zeros(3, np.float32)}

    def learner(holds: dict[int, int], lr: float = 1.0) -> dict[str, np.ndarray]:  # {class raised: the feature its rows move to}
        weight, bias = np.zeros((3, 4), np.float32), np.zeros(3, np.float32)
        for k, feature in holds.items():
            weight[k, feature], weight[k, 3] = lr, 0.1 * lr
            bias[k] = lr
        return {"body": np.full(4, 0.5, np.float32), "out.weight": weight, "out.bias": bias}

    honest = [learner({0: 0, 2: 2}), learner({2: 2}, 1.5), learner({0: 0, 1: 1}, 0.8), learner({1: 1}, 1.2)]
    hostile = learner({2: 0})
    alone = {**learner({1: 1}), "out.bias": np.array([-0.5, 0.0, -0.2], np.float32)}  # raises nothing
    models = [*honest, hostile, alone]
    updates = [ClientUpdate(i, i, m, 10.0, {}) for i, m in enumerate(models)]
    verdict = Defence(DefenceSettings(class_screen=0.3)).screen_and_bound(updates, [sent] * len(models))
    assert [u.node_id for u in verdict.kept] == [0, 1, 2, 3, 5]
    assert [reason.split(":")[0] for _, reason in verdict.rejected] == ["defence.class_screen"]
    scores = verdict.scores["class_agreement"]
    # the hostile row 2 (0.99, 0, 0, 0.1)·(0, 0, 1.25, 0.125)/... ≈ 0.01: orthogonal but for feature 3
    assert scores[4] == pytest.approx(0.1 * 0.1 / (np.hypot(1, 0.1) ** 2), abs=1e-6) and np.isnan(scores[5])
    # honest 1's reference for class 2 is the median of honest 0's row and the hostile one: 0.71
    assert min(scores[:4]) > 0.7 and verdict.log["smallest_class_agreement"] == scores[4]
    # an output layer is found by name: a model without one is named in the error
    with pytest.raises(ConfigError) as err:
        Defence(DefenceSettings(class_screen=0.3)).screen_and_bound([update([1.0], {}), update([1.0], {}), update([1.0], {})],
                                                                   [{"w": np.zeros(1, np.float32), "n": np.array(5)}] * 3)
    assert err.value.key == "strategy.defence.class_screen" and "'w'" not in str(err.value) and "w" in str(err.value)


def test_the_sign_screen_rejects_a_flip_that_the_cosine_screen_lets_pass() -> None:
    """Three honest updates; the flipped copy of a fourth update that is nearly orthogonal to
    them (−10 × (1, 1, 1, 0.01, 0.01, −30)) has a small positive cosine to the round's median
    update but the median's sign on 1 of its 6 coordinates. A free rider (no update) agrees on
    none; the honest updates are kept."""
    sent = {"w": np.zeros(6, np.float32), "n": np.array(5)}
    honest = [update([1.0, 1.0, 1.0, 1.0, 1.0, 0.1], sent), update([1.2, 0.9, 1.1, 0.8, 1.0, 0.2], sent),
              update([0.9, 1.1, 0.8, 1.2, 1.1, 0.05], sent)]
    flipped = update([-10.0, -10.0, -10.0, -0.1, -0.1, 300.0], sent)
    free_rider = update([0.0] * 6, sent)
    updates, sents = [*honest, flipped, free_rider], [sent] * 5
    by_cosine = Defence(DefenceSettings(screen=0.0)).screen_and_bound(list(updates), sents)
    assert [u for u in by_cosine.kept if u is flipped] and by_cosine.log["smallest_cosine"] == 0.0  # only the free rider
    by_sign = Defence(DefenceSettings(sign_screen=0.5)).screen_and_bound(list(updates), sents)
    assert len(by_sign.kept) == 3 and all(a is b for a, b in zip(by_sign.kept, honest))
    assert [reason.split(":")[0] for _, reason in by_sign.rejected] == ["defence.sign_screen"] * 2
    assert "sign agreement 0.167" in by_sign.rejected[0][1] and by_sign.log["smallest_sign_agreement"] == 0.0
    assert by_sign.log["updates_screened"] == 2.0
    # the verdict keeps each update's scores, in the round's order
    np.testing.assert_allclose(by_sign.scores["sign_agreement"], [1.0, 1.0, 1.0, 1 / 6, 0.0])
    assert by_cosine.scores["cosine"][4] == 0.0 and by_cosine.scores["cosine"][3] > 0 and "norm_ratio" not in by_cosine.scores


def test_outliers_scaled_to_the_median_norm() -> None:
    """``adaptive_clip_to=median``: an update above the adaptive bound is scaled down to the
    round's median norm, not to the bound; the updates within the bound keep their size."""
    sent = {"w": np.zeros(2, np.float32), "n": np.array(5)}
    norms = [1.0, 1.5, 2.0, 100.0]  # median 1.75, bound 2 × 1.75 = 3.5
    updates = [update([0.6 * n, 0.8 * n], sent) for n in norms]
    to_bound = Defence(DefenceSettings(adaptive_clip=2.0)).screen_and_bound([update(u.model["w"].tolist(), sent) for u in updates],
                                                                            [sent] * 4)
    to_median = Defence(DefenceSettings(adaptive_clip=2.0, adaptive_clip_to="median")).screen_and_bound(updates, [sent] * 4)
    assert [float(np.linalg.norm(u.model["w"])) for u in to_bound.kept] == pytest.approx([1.0, 1.5, 2.0, 3.5], rel=1e-6)
    assert [float(np.linalg.norm(u.model["w"])) for u in to_median.kept] == pytest.approx([1.0, 1.5, 2.0, 1.75], rel=1e-6)
    np.testing.assert_allclose(to_median.kept[3].model["w"], [1.05, 1.4], rtol=1e-6)  # its direction kept
    assert to_median.log["update_norm_bound"] == pytest.approx(3.5) and to_median.log["updates_scaled"] == 1.0
    with pytest.raises(ConfigError) as err:
        compose(["strategy.defence.adaptive_clip_to=median"])
    assert err.value.key == "strategy.defence.adaptive_clip_to"


def test_the_norm_screen_rejects_and_refill_gives_the_slot_the_median_update() -> None:
    """``norm_screen``: an update above the multiple of the round's median norm is rejected (a
    flip boosted × −10 that a direction screen would let pass, too); ``refill=median``: the
    rejected update's slot takes its sent model plus the coordinate-wise median of the kept
    updates (as bounded), with its node and slot and no metrics of its own."""
    sents = [{"w": np.full(2, float(i), np.float32), "n": np.array(5)} for i in range(5)]  # one sent model per slot
    steps = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [3.0, 0.0], [-10.0, -5.0]]  # median norm 1.41; the last 11.2
    updates = [ClientUpdate(i, i, {"w": (sents[i]["w"] + step).astype(np.float32), "n": np.array(6)}, 10.0,
                            {"loss": 1.0}) for i, step in enumerate(steps)]
    verdict = Defence(DefenceSettings(norm_screen=3.0)).screen_and_bound(list(updates), sents)
    assert [u.node_id for u in verdict.kept] == [0, 1, 2, 3] and not verdict.stand_ins
    assert verdict.rejected[0][1].startswith("defence.norm_screen: update norm 7.91× the round's median")
    assert verdict.log["largest_norm_ratio"] == pytest.approx(np.hypot(10, 5) / np.sqrt(2))

    rejected: list[str] = []
    kept, stand_ins = defend(DefenceSettings(norm_screen=3.0, adaptive_clip=2.0, adaptive_clip_to="median",
                                             refill="median"), list(updates), sents, [f"node {i}" for i in range(5)],
                             rejected, {})
    # the kept steps: (1, 0), (0, 1), (1, 1) and (3, 0) scaled to the median norm of the four, 1.207
    np.testing.assert_allclose(kept[3].model["w"] - sents[3]["w"], [1.2071, 0.0], rtol=1e-4)
    [stand_in] = stand_ins
    assert (stand_in.node_id, stand_in.slot, stand_in.metrics, stand_in.num_examples) == (4, 4, {}, 0.0)
    np.testing.assert_allclose(stand_in.model["w"], sents[4]["w"] + [np.median([1, 0, 1, 1.2071]), 0.5], rtol=1e-4)
    assert stand_in.model["w"].dtype == np.float32 and stand_in.model["n"] == 6
    assert rejected == ["node 4: defence.norm_screen: update norm 7.91× the round's median is above 3× "
                        "(its slot takes the round's median update)"]
    with pytest.raises(ConfigError) as err:  # nothing to refill without a screen that rejects
        compose(["strategy=fedmr", "strategy.defence.refill=median", "strategy.defence.adaptive_clip=2.0"])
    assert err.value.key == "strategy.defence.refill"
    with pytest.raises(ConfigError) as err:  # one model: a rejected node is left out of its mean
        compose(["strategy=fedavg", "strategy.defence.refill=median", "strategy.defence.norm_screen=3.0"])
    assert err.value.key == "strategy.defence.refill" and "strategy=fedavg" in str(err.value)


def method_variants(holds: str | None = None) -> list[tuple[str, tuple[str, ...]]]:
    """Every discovered method (that holds ``holds``, when given) under each driver it declares
    besides its default one's: (option, the settings that choose the driver)."""
    from strategies.contract import ASYNC, SYNC

    out = []
    for option, settings in sorted(discover("strategy").items()):
        method = settings.strategy_class
        if holds is not None and method.holds != holds:
            continue
        out.append((option, ()))
        if ASYNC in method.drivers and SYNC in method.drivers:
            out.append((option, ("strategy.asynchronous.enabled=true",)))
    return out


PER_NODE_VARIANTS = method_variants("a model per node")


@pytest.mark.parametrize(("name", "driver"), PER_NODE_VARIANTS, ids=[n + "-async" * bool(d) for n, d in PER_NODE_VARIANTS])
def test_a_refilled_slot_brings_the_global_model_towards_the_honest_round(name: str, driver: tuple[str, ...]) -> None:
    """With the flipped update rejected, its slot left as it was sent drags the method's global
    model (the mean of its K models) back towards the sent model; refilled with the median
    update it does not (every method with a model per node, under each of its drivers)."""
    honest = run_one_round(name, [*driver], None)[0]
    screened = run_one_round(name, [*driver, "strategy.defence.norm_screen=3.0"], "flip")[0]
    refilled = run_one_round(name, [*driver, "strategy.defence.norm_screen=3.0", "strategy.defence.refill=median"], "flip")[0]
    assert np.abs(refilled - honest).max() < np.abs(screened - honest).max() / 2


def test_a_stand_in_is_not_a_reply() -> None:
    """The refilled slot's model is the method's, not the node's: the round counts 4 replies of
    5, its metrics are the kept replies', and the rejection says the slot was refilled."""
    seen: list = []
    one_round("fedmr", ["strategy.defence.norm_screen=3.0", "strategy.defence.refill=median"], "flip", seen)
    strategy, metrics = seen
    assert metrics["replies"] == 4.0 and strategy.context.last_round.replies == 4
    [reason] = strategy.context.last_round.rejections
    assert "defence.norm_screen" in reason and reason.endswith("(its slot takes the round's median update)")


def one_round(strategy_name: str, defence: list[str], attack: str, seen: list | None = None) -> dict[str, np.ndarray]:
    """One round of 5 clients whose honest update is +1 on every weight; client 4 attacks (the
    strategy and the round's metrics go into ``seen``)."""
    strategy = build_strategy(compose([f"strategy={strategy_name}", "num_clients=5", "clients_per_round=5", *defence]))
    initial = {"w": np.zeros(4, np.float32)}
    strategy.initialize(initial)

    def node(msg: Message, key: str) -> RecordDict:
        w = protocol.record_to_model(msg.content[protocol.ARRAYS], copy=True)["w"]
        update = np.ones(4, np.float32)
        if key == "partition:000000004":
            update = update * 100 if attack == "scale" else -update * 10
        return RecordDict({protocol.ARRAYS: protocol.model_to_record({"w": w + update}),
                           protocol.METRICS: MetricRecord({protocol.NUM_EXAMPLES: 10.0})})

    grid = FakeGrid(node, num_nodes=5)
    messages = list(strategy.configure_train(1, protocol.model_to_record(initial), ConfigRecord({"x": 1}), grid))
    out, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    if seen is not None:
        seen += [strategy, metrics]
    return protocol.record_to_model(out)


@pytest.mark.parametrize("name", ["fedavg", "fedmr"])
@pytest.mark.parametrize("attack", ["scale", "flip"])
def test_defences_hold_one_hostile_client_of_five(name: str, attack: str) -> None:
    undefended = one_round(name, [], attack)["w"]
    median = one_round(name, ["strategy.defence.aggregator=median"], attack)["w"]
    bounded = one_round(name, ["strategy.defence.clip_update_norm=2.0"], attack)["w"]
    assert np.abs(undefended - 1).max() > 2  # the attacker moves the plain mean far from +1
    np.testing.assert_allclose(median, 1.0)  # 4 of 5 honest: the median is theirs
    assert np.abs(bounded - 1).max() < np.abs(undefended - 1).max() / 4  # its pull cut to norm 2


def test_a_non_finite_aggregate_keeps_the_previous_models() -> None:
    """Two finite replies whose extrapolated aggregate overflows float32 (FedExP: opposite huge
    updates make its server step size ~1e76): the round logs an error, counts no reply and the
    server keeps the models it had (nothing non-finite reaches a model)."""
    strategy = build_strategy(compose(["strategy=fedexp", "num_clients=2", "clients_per_round=2"]))
    initial = {"w": np.zeros(2, np.float32)}
    strategy.initialize(initial)

    def node(msg: Message, key: str) -> RecordDict:
        sign = 1.0 if key.endswith("0") else -1.0
        return RecordDict({protocol.ARRAYS: protocol.model_to_record({"w": np.array([sign * 3.0e38, 1.0], np.float32)}),
                           protocol.METRICS: MetricRecord({protocol.NUM_EXAMPLES: 10.0})})

    grid = FakeGrid(node, num_nodes=2)
    messages = list(strategy.configure_train(1, protocol.model_to_record(initial), ConfigRecord({"x": 1}), grid))
    with np.errstate(over="ignore"):
        out, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert out is None and metrics["replies"] == 0.0 and strategy.context.last_round.replies == 0
    np.testing.assert_array_equal(strategy.models[0]["w"], initial["w"])
    assert strategy.context.replies.accepted_rounds == {}  # the nodes' state of this round is not kept either


#: Every defence setting, the value that turns it on (with any setting it needs) and the attack it answers.
DEFENCES = [
    ("clip_update_norm", ["2.0"], "scale"),
    ("adaptive_clip", ["1.5"], "scale"),
    ("adaptive_clip_to", ["median", "strategy.defence.adaptive_clip=1.5"], "scale"),
    ("screen", ["0.0"], "flip"),
    ("sign_screen", ["0.5"], "flip"),
    ("norm_screen", ["3.0"], "scale"),
    ("class_screen", ["0.3"], "labelflip"),
    ("refill", ["median", "strategy.defence.norm_screen=3.0"], "flip"),
    ("krum_screen", ["true", "strategy.defence.f=1"], "flip"),
    ("trust_root", ["100"], "flip"),
    ("trust_root", ["100"], "scale"),
    ("aggregator", ["median"], "scale"),
    ("aggregator", ["trmean", "strategy.defence.f=1"], "scale"),
    ("aggregator", ["multikrum", "strategy.defence.f=1"], "scale"),
    ("aggregator", ["geometric_median"], "scale"),
    ("pre_aggregators", ["[nnm]", "strategy.defence.aggregator=trmean", "strategy.defence.f=1"], "scale"),
    ("pre_aggregators", ["[bucketing]", "strategy.defence.aggregator=median", "strategy.defence.bucket_size=2"], "scale"),
    ("pre_aggregators", ["[clipping]", "strategy.defence.aggregator=average", "strategy.defence.clip_threshold=10.0"],
     "scale"),
]
#: Parameters of the settings above (each row that needs one sets it), not defences of their own.
PARAMETERS = {"f", "bucket_size", "clip_threshold"}
#: The settings that act on the mean a method takes, not on each update: shown on the global model.
MEAN_SETTINGS = {"aggregator", "pre_aggregators"}
def all_back(name: str, overrides: list[str]) -> list[str]:
    """Settings that let one round of any method see all 5 replies: on the asynchronous driver,
    every job back before the aggregation (derived from the settings, no method listed)."""
    settings = compose([f"strategy={name}", *[o for o in overrides if o.startswith("strategy.asynchronous.")]]).strategy
    if not settings.asynchronous.enabled:
        return []
    one_model = settings.strategy_class.holds == "one model"
    return ["strategy.asynchronous.buffer_size=5", *(["strategy.asynchronous.concurrency=5"] if one_model else [])]


def run_one_round(name: str, overrides: list[str], attack: str | None) -> list[np.ndarray]:
    """One round through the method's own loop (``start``): 5 nodes whose honest update is
    about +1 on every floating-point weight, partition 4 hostile; the server's models after it
    (the global model first), flattened."""
    import torch

    cfg = compose([f"strategy={name}", "num_clients=5", "clients_per_round=5", *all_back(name, overrides), *overrides])
    strategy = build_strategy(cfg)
    # the server's reference update (the trust stage): the honest direction, +1 on every weight
    strategy.context.reference = lambda sent, _: {k: v + 1 if np.issubdtype(v.dtype, np.floating) else v
                                                  for k, v in sent.items()}
    # a body and a classifier head (FedGen shapes its generator for the head)
    initial = {"body.weight": np.zeros((4, 3), np.float32), "head.weight": np.zeros((3, 4), np.float32),
               "head.bias": np.zeros(3, np.float32), "bn.num_batches_tracked": np.array(0)}
    def node(msg: Message, key: str) -> RecordDict:
        sent = protocol.record_to_model(msg.content[protocol.ARRAYS], copy=True)
        index = int(key[-1])
        out = {}
        for k, v in sent.items():
            step = np.ones_like(v) * (1.0 + 0.1 * index) if np.issubdtype(v.dtype, np.floating) else np.zeros_like(v)
            if attack == "labelflip" and index == 4 and k == "head.weight":  # its classes' rows along other features
                step = np.tile(np.array([3.0, -3.0, 3.0, -3.0], v.dtype), (v.shape[0], 1))
            elif attack in ("scale", "flip") and index == 4:
                step = step * 100 if attack == "scale" else -step * 10
            out[k] = (v + step).astype(v.dtype)
        content = RecordDict({protocol.ARRAYS: protocol.model_to_record(out),
                              protocol.METRICS: MetricRecord({protocol.NUM_EXAMPLES: 10.0})})
        for record, spec in strategy.needs(1).arrays.items():  # SCAFFOLD's Δc, FedGen's label counts
            content[record] = protocol.model_to_record(
                {k: np.full(shape, 10 if record.endswith("counts") else 0.01, dtype) for k, (shape, dtype) in spec.items()})
        for metric in strategy.needs(1).metrics:  # FedNova's normalizer
            content[protocol.METRICS][metric] = 1.0
        return content

    torch.manual_seed(0)
    strategy.start(FakeGrid(node, num_nodes=5), protocol.model_to_record(initial), num_rounds=1, final_report=False)
    models = [strategy.global_model, *(strategy.models or [])]
    return [np.concatenate([np.ravel(m[k]).astype(np.float64) for k in sorted(m)]) for m in models]


ALL_VARIANTS = method_variants()


@pytest.mark.parametrize(("name", "driver"), ALL_VARIANTS, ids=[n + "-async" * bool(d) for n, d in ALL_VARIANTS])
def test_the_class_screen_refuses_a_model_without_an_output_layer_before_any_node_is_asked(name: str, driver: tuple[str, ...]) -> None:
    """The check runs where every round starts (synchronous and asynchronous): no message is
    sent, and the error names the setting and the model's entries."""
    asked = []

    def node(msg: Message, key: str) -> RecordDict:
        asked.append(key)
        raise AssertionError("no node is asked")

    overrides = [*driver, "strategy.defence.class_screen=0.3"]
    try:
        cfg = compose([f"strategy={name}", "num_clients=5", "clients_per_round=5", *all_back(name, overrides), *overrides])
    except ConfigError as err:  # a method that refuses the screen (SOLO) says so when the settings are read
        assert err.key == "strategy.defence.class_screen" and f"strategy={name}" in str(err)
        return
    strategy = build_strategy(cfg)
    body_only = {"body.weight": np.zeros((4, 3), np.float32), "body.scale": np.ones(4, np.float32)}
    with pytest.raises(ConfigError) as err:
        strategy.start(FakeGrid(node, num_nodes=5), protocol.model_to_record(body_only), num_rounds=1, final_report=False)
    assert err.value.key == "strategy.defence.class_screen" and "body.weight, body.scale" in str(err.value) and asked == []


def test_the_table_names_every_defence_setting() -> None:
    assert {name for name, _, _ in DEFENCES} == {f.name for f in dataclasses.fields(DefenceSettings)} - PARAMETERS
    assert PARAMETERS <= {n.split("=")[0].rsplit(".", 1)[-1] for _, needs, _ in DEFENCES for n in needs[1:]}


@pytest.mark.parametrize("name", sorted(discover("strategy")))
def test_every_method_passes_every_defence_or_refuses_it(name: str) -> None:
    """Each defence setting either cuts the pull of a planted outlier on the models of a round
    (against the same round with the same defence and no outlier) to less than half its pull
    undefended, or is refused when the settings are validated, naming the setting and the
    method. Every method found by discovery; nothing is listed per method."""
    every_defence_holds_or_is_refused(name)


def test_the_matrix_fails_a_method_that_bypasses_the_mean_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """A method that averages its replies itself instead of through the run's mean fails the
    matrix (the robust means leave its model where the outlier pulled it); the same method
    through the mean passes."""
    from strategies.aggregation import weighted_mean_models
    from strategies.fedavg import FedAvg, FedAvgSettings

    class Bypassing(FedAvg):
        def aggregate(self, server_round, updates, mean):  # noqa: ANN001, ANN202
            self.models = [weighted_mean_models([u.model for u in updates], [u.num_examples for u in updates])]
            return self.models[0]

    monkeypatch.setattr(FedAvgSettings, "strategy_class", Bypassing)
    with pytest.raises(AssertionError, match="aggregator=median against scale"):
        every_defence_holds_or_is_refused("fedavg")


def every_defence_holds_or_is_refused(name: str) -> None:
    """The body of the every-method matrix (its docstring), for the method ``strategy=name`` builds."""
    honest = run_one_round(name, [], None)
    attacked = {attack: run_one_round(name, [], attack) for attack in ("scale", "flip", "labelflip")}
    for setting_name, (value, *needs), attack in DEFENCES:
        key = f"strategy.defence.{setting_name}"
        try:
            defended = run_one_round(name, [f"{key}={value}", *needs], attack)
        except ConfigError as err:  # naming the setting, or the one it needs
            assert err.key in {key, *(n.split("=")[0] for n in needs)} and f"strategy={name}" in str(err), err
            continue
        undefended = attacked[attack]
        # the attack's pull under the defence, against the same round with the same defence and no
        # attacker: what the defence does to honest updates (clipping them, say) is not the attack's
        defended_honest = run_one_round(name, [f"{key}={value}", *needs], None)
        # the stage acts on every model; a robust mean is the mean the method takes (its global model)
        shown = slice(None) if setting_name not in MEAN_SETTINGS else slice(0, 1)
        gap = max(np.abs(d - h).max() for d, h in zip(defended[shown], defended_honest[shown]))
        before = max(np.abs(u - h).max() for u, h in zip(undefended[shown], honest[shown]))
        assert gap < before / 2, f"{name} with {key}={value} against {attack}: {gap:.3g} vs {before:.3g} undefended"


def test_secure_recombination_refuses_the_stage_and_keeps_the_aggregator() -> None:
    """An upload of secure FedMR is recombined among clients: no update against a sent model."""
    for name in ("clip_update_norm=1.0", "adaptive_clip=2.0", "screen=0.0"):
        with pytest.raises(ConfigError) as err:
            compose(["strategy=fedmr", "strategy.secure.enabled=true", f"strategy.defence.{name}"])
        assert err.value.key == f"strategy.defence.{name.split('=')[0]}" and "strategy.secure.enabled=true" in str(err.value)
    run = compose(["strategy=fedmr", "strategy.secure.enabled=true", "strategy.defence.aggregator=median"])
    assert run.strategy.defence.aggregator == "median"


def test_from_round_2_each_update_is_judged_against_the_model_its_node_was_sent() -> None:
    """FedMR's nodes get recombined models from round 2 on, which are not the global model. Honest
    updates under the bound pass the norm bound untouched, so two rounds with it equal two rounds
    without; judged against the global model instead, an update (its step plus the distance of its
    recombined model from the mean) is over the bound and would be cut."""
    n = 12
    steps = {"0": 5.0, "1": -5.0, "2": 5.0}  # every honest step has norm 5·√n
    bound = 1.2 * 5.0 * np.sqrt(n)

    def two_rounds(defence: list[str]) -> tuple[list[np.ndarray], list[dict[str, np.ndarray]]]:
        sent: list[dict[str, np.ndarray]] = []

        def node(msg: Message, key: str) -> RecordDict:
            model = protocol.record_to_model(msg.content[protocol.ARRAYS], copy=True)
            sent.append({"key": key, "round": msg.content[protocol.CONFIG][protocol.SERVER_ROUND], **model})
            step = steps[key[-1]]
            return RecordDict({protocol.ARRAYS: protocol.model_to_record({k: v + step for k, v in model.items()}),
                               protocol.METRICS: MetricRecord({protocol.NUM_EXAMPLES: 10.0})})

        strategy = build_strategy(compose(["strategy=fedmr", "num_clients=3", "clients_per_round=3", "seed=1", *defence]))
        initial = {"a.weight": np.zeros(4, np.float32), "b.weight": np.zeros(4, np.float32), "c.weight": np.zeros(4, np.float32)}
        strategy.start(FakeGrid(node, num_nodes=3), protocol.model_to_record(initial), num_rounds=2, final_report=False)
        return [strategy.global_model[k] for k in sorted(initial)] + [m[k] for m in strategy.models for k in sorted(m)], sent

    plain, sent = two_rounds([])
    bounded, _ = two_rounds([f"strategy.defence.clip_update_norm={bound}"])
    second = [s for s in sent if s["round"] == 2]
    keys = ("a.weight", "b.weight", "c.weight")
    mean = {k: np.mean([s[k] for s in second], axis=0) for k in keys}  # the global model after round 1
    to_global = {s["key"]: np.sqrt(sum(float(np.sum((s[k] + steps[s["key"][-1]] - mean[k]) ** 2)) for k in keys))
                 for s in second}
    assert max(to_global.values()) > bound  # the test can tell: against the global model one update is cut
    assert any(not np.array_equal(s["a.weight"], mean["a.weight"]) for s in second)
    for p, b in zip(plain, bounded):
        np.testing.assert_array_equal(p, b)


def test_a_round_whose_updates_the_aggregator_cannot_take_keeps_the_models(caplog: pytest.LogCaptureFixture) -> None:
    """Krum with f = 2 takes 5 updates (2f < n) but not the 4 of a round where a node's reply
    never came: the round aggregates nothing, says why, and counts no reply."""
    strategy = build_strategy(compose(["strategy=fedavg", "num_clients=5", "clients_per_round=5",
                                       "strategy.defence.aggregator=krum", "strategy.defence.f=2", "round_timeout=1"]))
    initial = {"w": np.zeros(4, np.float32)}

    def node(msg: Message, key: str) -> RecordDict:
        w = protocol.record_to_model(msg.content[protocol.ARRAYS], copy=True)["w"]
        return RecordDict({protocol.ARRAYS: protocol.model_to_record({"w": w + 1}),
                           protocol.METRICS: MetricRecord({protocol.NUM_EXAMPLES: 10.0})})

    grid = FakeGrid(node, num_nodes=5, drop=["partition:000000003"])
    strategy.start(grid, protocol.model_to_record(initial), num_rounds=1, timeout=0.5, final_report=False)
    np.testing.assert_array_equal(strategy.models[0]["w"], initial["w"])
    assert strategy.context.last_round.replies == 0
    assert "strategy.defence.aggregator=krum refused the round's 4 updates" in caplog.text


@pytest.mark.parametrize(("n", "f"), [(7, 2), (5, 2), (3, 0)])
def test_krum_scores_are_the_sums_of_the_nearest_squared_distances_by_hand(n: int, f: int) -> None:
    """Each score is the sum of the n − f − 2 smallest squared distances to the other updates, over
    every floating entry together (two entries here); with fewer than f + 3 updates there is none."""
    from strategies.defence import krum_scores

    rng = np.random.default_rng(n * 10 + f)
    deltas = [{"a": rng.normal(size=(3, 2)), "b": rng.normal(size=4) * (i + 1)} for i in range(n)]
    flat = [np.concatenate([d["a"].ravel(), d["b"]]) for d in deltas]
    expected = [sum(sorted(float(np.sum((flat[i] - flat[j]) ** 2)) for j in range(n) if j != i)[: n - f - 2])
                for i in range(n)]
    np.testing.assert_allclose(krum_scores(deltas, ["a", "b"], f), expected, rtol=1e-10)
    assert krum_scores(deltas[: f + 2], ["a", "b"], f) is None
