"""The method contract (strategies/method.py, docs/adding_a_method.md): what a method or an
objective does not declare is refused, never assumed, and every guarantee of the suite reaches a
new one by discovery, with no list edited.

A throwaway method and objective are written to a module of their own, imported (their
declarations register themselves, as a plugin's do) and taken through the fuzz, the defence
matrix, the two-paths equality, the text tasks' runs and the docs' generated blocks."""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fedmm.config import compose
from fedmm.errors import ConfigError

THROWAWAY = '''
from dataclasses import dataclass

from objectives.base import LocalUpdate, ObjectiveSettings, call, cross_entropy
from strategies.method import Method
from strategies.strategy_settings import StrategySettings


@dataclass
class ThrowawaySettings(StrategySettings):
    """A method written for a test."""

    option = "throwaway"
    title = "Throwaway"
    weighs_replies = True


class Throwaway(Method):
    """The weighted mean of the updates, its own arithmetic, nothing declared."""

    Settings = ThrowawaySettings

    def aggregate(self, server_round, updates, mean):
        if not updates:
            return None
        self.models = [mean([u.model for u in updates], mean.weights(updates))]
        return self.models[0]


@dataclass
class ThrowawayObjectiveSettings(ObjectiveSettings):
    """An objective written for a test."""

    option = "throwaway_ce"
    title = "Throwaway CE"


class ThrowawayObjective(LocalUpdate):
    """Half the cross-entropy, for both training paths."""

    Settings = ThrowawayObjectiveSettings

    def batch_loss(self, model, weights, tensors, x, y, index, rows=None):
        logits = call(model, weights, x)
        return 0.5 * cross_entropy(logits, y, rows), logits
'''


@pytest.fixture
def throwaway(tmp_path: Path) -> Iterator[object]:
    """The module above, imported as a plugin is (its declarations register themselves); taken
    out of the process afterwards (the declarations, hydra's store, the composed configs)."""
    from hydra.core.config_store import ConfigStore

    from fedmm import config, settings

    (tmp_path / "throwaway_method.py").write_text(textwrap.dedent(THROWAWAY), encoding="utf-8")
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module("throwaway_method")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("throwaway_method", None)
        for group, option in (("strategy", "throwaway"), ("objective", "throwaway_ce")):
            settings._DECLARED.pop((group, option), None)
            ConfigStore.instance().repo.get(group, {}).pop(f"{option}.yaml", None)
            config._STORED.pop((group, option), None)
        config._COMPOSED.clear()


# ============================================================================ refused, never assumed
def test_a_method_that_does_not_say_what_it_releases_is_refused_under_dp_naming_the_declaration(throwaway) -> None:  # noqa: ANN001
    """Its own aggregate, no ``releases``: refused before the first round, the message naming the
    class and the declaration to add; a subclass of FedAvg that replaces FedAvg's aggregate is
    not FedAvg under DP either (the release FedAvg declares is its aggregate's)."""
    from strategies.contract import MEAN, release_of, release_refusal
    from strategies.fedavg import FedAvg
    from strategies.fedmr import FedMR

    compose(["strategy=throwaway"])  # without DP it runs
    with pytest.raises(ConfigError) as err:
        compose(["strategy=throwaway", "strategy.privacy.clip_norm=1"])
    assert err.value.key == "strategy.privacy.clip_norm"
    assert "Throwaway defines aggregate without declaring what it releases: add releases = MEAN" in str(err.value)

    class Reweighted(FedAvg):  # q-FFL's trap: FedAvg's declaration, another aggregate
        def aggregate(self, server_round, updates, mean):  # noqa: ANN001, ANN202
            return super().aggregate(server_round, updates, mean)

    class Declared(Reweighted):
        releases = MEAN

    class Recombined(FedMR):  # a multi-model method's own update_models keeps its declaration
        def update_models(self, server_round, models, trained):  # noqa: ANN001, ANN202
            return models

    assert (release_of(FedAvg), release_of(Reweighted), release_of(Declared), release_of(Recombined)) == (MEAN, None, MEAN, "models")
    assert "Reweighted defines aggregate" in release_refusal(Reweighted)
    with pytest.raises(ValueError, match="Reweighted refuses differential privacy: Reweighted defines aggregate"):
        Reweighted(3, seed=0, num_clients=10, privacy={"clip_norm": 1.0})


