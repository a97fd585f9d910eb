"""FedAvg (McMahan et al. 2017): the one-model case of the round loop.

Every selected node gets the global model; the new global model is the ``num-examples``
weighted mean of the accepted replies (the arithmetic of Flower's ``aggregate_arrayrecords``,
computed from the arrays the reply check already decoded, keeping every dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedmm.protocol import ClientUpdate, ModelDict
from strategies.aggregation import weighted_mean_models
from strategies.base import RoundLoopStrategy, StrategySettings
from strategies.defence import client_mean


@dataclass
class FedAvgSettings(StrategySettings):
    """FedAvg has no settings beyond the base's."""

    option = "fedavg"
    title = "FedAvg"
    weighs_replies = True


class FedAvg(RoundLoopStrategy):
    """Sample K clients per round, average their models weighted by ``num-examples``.

    Parameters
    ----------
    clients_per_round, seed, fraction_evaluate, selector, settings
        See :class:`~strategies.base.RoundLoopStrategy`.
    """

    Settings = FedAvgSettings

    def initialize(self, initial: ModelDict) -> None:
        """One global model."""
        self.models = [initial]
        self.global_model = initial

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> ModelDict | None:
        """Weighted mean of the accepted models (equal weights when none reports examples)."""
        if not updates:
            return None
        models = [u.model for u in updates]
        self.models = [client_mean(self.settings.defence, models, lambda: weighted_mean_models(models, self.update_weights(updates)))]
        return self.models[0]

