"""Grouped releases of the multi-model methods under differential privacy (strategies/privacy.py,
``strategy.privacy.groups``): the clients sent one model are a group, each group's clipped mean is
released with noise for the group's updates that came back, a client counted in two groups is
refused, G = K is today's one client per model, the accounting is one release per round."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Message, RecordDict

from fedmm import protocol
from fedmm.config import compose
from fedmm.errors import ConfigError
from fedmm.protocol import ClientUpdate
from strategies import build_strategy
from strategies.privacy import group_releases
from tests.fakes import FakeGrid
from fedmm.observers import RunObserver
from tests.test_privacy import ZERO, returning, within

DP = ["strategy.privacy.clip_norm=1.0", "strategy.privacy.noise_multiplier=0.5"]


class Updates(RunObserver):
    """What the method is handed each round: (model, sent) of every release, copied (FedCross
    empties the dicts it fuses)."""

    def __init__(self) -> None:
        self.rounds: list[list] = []
        self.nodes: list[list[int]] = []

    def on_aggregate(self, server_round: int, updates) -> None:  # noqa: ANN001
        self.rounds.append([({k: np.array(v) for k, v in u.model.items()}, u.sent) for u in updates])
        self.nodes.append([u.node_id for u in updates])


def start(overrides: list[str], node, rounds: int = 1, observers=(), failing=()):  # noqa: ANN001, ANN201
    """The strategy of ``overrides`` run ``rounds`` rounds on a FakeGrid of ``node`` functions;
    the nodes of ``failing`` (keys) answer with an error. Returns (strategy, grid)."""

    def answer(msg: Message, key: str) -> RecordDict:
        if key in failing:
            raise RuntimeError("this client fails")
        return node(msg, key)

    run = compose(overrides)
    strategy = build_strategy(run, observers)
    grid = FakeGrid(answer, num_nodes=run.num_clients)
    strategy.start(grid, protocol.model_to_record(ZERO), num_rounds=rounds, final_report=False)
    return strategy, grid


def groups_sent(grid: FakeGrid, groups: int, server_round: int = 1) -> dict[int, list[str]]:
    """Group -> the keys of the nodes sent its model in ``server_round`` (the model index each message carried)."""
    out: dict[int, list[str]] = {}
    for msg in grid.sent:
        config = msg.content["config"]
        if config[protocol.SERVER_ROUND] == server_round:
            out.setdefault(int(config[protocol.MODEL_INDEX]), []).append(grid.keys[msg.metadata.dst_node_id])
    assert sorted(out) == list(range(groups)), out
    return out


def std_of(model: dict) -> float:
    return float(np.concatenate([model["a.weight"], model["b.weight"]]).std())


@pytest.mark.parametrize("method", ["fedmr", "fedcross"])
def test_a_groups_noise_follows_its_size(method: str) -> None:
    """K = 10 clients in G = 3 groups (4, 3, 3), zero updates: each release is its group's mean
    with noise of std z·2C/m_g (0.25, 1/3, 1/3), the method keeps G models, and the accounting is
    one release per round whatever G is (parallel composition)."""
    seen = Updates()
    s, grid = start([f"strategy={method}", "num_clients=20", "clients_per_round=10", *DP, "strategy.privacy.groups=3"],
                    returning(), observers=[seen])
    sizes = {g: len(keys) for g, keys in groups_sent(grid, 3).items()}
    assert sizes == {0: 4, 1: 3, 2: 3}
    assert len(seen.rounds[0]) == 3 and len(s.models) == 3
    for (model, sent), group in zip(seen.rounds[0], sorted(sizes)):
        expected = 0.5 * 2 * 1.0 / sizes[group]
        assert within(std_of(model), expected, 12000), (group, std_of(model), expected)
        assert model["n"] == sent["n"] == 0
    ungrouped = start([f"strategy={method}", "num_clients=20", "clients_per_round=10", *DP], returning())[0]
    assert s.round_log["epsilon"] == pytest.approx(ungrouped.round_log["epsilon"], rel=1e-12)
    assert s.context.privacy.summary()["groups"] == 3 and ungrouped.context.privacy.summary()["groups"] == 10


def test_a_groups_noise_is_for_its_updates_that_came_back() -> None:
    """K = 8 in G = 2 groups of 4, three clients fail: each group's release carries noise for the
    updates of the group that came back, not for the 4 selected (at least one group lost two)."""
    seen = Updates()
    failing = {"partition:000000001", "partition:000000004", "partition:000000006"}
    s, grid = start(["strategy=fedmr", "num_clients=8", "clients_per_round=8", *DP, "strategy.privacy.groups=2"],
                    returning(), observers=[seen], failing=failing)
    back = {g: sum(k not in failing for k in keys) for g, keys in groups_sent(grid, 2).items()}
    assert sorted(back.values()) != [4, 4] and s.context.last_round.replies == 5
    for model, _ in seen.rounds[0]:
        group = next(g for g in back if within(std_of(model), 0.5 * 2 / back[g], 12000))
        back.pop(group)
    assert back == {}  # each release matched its own group's count, once


def test_the_clients_sent_one_model_form_a_group_and_their_clipped_updates_are_averaged() -> None:
    """K = 6 in G = 2: node i is sent model i mod 2 (the same arrays within a group, every round),
    and a group's release is the model sent plus the mean of its members' clipped updates."""
    seen = Updates()
    s, grid = start(["strategy=fedmr", "num_clients=6", "clients_per_round=6", "strategy.privacy.clip_norm=0.5",
                     "strategy.privacy.noise_multiplier=1e-9", "strategy.privacy.groups=2"],
                    returning(3.0, directions=True), rounds=2, observers=[seen])
    for server_round in (1, 2):
        members = groups_sent(grid, 2, server_round)
        assert sorted(len(v) for v in members.values()) == [3, 3]
        for msg_a in grid.sent:
            for msg_b in grid.sent:
                ca, cb = msg_a.content["config"], msg_b.content["config"]
                if ca[protocol.SERVER_ROUND] == cb[protocol.SERVER_ROUND] == server_round and \
                        ca[protocol.MODEL_INDEX] == cb[protocol.MODEL_INDEX]:
                    a = protocol.record_to_model(msg_a.content[protocol.ARRAYS])
                    b = protocol.record_to_model(msg_b.content[protocol.ARRAYS])
                    assert all(np.array_equal(a[k], b[k]) for k in a)
    first = groups_sent(grid, 2, 1)
    for (model, sent), group in zip(seen.rounds[0], sorted(first)):
        # each member moved one coordinate (its own, 7·i) by 3.0, clipped to 0.5 over both weights
        expected = {k: np.zeros(6000) for k in ("a.weight", "b.weight")}
        for key in first[group]:
            i = int(key[-1])
            for k in expected:
                expected[k][(i * 7) % 6000] += 0.5 / np.sqrt(2) / len(first[group])
        for k in expected:
            np.testing.assert_allclose(model[k] - sent[k], expected[k], atol=1e-6)
    assert len(s.models) == 2


def test_a_client_counted_in_two_groups_is_refused() -> None:
    """group_releases refuses a node whose update is in two groups (or twice in one), and a run
    whose selector hands one node two slots stops with that error before anything is released."""
    sent = dict(ZERO)

    def update(node: int, slot: int) -> ClientUpdate:
        return ClientUpdate(node, slot, dict(ZERO), 1.0, {}, sent=sent)

    rng = np.random.default_rng(0)
    std = lambda m: 0.1 / m  # noqa: E731
    released, withheld = group_releases([update(1, 0), update(2, 1), update(3, 2)], 2, 1, std, rng)
    assert [u.slot for u in released] == [0, 1] and withheld == []
    with pytest.raises(ValueError, match="node 7 is counted in group 0 and in group 1"):
        group_releases([update(7, 0), update(2, 2), update(7, 3)], 2, 1, std, rng)
    with pytest.raises(ValueError, match="node 7 is counted in group 0 and in group 0"):
        group_releases([update(7, 0), update(7, 2)], 2, 1, std, rng)

    run = compose(["strategy=fedmr", "num_clients=8", "clients_per_round=4", *DP, "strategy.privacy.groups=2"])
    strategy = build_strategy(run)
    choose = strategy.context.selector.select
    strategy.context.selector.select = lambda grid, r, k: (lambda ids: [ids[0], *ids[1:3], ids[0]])(choose(grid, r, k))
    with pytest.raises(ValueError, match="is counted in group 0 and in group 1"):
        strategy.start(FakeGrid(returning(), num_nodes=8), protocol.model_to_record(ZERO), num_rounds=1,
                       final_report=False)
    assert strategy.context.privacy.accountant.num_releases == 0


def test_a_group_with_fewer_updates_back_than_the_minimum_is_withheld() -> None:
    """K = 4 in G = 2 groups with min_group_size 2, one client fails: its group is not released
    (only the full group reaches the method; dp_groups_withheld counts it)."""
    seen = Updates()
    s, grid = start(["strategy=fedmr", "num_clients=4", "clients_per_round=4", *DP, "strategy.privacy.groups=2",
                     "strategy.privacy.min_group_size=2"], returning(), observers=[seen], failing={"partition:000000002"})
    full = next(g for g, keys in groups_sent(grid, 2).items() if "partition:000000002" not in keys)
    assert [within(std_of(m), 0.5 * 2 / 2, 12000) for m, _ in seen.rounds[0]] == [True]
    assert s.round_log["dp_groups_withheld"] == 1.0 and s.context.last_round.replies == 3
    assert full in (0, 1)


def test_g_equal_k_is_one_client_per_model_as_without_groups() -> None:
    """groups = K and groups null are the same release: K models, each one client's with noise z·2C,
    each release carrying its client's node id."""
    for extra in ([], ["strategy.privacy.groups=4"]):
        seen = Updates()
        s, grid = start(["strategy=fedmr", "num_clients=8", "clients_per_round=4", *DP, *extra], returning(),
                        observers=[seen])
        assert len(s.models) == 4 and len(seen.rounds[0]) == 4
        assert all(within(std_of(m), 0.5 * 2 * 1.0, 12000) for m, _ in seen.rounds[0])
        assert sorted(seen.nodes[0]) == sorted(m.metadata.dst_node_id for m in grid.sent)
    grouped = Updates()
    start(["strategy=fedmr", "num_clients=8", "clients_per_round=4", *DP, "strategy.privacy.groups=2"], returning(),
          observers=[grouped])
    assert grouped.nodes[0] == [-1, -1]  # a group's mean is no one client's