def test_a_driver_a_method_does_not_declare_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        compose(["strategy=fedavg", "strategy.asynchronous.enabled=true"])
    assert err.value.key == "strategy.asynchronous.enabled" and "strategy=fedavg" in str(err.value) and "drivers" in str(err.value)


def test_an_objective_whose_loss_the_vectorized_path_would_skip_is_never_vectorized(tmp_path: Path) -> None:
    """An objective that overrides ``loss`` (or ``gradient``) trains one client at a time, with
    nothing to declare; declaring ``vectorized`` is refused, and so are two loss definitions."""
    from client_app.vectorized import train_stacked
    from objectives.base import LocalUpdate, cross_entropy

    class OwnLoss(LocalUpdate):  # the trap: an override the stacked step would skip
        def loss(self, model, x, y):  # noqa: ANN001, ANN202
            logits = model(x)
            return 2.0 * cross_entropy(logits, y), logits

    assert "it defines loss" in OwnLoss.vectorizable() and not LocalUpdate.vectorizable()
    with pytest.raises(ValueError, match="it defines loss"):
        train_stacked(torch.nn.Linear(2, 2), [{}], [None], None, 1, [None], torch.device("cpu"),
                      [OwnLoss({"objective": {"name": "ce", "training": {}}})])
    with pytest.raises(TypeError, match="nothing to declare"):
        type("Declaring", (LocalUpdate,), {"vectorized": True})
    with pytest.raises(TypeError, match="one loss definition per objective"):
        type("Both", (LocalUpdate,), {"loss": OwnLoss.loss, "batch_loss": LocalUpdate.batch_loss})


def test_an_asam_like_objective_names_why_in_the_runs_refusal() -> None:
    """``simulation.vectorize=on`` with an objective that reads the model its own way fails
    naming the objective and why (the run is never vectorized silently wrong)."""
    from fedmm.config import not_vectorized

    run = compose(["objective=asam"])
    assert "objective.name='asam' trains one client at a time (it defines gradient" in not_vectorized(run)
    assert not_vectorized(compose(["objective=fedprox"])) is None


# ============================================================================ reached by discovery
def test_a_new_method_and_objective_are_fuzzed_defended_compared_run_and_documented(throwaway) -> None:  # noqa: ANN001
    """No list edited: the fuzz, the every-method-by-every-defence matrix, the two-paths equality,
    the text tasks' runs and the docs' generated blocks all take the throwaway method and
    objective, and the docs check says the committed pages lack them, naming the command."""
    from analysis import method_reference
    from tests.test_defences import every_defence_holds_or_is_refused
    from tests.test_fuzz import fuzzed_methods, train_replies_of
    from tests.test_text import discovered_runs
    from tests.test_vectorized import assert_pair, vectorizable_objectives

    assert "throwaway" in fuzzed_methods()
    train_replies_of("throwaway", "nan", 0)
    every_defence_holds_or_is_refused("throwaway")
    assert "throwaway_ce" in vectorizable_objectives()
    assert_pair("lenet", "throwaway_ce")
    assert {"throwaway", "objective=throwaway_ce"} <= set(discovered_runs())
    assert {"methods.md", "usage.md", "privacy.md"} <= set(method_reference.stale())
    assert "| Throwaway | `throwaway` |" in method_reference.methods_block()
    assert "`strategy=throwaway` | dp_clip | `strategy.privacy.clip_norm` | Throwaway defines aggregate" in \
        method_reference.privacy_block()
    assert method_reference.main(["--check"]) == 1


def test_the_committed_docs_are_what_the_declarations_generate() -> None:
    from analysis import method_reference

    assert method_reference.stale() == [], f"stale generated blocks: run {method_reference.COMMAND}"


