"""q-FedAvg: fair resource allocation (q-FFL, Li, Sanjabi, Beirami, Smith, ICLR 2020).

The server weighs each client by its loss raised to q, so that clients the model serves badly
move it more. With w the model sent, w_k a client's trained model, F_k the loss of w on the
client's training rows before training (``loss-before``, measured by the ClientApp: the method
needs it), and L = 1/η the Lipschitz estimate from the clients' learning rate η:

    Δ_k = F_k^q · L·(w − w_k)        h_k = q·F_k^(q−1)·‖L·(w − w_k)‖² + L·F_k^q
    w ← w − Σ_k Δ_k / Σ_k h_k

which is the mean of the clients' proposals w − Δ_k/h_k weighted by h_k, taken through the run's
mean (a robust aggregator configured by the run applies to the proposals). q = 0 is FedAvg's
unweighted step with step size η·L = 1. Flower's own ``QFedAvg`` computes the same step
(``tests/test_qfedavg.py`` holds them equal on the same replies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fedmm import protocol
from fedmm.protocol import ClientUpdate, ModelDict
from fedmm.settings import Nullable, Number, setting
from strategies.aggregators import Mean
from strategies.method import Method, Needs, refused
from strategies.strategy_settings import StrategySettings


@dataclass
class QFedAvgSettings(StrategySettings):
    """q-FedAvg's fairness q and the clients' learning rate its Lipschitz estimate reads."""

    option = "qfedavg"
    title = "q-FedAvg"
    q: float = setting(0.1, Number(ge=0), "q: how much a client's loss weighs its update (0: FedAvg's step)",
                       paper="0.1 to 15 by dataset (Li et al., Table 5)", label="q {}")
    client_learning_rate: float | None = setting(None, Nullable(Number(gt=0), "null (training.lr) or a rate > 0"),
                                                 "η of L = 1/η, the Lipschitz estimate (null: the run's training.lr)")

    def for_run(self, run: Any) -> QFedAvgSettings:
        """The clients' learning rate resolved from the run's training group."""
        return self if self.client_learning_rate is not None else self.replace(client_learning_rate=float(run.training.lr))


class QFedAvg(Method):
    """The q-FFL step (module docstring) on the one-model round."""

    Settings = QFedAvgSettings
    releases = refused("its step weighs each update by the client's reported loss to the power q, so one client can "
                       "move the model far more than the 2C/m a mean's noise is calibrated to")

    def needs(self, server_round: int) -> Needs:
        """Every reply carries the loss of the received model before training."""
        return Needs(metrics=(protocol.LOSS_BEFORE,))

    def aggregate(self, server_round: int, updates: list[ClientUpdate], mean: Mean) -> ModelDict | None:
        """w − Σ Δ_k / Σ h_k, as the h-weighted mean of the proposals w − Δ_k / h_k."""
        if not updates:
            return None
        q, lipschitz = self.settings.q, 1.0 / float(self.settings.client_learning_rate or 1.0)
        current = self.models[0]
        proposals, weights = [], []
        for update in updates:
            loss = float(update.metrics[protocol.LOSS_BEFORE]) + 1e-10
            grad = {k: lipschitz * (np.asarray(v, np.float64) - np.asarray(update.model[k], np.float64))
                    for k, v in current.items()}
            h = q * loss ** (q - 1) * sum(float(np.sum(g * g)) for g in grad.values()) + lipschitz * loss ** q
            proposals.append({k: (np.asarray(current[k], np.float64) - loss ** q * g / h).astype(np.asarray(current[k]).dtype)
                              for k, g in grad.items()})
            weights.append(h)
        self.round_log["qffl_h_sum"] = float(sum(weights))
        self.models = [mean(proposals, weights)]
        return self.models[0]
