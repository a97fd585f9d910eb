"""FedAvg (McMahan et al. 2017): the one-model case of the round loop.

Every selected node gets the global model; the new global model is the ``num-examples``
weighted mean of the accepted replies (the arithmetic of Flower's ``aggregate_arrayrecords``,
computed from the arrays the reply check already decoded, keeping every dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedmm.protocol import ClientUpdate, ModelDict
from strategies.aggregators import Mean
from strategies.method import MEAN, Method
from strategies.strategy_settings import StrategySettings


@dataclass
class FedAvgSettings(StrategySettings):
    """FedAvg has no settings beyond the base's."""

    option = "fedavg"
    title = "FedAvg"
    weighs_replies = True


class FedAvg(Method):
    """Sample K clients per round, average their models weighted by ``num-examples``.

    Parameters
    ----------
    clients_per_round, seed, fraction_evaluate, selector, settings
        See :class:`~strategies.base.FedmmStrategy`.
    """

    Settings = FedAvgSettings
    releases = MEAN

    def aggregate(self, server_round: int, updates: list[ClientUpdate], mean: Mean) -> ModelDict | None:
        """The mean of the accepted models, weighted as the run weighs them (``num-examples``)."""
        if not updates:
            return None
        self.models = [mean([u.model for u in updates], mean.weights(updates))]
        return self.models[0]