@pytest.mark.parametrize(("overrides", "key", "words"), [
    (["strategy.privacy.clip_norm=1", "strategy.privacy.groups=2"], "strategy.privacy.groups", "one group of all"),
    (["strategy=fedmr", "strategy.privacy.groups=2"], "strategy.privacy.groups", "clip_norm is null"),
    (["strategy=fedmr", "clients_per_round=4", "strategy.privacy.clip_norm=1", "strategy.privacy.groups=5"],
     "strategy.privacy.groups", "at most clients_per_round=4"),
    (["strategy=fedcross", "clients_per_round=10", "strategy.privacy.clip_norm=1", "strategy.privacy.groups=4",
      "strategy.privacy.min_group_size=3"], "strategy.privacy.min_group_size", "groups to at most 3"),
    (["strategy=fedmr", "clients_per_round=10", "strategy.privacy.clip_norm=1", "strategy.privacy.min_group_size=2"],
     "strategy.privacy.min_group_size", "in 10 group(s)"),
    (["clients_per_round=3", "strategy.privacy.clip_norm=1", "strategy.privacy.min_group_size=4"],
     "strategy.privacy.min_group_size", "at most 3"),
    (["strategy=fedmr", "strategy.privacy.clip_norm=1", "strategy.privacy.groups=0"], "strategy.privacy.groups", ">= 1"),
])
def test_group_settings_the_release_cannot_have_are_refused(overrides: list[str], key: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose(["num_clients=20", *overrides])
    assert err.value.key == key and words in str(err.value), err.value


def test_a_run_says_the_noise_on_a_group_release_against_c(caplog: pytest.LogCaptureFixture) -> None:
    """Before the first round: the noise on the smallest group's release (z·2C/⌊K/G⌋·√d) against C."""
    import logging

    caplog.set_level(logging.INFO, logger="flwr")
    s, _ = start(["strategy=fedcross", "num_clients=20", "clients_per_round=10", *DP, "strategy.privacy.groups=3"],
                 returning())
    d = sum(v.size for v in ZERO.values() if v.dtype.kind == "f")
    expected = 0.5 * 2 * 1.0 / 3 * np.sqrt(d)
    assert s.context.privacy.ratio == pytest.approx(expected)
    assert f"the noise on each released model (the mean of a group of at least 3) has norm ~{expected:.3g}" in caplog.text
