"""Heterogeneous clients, the virtual clock, FedBuff and the asynchronous FedMR / FedCross
(docs/async.md): speeds fixed by seed and key with exact tier shares, a synchronous round as
long as its slowest client, the deadline, FedBuff's step by hand, concurrency, the staleness
bound, the reduction to the synchronous methods, dropped clients, order independent of arrival,
resume, the config rules, and one real simulation of every new option."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import MetricRecord, RecordDict

from fedmm import protocol
from fedmm.protocol import model_to_record, record_to_model
from strategies.fedavg import FedAvg
from strategies.fedbuff import FedBuff as FedBuffMethod
from strategies.fedcross import FedCross
from strategies.fedmr import FedMR
from strategies.heterogeneity import HeterogeneitySettings, LocalWork, VirtualClock
from strategies.selection import SeededRosterSelector
from tests.fakes import FakeGrid
from tests.sim_apps import arrays_digest


def key(i: int) -> str:
    return f"partition:{i:09d}"


def initial(width: int = 3):
    return model_to_record({"a.weight": np.zeros((width,), np.float32), "b.weight": np.zeros((2, 2), np.float32),
                            "bn.num_batches_tracked": np.array(0, np.int64)})


def trainer(msg, node_key):
    """A node shrinks the model it got and adds its partition number: replies are traceable and
    depend on the model sent (a plain float32 step, as a client's)."""
    model = record_to_model(msg.content["arrays"])
    p = int(node_key.split(":")[1])
    out = {k: (v * np.float32(0.9) + np.float32(0.1 * (p + 1) + 0.01 * j) if v.dtype == np.float32 else v + 1)
           for j, (k, v) in enumerate(model.items())}
    return RecordDict({"arrays": model_to_record(out), "metrics": MetricRecord({"num-examples": 100.0, "train_loss": float(p)})})


def sized(sizes: dict[str, int], node_fn=trainer):
    """``node_fn`` replying with the node's size (what the roster reported)."""
    def node(msg, node_key):
        reply = node_fn(msg, node_key)
        reply["metrics"] = MetricRecord({**dict(reply["metrics"]), "num-examples": float(sizes[node_key])})
        return reply
    return node


#: The asynchronous driver's settings (strategy.asynchronous).
DRIVER_KEYS = ("buffer_size", "max_staleness", "concurrency")


def on_the_async_driver(cls: type) -> type:
    """``cls`` built with the asynchronous driver, its driver settings given as keywords (``buffer_size=2``)."""

    def build(*args, **settings):  # noqa: ANN002, ANN003, ANN202
        driver = {"enabled": True, **{k: settings.pop(k) for k in DRIVER_KEYS if k in settings}}
        return cls(*args, asynchronous=driver, **settings)

    build.__name__ = build.__qualname__ = f"{cls.__name__}Async"
    return build


FedBuff = on_the_async_driver(FedBuffMethod)
FedMRAsync = on_the_async_driver(FedMR)
FedCrossAsync = on_the_async_driver(FedCross)


def roster(seed: int = 0) -> SeededRosterSelector:
    """The fedmm app's selector: nodes ordered by key, sizes from the roster query."""
    return SeededRosterSelector(seed, query_config={protocol.ROSTER_EXAMPLES: 1})


def heterogeneity(**changes) -> dict:
    return {"heterogeneity": HeterogeneitySettings().replace(**changes)}


def run(strategy, grid, rounds: int, timeout: float = 5.0, arrays=None, **kwargs):
    return strategy.start(grid, arrays or initial(), num_rounds=rounds, timeout=timeout, final_report=False, **kwargs)


def same_models(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert list(x) == list(y)
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
            assert x[k].dtype == y[k].dtype


# ============================================================================ the virtual clock
def test_multipliers_are_fixed_by_seed_and_key_and_tier_shares_are_exact() -> None:
    keys = [key(i) for i in range(10)]
    tiers = HeterogeneitySettings(profile="tiers", tiers=[[0.2, 10.0], [0.3, 3.0]])

    def speeds(seed: int, order: list[str]) -> dict[str, float]:
        clock = VirtualClock(tiers, seed)
        clock.set_roster(order)
        return {k: clock.multiplier(k) for k in keys}

    first = speeds(0, keys)
    assert sorted(first.values()) == [1.0] * 5 + [3.0] * 3 + [10.0] * 2  # exactly 20 % and 30 % of 10
    assert speeds(0, keys[::-1]) == first  # the same on every run, however the roster comes
    other = speeds(1, keys)
    assert sorted(other.values()) == sorted(first.values()) and other != first  # the seed picks who
    # the seed of the heterogeneity group wins over the run's (fixed stragglers across seeds)
    fixed = VirtualClock(tiers.replace(seed=0), seed=1)
    fixed.set_roster(keys)
    assert {k: fixed.multiplier(k) for k in keys} == first
    lognormal = VirtualClock(HeterogeneitySettings(profile="lognormal", sigma=0.5), 0)
    values = [lognormal.multiplier(k) for k in keys]
    assert values == [VirtualClock(HeterogeneitySettings(profile="lognormal", sigma=0.5), 0).multiplier(k) for k in keys]
    assert len(set(values)) == 10 and all(v > 0 for v in values)
    # modelled work: ⌈n / batch⌉ × epochs batches (or local_steps) × seconds_per_batch × multiplier
    clock = VirtualClock(HeterogeneitySettings(seconds_per_batch=0.5), 0, LocalWork(batch_size=10, local_epochs=3))
    assert clock.duration(key(0), 25) == 3 * 3 * 0.5
    assert VirtualClock(work=LocalWork(local_steps=7)).duration(key(0), 25) == 7 * 0.05
    assert clock.duration(key(0), None) is None


def test_availability_is_periodic_reproducible_and_exact_in_share() -> None:
    keys = [key(i) for i in range(10)]
    settings = HeterogeneitySettings(offline_fraction=0.3, offline_period=100.0, offline_share=0.25)
    clock = VirtualClock(settings, 0)
    clock.set_roster(keys)
    cycling = [k for k in keys if clock.online_until(k, 0.0) != math.inf]
    assert len(cycling) == 3
    for k in cycling:
        offline = [t for t in np.arange(0, 200, 0.5) if not clock.online(k, float(t))]
        assert len(offline) == 2 * 25 / 0.5  # a quarter of each 100 s cycle
        t = offline[0]
        assert clock.next_online(k, t) > t and clock.online(k, clock.next_online(k, t))
        assert clock.cut(k, float(t), 1.0)[1].startswith("offline at virtual time")
    always = next(k for k in keys if k not in cycling)
    assert clock.cut(always, 0.0, 5.0) == (5.0, "")


NODE_N = {key(i): 10 * (i + 1) for i in range(4)}
W0 = model_to_record({"w": np.zeros((2,), np.float32)})


def constant_node(msg, node_key):
    """Every node trains to (partition + 1) and reports its size: FedAvg's mean is easy by hand."""
    p = int(node_key.split(":")[1])
    model = {"w": np.full((2,), float(p + 1), np.float32)}
    return RecordDict({"arrays": model_to_record(model), "metrics": MetricRecord({"num-examples": float(NODE_N[node_key])})})


def tiered_fedavg(**changes) -> tuple[FedAvg, VirtualClock]:
    settings = HeterogeneitySettings(profile="tiers", tiers=[[0.25, 10.0]], seconds_per_batch=1.0, **changes)
    strategy = FedAvg(4, seed=0, selector=roster(), heterogeneity=settings)
    strategy.context.clock.work = LocalWork(batch_size=10, local_epochs=1)
    return strategy, strategy.context.clock


def test_a_synchronous_round_lasts_as_long_as_its_slowest_client() -> None:
    strategy, clock = tiered_fedavg()
    grid = FakeGrid(constant_node, num_nodes=4, examples=NODE_N)
    rows = []
    run(strategy, grid, 2, arrays=W0, round_end=lambda r, a, res: rows.append(dict(strategy.round_log)))
    slow = [k for k in NODE_N if clock.multiplier(k) == 10.0]
    assert len(slow) == 1  # a quarter of 4
    # all 4 nodes every round: the slowest is max(batches × multiplier)
    longest = max((NODE_N[k] // 10) * clock.multiplier(k) for k in NODE_N)
    assert [r["virtual_time"] for r in rows] == [longest, 2 * longest]
    assert longest >= 10.0 and strategy.context.last_round.replies == 4


def test_the_deadline_rejects_the_straggler_by_name_and_the_round_goes_on() -> None:
    strategy, clock = tiered_fedavg(deadline=6.0)
    grid = FakeGrid(constant_node, num_nodes=4, examples=NODE_N)
    result = run(strategy, grid, 1, arrays=W0)
    slow = next(k for k in NODE_N if clock.multiplier(k) == 10.0)
    slow_node = next(n for n, k in grid.keys.items() if k == slow)
    assert strategy.context.last_round.replies == 3
    assert len(strategy.context.last_round.rejections) == 1
    assert f"node {slow_node}" in strategy.context.last_round.rejections[0] and "straggler" in strategy.context.last_round.rejections[0]
    assert strategy.round_log["virtual_time"] == 6.0  # the server waited until the deadline
    others = [k for k in NODE_N if k != slow]
    expected = sum((int(k[-1]) + 1) * NODE_N[k] for k in others) / sum(NODE_N[k] for k in others)
    np.testing.assert_allclose(record_to_model(result.arrays)["w"], expected, rtol=1e-6)


# ============================================================================ FedBuff
SIZES = {key(0): 20, key(1): 50, key(2): 130}  # 2, 5 and 13 batches: 1, 2.5 and 6.5 virtual seconds
DELTAS = {key(0): np.array([1.0, 0.0], np.float32), key(1): np.array([0.0, 1.0], np.float32),
          key(2): np.array([100.0, 100.0], np.float32)}


def adder(msg, node_key):
    model = record_to_model(msg.content["arrays"])
    return RecordDict({"arrays": model_to_record({"w": model["w"] + DELTAS[node_key]}),
                       "metrics": MetricRecord({"num-examples": float(SIZES[node_key])})})


def fedbuff(**settings) -> FedBuff:
    strategy = FedBuff(3, seed=0, selector=roster(), buffer_size=2, server_lr=0.5,
                       **heterogeneity(seconds_per_batch=0.5), **settings)
    strategy.context.clock.work = LocalWork(batch_size=10, local_epochs=1)
    return strategy


def run_fedbuff(strategy: FedBuff, rounds: int) -> list[np.ndarray]:
    grid = FakeGrid(adder, num_nodes=3, examples=SIZES)
    models = []
    strategy.start(grid, model_to_record({"w": np.zeros(2, np.float32)}), num_rounds=rounds, timeout=5.0,
                   final_report=False, round_end=lambda r, arrays, res: models.append(record_to_model(arrays)["w"]))
    return models


def test_fedbuff_step_weighs_staleness_and_applies_the_server_lr_as_by_hand() -> None:
    """A (1 s), B (2.5 s), C (6.5 s), C = 3, B = 2, η_g = 0.5. t=1: A (τ 0); t=2: A again (τ 0):
    θ1 = θ0 + η(dA + dA)/2. t=2.5: B, sent θ0 (τ 1, weight 1/√2); t=3: A (τ 0):
    θ2 = θ1 + η(dB/√2 + dA)/2. C never makes it in time."""
    strategy = fedbuff()
    models = run_fedbuff(strategy, 2)
    d_a, d_b = DELTAS[key(0)].astype(np.float64), DELTAS[key(1)].astype(np.float64)
    theta1 = 0.5 * (d_a + d_a) / 2
    theta2 = theta1 + 0.5 * (d_b / math.sqrt(2) + d_a) / 2
    np.testing.assert_allclose(models[0], theta1, rtol=1e-6)
    np.testing.assert_allclose(models[1], theta2, rtol=1e-6)
    assert strategy.context.clock.now == 3.0 and strategy.round_log["staleness_max"] == 1.0


def test_fedbuff_max_staleness_drops_the_too_stale_update() -> None:
    """max_staleness 0: B's update (τ 1) is dropped with its node named; t=3 and t=4: A twice."""
    strategy = fedbuff(max_staleness=0)
    models = run_fedbuff(strategy, 2)
    d_a = DELTAS[key(0)].astype(np.float64)
    np.testing.assert_allclose(models[1], 0.5 * d_a + 0.5 * d_a, rtol=1e-6)
    assert any("staleness 1 exceeds max_staleness (0)" in r for r in strategy.context.last_round.rejections)
    assert strategy.context.clock.now == 4.0


def test_fedbuff_never_has_more_than_c_jobs_in_flight_and_a_node_one_at_a_time() -> None:
    grid = FakeGrid(trainer, num_nodes=4)
    strategy = FedBuff(4, seed=0, concurrency=3, buffer_size=3)
    seen = []
    push = grid.push_messages

    def watched(messages):
        messages = list(messages)
        ids = push(messages)
        nodes = [job.node for job in strategy.context.driver.jobs.values()]
        seen.append(len(strategy.context.driver.jobs))
        assert len(nodes) == len(set(nodes))  # no node trains two models at once
        return ids

    grid.push_messages = watched
    run(strategy, grid, 5)
    assert max(seen) == 3 and strategy.context.driver.version == 5
    # jobs of one node with one server-round differ in round-repeat (their clients' seeds differ)
    sent = [(m.content["config"]["server-round"], m.metadata.dst_node_id, m.content["config"].get("round-repeat", 0))
            for m in grid.sent]
    assert len(set(sent)) == len(sent) and any(repeat for _, _, repeat in sent)


def test_async_multimodel_max_staleness_restarts_the_stale_model_from_the_global_model() -> None:
    """K = 2 models on A (1 s) and B (2.5 s), B = 1, max_staleness 0: A's model is aggregated at
    t=1 and t=2; B's comes back at t=2.5 two aggregations late and restarts from the global model."""
    sizes = {key(0): SIZES[key(0)], key(1): SIZES[key(1)]}
    strategy = FedMRAsync(2, seed=0, selector=roster(), buffer_size=1, max_staleness=0,
                          **heterogeneity(seconds_per_batch=0.5))
    strategy.context.clock.work = LocalWork(batch_size=10, local_epochs=1)
    grid = FakeGrid(sized(sizes, adder), num_nodes=2, examples=sizes)
    globals_, rejections = [], []
    strategy.start(grid, model_to_record({"w": np.zeros(2, np.float32)}), num_rounds=3, timeout=5.0, final_report=False,
                   round_end=lambda r, a, res: (globals_.append(record_to_model(a)), rejections.append(strategy.context.last_round.rejections)))
    fast = next(job.model_index for job in strategy.context.driver.jobs.values() if job.key == key(0))  # out on A for a third time
    stale = 1 - fast
    assert strategy.context.clock.now == 2.5 and rejections[2] and "restarts from the global model" in rejections[2][0]
    same_models([strategy.models[stale]], [globals_[1]])  # the global model of round 2, not B's training
    # a global model is the mean of the K models: A's (2·dA at round 2) and the one still out (0)
    np.testing.assert_array_equal(globals_[1]["w"], DELTAS[key(0)])
    np.testing.assert_array_equal(strategy.models[fast]["w"], 2 * DELTAS[key(0)])  # A trained it twice


# ============================================================================ reduction to sync
@pytest.mark.parametrize("method", ["fedmr", "fedcross"])
@pytest.mark.parametrize("speeds", ["equal", "tiers"])
def test_with_b_equal_k_the_async_method_is_the_synchronous_one(method: str, speeds: str) -> None:
    """B = K: 3 aggregations give the synchronous method's models and global models bit for bit,
    and the same virtual time (equal speeds; with a 10× tier too: the barrier makes speed moot).
    Stages count aggregations as rounds (FedMR: a first stage; FedCross: dynamic α). One node
    always fails: its model comes back as it was sent, in both."""
    sync_cls, async_cls = {"fedmr": (FedMR, FedMRAsync), "fedcross": (FedCross, FedCrossAsync)}[method]
    settings = heterogeneity(profile="tiers", tiers=[[0.25, 10.0]]) if speeds == "tiers" else {}
    settings.update({"fedmr": {"first_stage_rounds": 1}, "fedcross": {"dynamic_alpha_rounds": 2}}[method])

    def node(msg, node_key):
        if node_key == key(1):
            raise RuntimeError("injected failure")
        return trainer(msg, node_key)

    def go(cls, **extra):
        strategy = cls(4, seed=3, selector=roster(3), **settings, **extra)
        globals_, times = [], []
        result = run(strategy, FakeGrid(sized({key(i): 40 + 10 * i for i in range(8)}, node), num_nodes=8,
                                        examples={key(i): 40 + 10 * i for i in range(8)}), 3,
                     round_end=lambda r, a, res: (globals_.append(record_to_model(a)), times.append(strategy.context.clock.now)))
        assert result is not None
        return strategy, globals_, times

    sync, sync_globals, sync_times = go(sync_cls)
    asyn, async_globals, async_times = go(async_cls, buffer_size=4)
    same_models(asyn.models, sync.models)
    same_models(async_globals, sync_globals)
    assert async_times == sync_times and sync_times[0] > 0
    assert any(not np.array_equal(asyn.models[0][k], asyn.models[1][k]) for k in asyn.models[0])  # not trivially equal
    assert "injected failure" in " ".join(asyn.context.last_round.rejections + sync.context.last_round.rejections)


# ============================================================================ faults, order, resume
def test_a_dropped_client_neither_stalls_nor_loses_a_model() -> None:
    """A node that never replies (B < K): its job ends after the timeout, its model comes back as
    it was sent and goes out again; the run completes."""
    dropped = key(2)
    grid = FakeGrid(trainer, num_nodes=5, drop=[dropped])
    strategy = FedMRAsync(4, seed=0, buffer_size=2)
    sent_to_dropped = []
    push = grid.push_messages

    def watched(messages):
        messages = list(messages)
        sent_to_dropped.extend((m.content["config"]["model-index"], record_to_model(m.content["arrays"]))
                               for m in messages if grid.keys[m.metadata.dst_node_id] == dropped)
        return push(messages)

    grid.push_messages = watched
    started = time.monotonic()
    failures: list[str] = []
    run(strategy, grid, 6, timeout=0.2, round_end=lambda r, a, res: failures.extend(strategy.context.last_round.rejections))
    assert time.monotonic() - started < 10 and strategy.context.driver.version == 6
    assert sent_to_dropped and any("no reply within 0.2s" in f for f in failures)
    index, model = sent_to_dropped[0]
    # the dropped job's model came back unchanged: it is the one the next job of that index got
    later = [m for m in grid.sent if m.content["config"]["model-index"] == index and grid.keys[m.metadata.dst_node_id] != dropped]
    assert later  # it went out again
    assert sorted(strategy.context.driver.policy.ready + [j.model_index for j in strategy.context.driver.jobs.values()]) == [0, 1, 2, 3]  # no model lost


def test_fedbuff_whose_clients_all_fail_stops_after_max_failed_rounds() -> None:
    from strategies.base import RunFailed

    def broken(msg, node_key):
        raise RuntimeError("CUDA out of memory")

    with pytest.raises(RunFailed, match="CUDA out of memory"):
        run(FedBuff(3, seed=0, buffer_size=2), FakeGrid(broken, num_nodes=3), 10, max_failed_rounds=2)


class LateGrid(FakeGrid):
    """Holds back every reply of some nodes for a few pulls: real arrival order differs."""

    def __init__(self, *args, late=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.late, self.pulls = set(late), 0

    def pull_messages(self, message_ids):
        self.pulls += 1
        out = super().pull_messages(message_ids)
        held = [r for r in out if self.keys[r.metadata.src_node_id] in self.late and self.pulls % 4]
        self._waiting += held
        return [r for r in out if r not in held]


@pytest.mark.parametrize("cls", [FedBuff, FedMRAsync])
def test_the_virtual_clock_orders_jobs_whatever_order_replies_arrive_in(cls) -> None:
    """Other node ids, other reply order, late replies: the same models and times."""
    def go(grid):
        strategy = cls(4, seed=0, selector=roster(), buffer_size=2, **heterogeneity(profile="tiers", tiers=[[0.3, 4.0]]))
        run(strategy, grid, 5)
        return strategy

    sizes = {key(i): 30 + 10 * i for i in range(6)}
    a = go(FakeGrid(sized(sizes), num_nodes=6, seed=1, examples=sizes))
    b = go(LateGrid(sized(sizes), num_nodes=6, seed=2, examples=sizes, late=[key(0), key(3)]))
    same_models(a.models, b.models)
    assert a.context.clock.now == b.context.clock.now


@pytest.mark.parametrize(("nodes", "b"), [(10, 2), (7, 3)])
@pytest.mark.parametrize("cls", [FedBuff, FedMRAsync, FedCrossAsync])
def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path: Path, cls, nodes: int, b: int) -> None:
    """Stopped after round 2 with jobs in flight (checkpointed as the runner does), resumed on a
    new grid with other node ids: the same models after round 5 as the run that never stopped."""
    from server_app.checkpoint import load_checkpoint, save_checkpoint

    sizes = {key(i): 30 + 10 * i for i in range(nodes)}

    def make():
        return cls(4, seed=1, selector=roster(1), buffer_size=b,
                   **heterogeneity(profile="tiers", tiers=[[0.3, 4.0]], offline_fraction=0.3, offline_period=3.0))

    def messages(grid, sent) -> set:
        config = lambda m: m.content["config"]  # noqa: E731
        return {(grid.keys[m.metadata.dst_node_id], config(m)["server-round"], config(m)["model-index"],
                 config(m).get("round-repeat", 0), arrays_digest(m)) for m in sent}

    whole, first = make(), FakeGrid(sized(sizes), num_nodes=nodes, seed=1, examples=sizes)
    stopped_at = []
    run(whole, first, 6, round_end=lambda r, a, res: (save_checkpoint(tmp_path, {"strategy": whole.context.state_dict()}),
                                                       stopped_at.append(len(first.sent))) if r == 2 else None)
    saved = load_checkpoint(tmp_path)["strategy"]
    assert saved["async"]["jobs"]  # there were jobs in flight to send again
    resumed, second = make(), FakeGrid(sized(sizes), num_nodes=nodes, seed=7, examples=sizes)
    resumed.context.load_state_dict(saved)
    run(resumed, second, 6, start_round=3)
    # the jobs in flight went out again as they were, then the same jobs as in the run that never stopped
    assert messages(first, first.sent[stopped_at[0]:]) <= messages(second, second.sent) <= messages(first, first.sent)
    same_models(resumed.models, whole.models)
    same_models([resumed.global_model], [whole.global_model])
    assert resumed.context.clock.now == whole.context.clock.now and resumed.context.driver.version == whole.context.driver.version == 6


def test_a_resumed_synchronous_run_goes_on_with_its_virtual_time() -> None:
    times = {}
    whole, _ = tiered_fedavg()
    run(whole, FakeGrid(constant_node, num_nodes=4, examples=NODE_N), 3, arrays=W0,
        round_end=lambda r, a, res: times.update({r: whole.context.clock.now, f"state{r}": whole.context.state_dict()}))
    resumed, _ = tiered_fedavg()
    resumed.context.load_state_dict(times["state1"])
    run(resumed, FakeGrid(constant_node, num_nodes=4, examples=NODE_N), 3, arrays=W0, start_round=2)
    assert resumed.context.clock.now == times[3] == 3 * times[1] > 0


# ============================================================================ settings
@pytest.mark.parametrize(
    ("overrides", "key_", "allowed"),
    [
        (["strategy=fedmr_async", "strategy.asynchronous.buffer_size=11"], "strategy.asynchronous.buffer_size", "at most 10"),
        (["strategy=fedmr", "strategy.asynchronous.buffer_size=3"], "strategy.asynchronous.buffer_size", "enabled is false"),
        (["strategy=fedmut", "strategy.asynchronous.enabled=true"], "strategy.asynchronous.enabled", "false with strategy=fedmut"),
        (["strategy=fedbuff", "strategy.asynchronous.enabled=false"], "strategy.asynchronous.enabled", "true with strategy=fedbuff"),
        (["strategy=fedcross_async", "strategy.asynchronous.concurrency=3"], "strategy.asynchronous.concurrency", "K models in flight"),
        (["strategy=fedbuff", "strategy.heterogeneity.work=measured"], "strategy.heterogeneity.work", "modelled"),
        (["strategy=fedbuff", "selection=clustered"], "selection", "uniform"),
        (["strategy=fedavg", "strategy.heterogeneity.clock=real", "strategy.heterogeneity.profile=tiers"],
         "strategy.heterogeneity.profile", "clock=real"),
        (["strategy=fedavg", "strategy.heterogeneity.tiers=[[0.8,10],[0.5,2]]"], "strategy.heterogeneity.tiers", "summing"),
        (["strategy=fedcross_async", "strategy.asynchronous.max_staleness=-1"], "strategy.asynchronous.max_staleness",
         "null (no bound)"),
        (["strategy=fedmr_async", "strategy.secure.enabled=true"], "strategy.secure.enabled", "false"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(overrides, key_, allowed) -> None:
    from fedmm.config import compose, to_container, validate
    from fedmm.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        validate(to_container(compose(overrides)))
    assert err.value.key == key_ and allowed in str(err.value)


def test_a_run_made_before_heterogeneity_loads_with_no_effect() -> None:
    from strategies.fedmr import FedMRSettings

    old = FedMRSettings().to_dict()
    del old["heterogeneity"]
    assert FedMRSettings.from_dict(old).heterogeneity == HeterogeneitySettings()


# ============================================================================ the comparison's table
def test_time_to_accuracy_reads_virtual_time_and_compares_at_a_common_horizon(tmp_path: Path) -> None:
    import json

    import yaml

    from analysis.time_to_accuracy import main
    from fedmm.config import compose, to_container

    def write(name: str, strategy: str, seed: int, points: list[tuple[float, float]]) -> None:
        run = tmp_path / "sweep" / name
        run.mkdir(parents=True)
        cfg = to_container(compose([f"strategy={strategy}", f"seed={seed}", f"num_rounds={len(points) - 1}"]))
        (run / "config.yaml").write_text(yaml.safe_dump(cfg))
        (run / "summary.json").write_text(json.dumps({"status": "completed"}))
        rows = [{"round": r, "accuracy": a, **({"virtual_time": t} if r else {})} for r, (t, a) in enumerate(points)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    write("sync_s0", "fedavg", 0, [(0, 0.1), (10, 0.5), (20, 0.7), (30, 0.8)])
    write("sync_s1", "fedavg", 1, [(0, 0.1), (10, 0.6), (20, 0.65), (30, 0.75)])
    write("async_s0", "fedbuff", 0, [(0, 0.1), (2, 0.6), (4, 0.72), (25, 0.74)])
    write("async_s1", "fedbuff", 1, [(0, 0.1), (3, 0.5), (6, 0.7), (24, 0.81)])
    main([str(tmp_path / "sweep"), "--targets", "0.7", "0.8", "--out", str(tmp_path / "tta")])
    numbers = json.loads((tmp_path / "tta.json").read_text())
    assert numbers["horizon"] == 24.0  # the earliest end of a run
    sync, buff = numbers["methods"]["FedAvg"], numbers["methods"]["FedBuff"]
    assert sync["time_to"] == {"0.7": [20.0, 30.0], "0.8": [30.0]} and buff["time_to"] == {"0.7": [4.0, 6.0], "0.8": [24.0]}
    assert sync["accuracy_at_horizon"] == [0.7, 0.65] and buff["accuracy_at_horizon"] == [0.72, 0.81]
    table = (tmp_path / "tta.md").read_text()
    assert "| FedBuff | 2 | 5.0 ± 1.4 | 24.0 (1/2) | 76.50 ± 6.36 |" in table
    assert (tmp_path / "tta.png").stat().st_size > 0


# ============================================================================ one real simulation
def test_fedmm_runs_fedbuff_and_the_async_multimodel_methods_in_a_simulation(tmp_path: Path) -> None:
    """``fedmm strategy=fedbuff|fedmr_async|fedcross_async`` and a synchronous FedAvg with a 10×
    tier and a deadline, on the embedded data, one in-process simulation (tests/test_engines.py
    runs FedBuff and async FedMR on Ray too): every run completes and writes a rising
    ``virtual_time``."""
    from fedmm.local_engine import run_local_simulation

    from client_app.client_app import app as client_app
    from fedmm.config import compose, to_container
    from fedmm.results import read_metrics
    from tests.sim_apps import recording_server_app

    tier = ["strategy.heterogeneity.profile=tiers", "strategy.heterogeneity.tiers=[[0.25,10.0]]"]
    runs = {
        "fedbuff": ["strategy=fedbuff", "strategy.asynchronous.buffer_size=2", *tier],
        "fedmr_async": ["strategy=fedmr_async", "strategy.asynchronous.buffer_size=2", *tier],
        "fedcross_async": ["strategy=fedcross_async", "strategy.asynchronous.buffer_size=2"],
        "fedavg": ["strategy=fedavg", *tier, "strategy.heterogeneity.deadline=1000"],
    }
    cfgs = [to_container(compose([*extra, "num_rounds=2", "num_clients=4", "clients_per_round=3",
                                  "training.local_epochs=1", "dataset.test_fraction=0.8", "partition.alpha=0.5",
                                  f"output_dir={tmp_path / name}"])) for name, extra in runs.items()]
    out: dict = {}
    run_local_simulation(server_app=recording_server_app(cfgs, [], out), client_app=client_app, num_supernodes=4)
    for name in runs:
        rows = read_metrics(tmp_path / name)
        assert [r["round"] for r in rows] == [0, 1, 2], name
        times = [r["virtual_time"] for r in rows[1:]]
        assert all(b > a for a, b in zip([0.0] + times, times)), (name, times)
        assert all(r["replies"] >= 1 for r in rows[1:]) and rows[-1]["accuracy"] > 0.1, (name, rows)
    assert "name: fedbuff" in (tmp_path / "fedbuff" / "config.yaml").read_text()
