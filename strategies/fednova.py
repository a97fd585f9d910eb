"""FedNova (Wang, Liu, Liang, Joshi, Poor, NeurIPS 2020): normalized averaging, the server.

Clients that take different numbers of local steps pull a plain average towards the ones that
took more (objective inconsistency). FedNova divides each client's update by how far its steps
reach, a_i (its ``fednova-a`` metric: the client half, ``objective=fednova``, selected with this
method), and scales the average back by the effective number of steps τ_eff = Σ p_i·a_i:

    x ← x − τ_eff · Σ_i p_i·(x − y_i)/a_i        p_i = n_i / Σ n (``num-examples``)

computed as the run's mean (weights p_i) of the normalized models x − (τ_eff/a_i)·(x − y_i), so a
robust mean applies to them unchanged. The trainable parameters are normalized; buffers
(BatchNorm's running statistics, integer counters) are averaged as FedAvg does. A reply without
a positive, finite ``fednova-a`` is rejected when it arrives.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedmm.protocol import ClientUpdate, ModelDict
from objectives.fednova import NORMALIZER
from strategies.aggregators import Mean
from strategies.extrapolation import is_buffer
from strategies.fedavg import FedAvg, FedAvgSettings
from strategies.method import Needs, refused


@dataclass
class FedNovaSettings(FedAvgSettings):
    """FedNova has no settings beyond FedAvg's (its clients report their steps)."""

    option = "fednova"
    title = "FedNova"


class FedNova(FedAvg):
    """Normalized averaging (module docstring): only :meth:`aggregate` differs from FedAvg."""

    Settings = FedNovaSettings
    releases = refused("it rescales each update by τ_eff/a_i, which clipping does not bound")

    def needs(self, server_round: int) -> Needs:
        """Every reply carries its client's normalizing factor."""
        return Needs(metrics=(NORMALIZER,))

    def aggregate(self, server_round: int, updates: list[ClientUpdate], mean: Mean) -> ModelDict | None:
        if not updates:
            return None
        current = self.models[0]
        weights = mean.weights(updates)
        p = np.asarray(weights, np.float64) / np.sum(weights)
        reach = np.array([float(u.metrics[NORMALIZER]) for u in updates])
        tau_eff = float(p @ reach)
        normalized = [
            {key: value if is_buffer(key, value) else
             (current[key] - (tau_eff / a) * (current[key].astype(np.float64) - value)).astype(value.dtype)
             for key, value in update.model.items()}
            for update, a in zip(updates, reach)]
        self.round_log["tau_eff"] = tau_eff
        self.models = [mean(normalized, weights)]
        return self.models[0]