# ============================================================================ the round's end
def test_a_failed_round_leaves_every_stage_as_it_found_it() -> None:
    """A round whose aggregate is not finite restores what every stage held before it: the
    method's state (its own counter included), the server optimizer's momentum, the selector's
    observation; it counts no reply and says why, which ``max_failed_rounds`` then names."""
    import numpy as np
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

    from fedmm import protocol
    from strategies.fedavg import FedAvg
    from strategies.fedavgm import FedAvgM
    from strategies.selection import SeededRosterSelector
    from tests.fakes import FakeGrid

    class Watching(SeededRosterSelector):
        def __init__(self) -> None:
            super().__init__(0, query=False)
            self.seen: list[int] = []

        def observe(self, server_round, updates, sent):  # noqa: ANN001
            self.seen.append(server_round)

        def state_dict(self):  # noqa: ANN201
            return {"seen": list(self.seen)}

        def load_state_dict(self, state) -> None:  # noqa: ANN001
            self.seen = list(state["seen"])

    class Counting(FedAvg):
        def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            super().__init__(*args, **kwargs)
            self.rounds = 0

        def aggregate(self, server_round, updates, mean):  # noqa: ANN001, ANN202
            self.rounds += 1
            model = super().aggregate(server_round, updates, mean)
            if server_round == 2:  # the planted failure
                self.models = [{k: np.full_like(v, np.nan) for k, v in model.items()}]
                return self.models[0]
            return model

        def state_dict(self):  # noqa: ANN201
            return {**super().state_dict(), "rounds": self.rounds}

        def load_state_dict(self, state) -> None:  # noqa: ANN001
            super().load_state_dict(state)
            self.rounds = state["rounds"]

    def node(msg: Message, key: str) -> RecordDict:
        model = protocol.record_to_model(msg.content["arrays"], copy=True)
        return RecordDict({"arrays": protocol.model_to_record({"w": model["w"] + 1}),
                           "metrics": MetricRecord({protocol.NUM_EXAMPLES: 1.0})})

    strategy = Counting(2, seed=0, selector=Watching(), server_optimizer=FedAvgM(server_momentum=0.9))
    grid = FakeGrid(node, num_nodes=2)
    arrays = protocol.model_to_record({"w": np.zeros(3, np.float32)})
    for server_round in (1, 2):
        messages = list(strategy.configure_train(server_round, arrays, ConfigRecord({"x": 1}), grid))
        out, metrics = strategy.aggregate_train(server_round, grid.send_and_receive(messages))
        if server_round == 1:
            arrays, after_one = out, (strategy.rounds, strategy.context.optimizer.momentum, list(strategy.context.selector.seen),
                                      strategy.models[0])
    assert out is None and metrics["replies"] == 0.0 and strategy.context.last_round.replies == 0
    assert "NaN/Inf in w" in strategy.context.last_round.failure
    assert (strategy.rounds, list(strategy.context.selector.seen)) == (1, [1]) == (after_one[0], after_one[2])
    assert strategy.context.optimizer.momentum is after_one[1] and strategy.models[0] is after_one[3]
    assert strategy.context.last_round.why_failed(1, 2, 1).startswith("the aggregate has NaN/Inf in w: nothing was aggregated")


def test_a_renamed_constructor_argument_still_works_with_a_warning() -> None:
    """``FedMR(num_models=4, seed=0, fraction_evaluate=0.5)``, the form the docs showed, builds the
    same strategy as ``clients_per_round=4``, with a DeprecationWarning naming the new name; so do
    FedBuff's driver settings given as its own (``buffer_size=``) and the asynchronous classes."""
    import strategies
    from strategies.fedbuff import FedBuff
    from strategies.fedmr import FedMR

    with pytest.warns(DeprecationWarning, match=r"num_models=\.\.\.\) is deprecated: use clients_per_round="):
        old = FedMR(num_models=4, seed=0, fraction_evaluate=0.5)
    assert old.clients_per_round == 4 and old.settings.fraction_evaluate == 0.5
    with pytest.warns(DeprecationWarning, match="buffer_size=...\\) is deprecated: use asynchronous="):
        buff = FedBuff(4, seed=0, buffer_size=2)
    assert buff.settings.asynchronous.buffer_size == 2 and buff.settings.asynchronous.enabled
    with pytest.warns(DeprecationWarning, match="strategies.FedMRAsync is deprecated"):
        asynchronous = strategies.FedMRAsync(4, seed=0)
    assert isinstance(asynchronous, FedMR) and asynchronous.settings.driver == "async"
