"""FedMut: federated model mutation (Hu et al., AAAI 2024), on the multi-model base.

K models; model i goes to the i-th selected client; after local training the global model is the
unweighted mean of the K models (a node that failed contributes the model it was given, so no
model is lost), and the next K models are mutations of it along the round's update
(:func:`strategies.mutation.mutate`). Defaults are the FedMut repository's (radius 4.0,
acc_rate 0.3, bound 50); the ``fedmut_fedmr_repo`` preset has the FedMR repository's copy (5.0 /
0.3 / 100).
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import INFO
from typing import Any

from flwr.supercore import log

from fedmm.config import Int, Number
from fedmm.protocol import ModelDict
from strategies.multimodel import MultiModelStrategy
from strategies.mutation import acceleration, mutate
from strategies.selection import ClientSelector

#: Keys of the ``strategy`` config group of FedMut (defaults in conf/strategy/fedmut.yaml).
CONFIG_SCHEMA = {
    "fraction_evaluate": Number(ge=0.0, le=1.0),
    "radius": Number(gt=0),
    "acc_rate": Number(ge=0.0, le=1.0),
    "bound": Int(min=1),
}


class FedMut(MultiModelStrategy):
    """FedMut on the multi-model base: only :meth:`update_models` differs.

    Parameters
    ----------
    num_models, seed, fraction_evaluate, selector
        See :class:`~strategies.multimodel.MultiModelStrategy`.
    radius : float
        Mutation radius: how far along ±Δ the models are placed.
    acc_rate, bound : float, int
        Mutation acceleration c = acc_rate · (1 − min(r / bound, 1)), r the 0-based round.
    """

    def __init__(
        self,
        num_models: int,
        seed: int,
        fraction_evaluate: float = 0.0,
        radius: float = 4.0,
        acc_rate: float = 0.3,
        bound: int = 50,
        selector: ClientSelector | None = None,
    ) -> None:
        super().__init__(num_models, seed, fraction_evaluate, selector)
        self.radius = float(radius)
        self.acc_rate = float(acc_rate)
        self.bound = int(bound)

    def update_models(self, server_round: int, models: list[ModelDict], trained: list[int]) -> list[ModelDict]:
        """The K next models: mutations of the round's mean along Δ = mean − previous global."""
        assert self.global_model is not None and self.round_mean is not None
        c = acceleration(server_round, self.acc_rate, self.bound)
        # w_old: the global model at the round's start (round 1: the initial model)
        return mutate(self.round_mean, self.global_model, self.num_models, self.radius, c, self.rng)

    def summary(self) -> None:
        """Log the strategy's settings."""
        super().summary()
        log(INFO, "\t    radius=%g acc_rate=%g bound=%d", self.radius, self.acc_rate, self.bound)


def from_config(cfg: Mapping[str, Any]) -> FedMut:
    """Build FedMut from the resolved run config."""
    s = cfg["strategy"]
    return FedMut(
        num_models=cfg["clients_per_round"],
        seed=cfg["seed"],
        fraction_evaluate=s["fraction_evaluate"],
        radius=s["radius"],
        acc_rate=s["acc_rate"],
        bound=s["bound"],
    )
