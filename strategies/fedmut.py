"""FedMut: federated model mutation (Hu et al., AAAI 2024), on the multi-model base.

K models; model i goes to the i-th selected client; after local training the global model is the
unweighted mean of the K models (a node that failed contributes the model it was given, so no
model is lost), and the next K models are mutations of it along the round's update
(:func:`strategies.mutation.mutate`). Defaults are the FedMut repository's (radius 4.0,
acc_rate 0.3, bound 50); the ``fedmut_fedmr_repo`` preset has the FedMR repository's copy (5.0 /
0.3 / 100).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedmm.protocol import ModelDict
from fedmm.settings import Int, Number, setting
from strategies.multimodel import MultiModel, MultiModelSettings
from strategies.mutation import acceleration, mutate


@dataclass
class FedMutSettings(MultiModelSettings):
    """FedMut's mutation (Hu et al., AAAI 2024)."""

    option = "fedmut"
    title = "FedMut"
    radius: float = setting(4.0, Number(gt=0), "mutation radius: how far along ±Δ the models are placed",
                            paper="4.0 (the authors' code)", label="radius {}")
    acc_rate: float = setting(0.3, Number(ge=0.0, le=1.0), "mutation acceleration c = acc_rate · (1 − min(r / bound, 1))",
                              paper="0.3")
    bound: int = setting(50, Int(min=1), "rounds over which the acceleration decays to 0", paper="50", label="bound {}")

class FedMut(MultiModel):
    """FedMut on the multi-model base: only :meth:`update_models` differs.

    Parameters
    ----------
    clients_per_round, seed, fraction_evaluate, selector
        See :class:`~strategies.multimodel.MultiModel`.
    radius : float
        Mutation radius: how far along ±Δ the models are placed.
    acc_rate, bound : float, int
        Mutation acceleration c = acc_rate · (1 − min(r / bound, 1)), r the 0-based round.
    """

    Settings = FedMutSettings

    def update_models(self, server_round: int, models: list[ModelDict], trained: list[int]) -> list[ModelDict]:
        """The next models (as many as given: K, or G under grouped DP releases): mutations of the
        round's mean along Δ = mean − previous global."""
        assert self.global_model is not None and self.round_mean is not None
        c = acceleration(server_round, self.settings.acc_rate, self.settings.bound)
        # w_old: the global model at the round's start (round 1: the initial model)
        return mutate(self.round_mean, self.global_model, len(models), self.settings.radius, c, self.rng)
