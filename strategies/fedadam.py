"""FedAdam (Reddi et al., ICLR 2021) as a server optimizer: v_t = β₂·v_{t−1} + (1 − β₂)·δ_t², with
Adam's bias correction of the rate, η_t = η·√(1 − β₂^{t+1}) / (1 − β₁^{t+1}), as Flower's ``FedAdam``
(its defaults: η = 0.1, β₁ = 0.9, β₂ = 0.99, τ = 1e-3). ``server_optimizer=fedadam``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strategies.fedopt import FedOpt, FedOptSettings


@dataclass
class FedAdamSettings(FedOptSettings):
    """FedAdam's settings (Flower's defaults)."""

    option = "fedadam"
    title = "FedAdam"


class FedAdam(FedOpt):
    """Adam's moments on the server."""

    Settings = FedAdamSettings

    def second_moment(self, v: np.ndarray, delta: np.ndarray) -> np.ndarray:
        return self.beta_2 * v + (1 - self.beta_2) * delta**2

    def rate(self, server_round: int) -> float:
        return float(self.eta * np.sqrt(1 - self.beta_2 ** (server_round + 1.0)) / (1 - self.beta_1 ** (server_round + 1.0)))
