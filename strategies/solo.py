"""SOLO (FedRL's baseline): every client trains only its own model, on its own data.

Nothing is aggregated. The server keeps each client's latest model under the client's stable
key (its partition id or data path, from the roster query) and sends it back to that client when
it is selected again, so a client trains ``num_rounds × training.local_epochs`` epochs in all
with full participation, and a resumed run continues every client's own model. The central
evaluation reports the mean test accuracy of the local models on the test split, with its
spread (``accuracy_std``, sample std; ``accuracy_min`` / ``accuracy_max``; ``models_evaluated``)
in ``metrics.jsonl``. ``final_model.pt`` holds the element-wise mean of the local models (an
artefact SOLO never trains or reports); ``final_models.npz`` is not written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dataclasses import dataclass

from fedmm.protocol import ClientUpdate, ModelDict
from strategies.aggregators import Mean
from strategies.base import Participants
from strategies.method import PER_CLIENT, Method, refused
from strategies.selection import ClientSelector
from strategies.strategy_settings import StrategySettings


@dataclass
class SoloSettings(StrategySettings):
    """SOLO has no settings beyond the base's."""

    option = "solo"
    title = "SOLO"


class Solo(Method):
    """Local training only: one model per client, kept by the server between the client's rounds."""

    Settings = SoloSettings
    holds = PER_CLIENT
    releases = refused("each client's model is kept and released as it trained it: no aggregation hides one client's data")

    def __init__(self, clients_per_round: int | None = None, seed: int = 0, fraction_evaluate: float | None = None,
                 selector: ClientSelector | None = None, **settings: Any) -> None:
        super().__init__(clients_per_round, seed, fraction_evaluate, selector, **settings)
        self.initial: ModelDict | None = None
        #: node key -> that client's latest model.
        self.local_models: dict[str, ModelDict] = {}
        self._slot_keys: list[str] = []

    def initialize(self, initial: ModelDict) -> None:
        """Every client starts from the initial model."""
        self.initial = initial
        self.models = [initial]
        self.global_model = initial

    def prepare_round(self, server_round: int, participants: Participants) -> None:
        """Put each selected client's own model (the initial one the first time) in its slot:
        slot i carries the i-th selected client's own model."""
        assert self.initial is not None
        self._slot_keys = list(participants.keys)
        self.models = [self.local_models.get(key, self.initial) for key in self._slot_keys]

    def aggregate(self, server_round: int, updates: list[ClientUpdate], mean: Mean) -> ModelDict | None:
        """Keep every returned model as its client's; nothing is averaged into anyone's model
        (the mean of the local models is only the run's saved artefact)."""
        for update in updates:
            self.local_models[self._slot_keys[update.slot]] = update.model
        if not self.local_models:
            return None
        return mean(list(self.local_models.values()))

    def models_to_evaluate(self) -> list[ModelDict] | None:
        """The local models of every client trained so far (evaluated instead of the global model)."""
        return [self.local_models[key] for key in sorted(self.local_models)] or None

    def state_dict(self) -> dict[str, Any]:
        """The base state plus every client's model and the initial model."""
        return {**super().state_dict(), "initial": self.initial, "local_models": dict(self.local_models)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        super().load_state_dict(state)
        self.initial = state["initial"]
        self.local_models = dict(state["local_models"])

