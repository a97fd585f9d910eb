"""FedYogi (Reddi et al., ICLR 2021) as a server optimizer: v_t = v_{t−1} − (1 − β₂)·δ_t²·sign(v_{t−1} − δ_t²),
as Flower's ``FedYogi`` (its defaults: η = 0.01, β₁ = 0.9, β₂ = 0.99, τ = 1e-3). ``server_optimizer=fedyogi``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedmm.settings import Number, setting
from strategies.fedopt import FedOpt, FedOptSettings


@dataclass
class FedYogiSettings(FedOptSettings):
    """FedYogi's settings (Flower's defaults)."""

    option = "fedyogi"
    title = "FedYogi"
    eta: float = setting(0.01, Number(gt=0), "η: the server learning rate", label="η {}")


class FedYogi(FedOpt):
    """Yogi's additive second moment on the server."""

    Settings = FedYogiSettings

    def second_moment(self, v: np.ndarray, delta: np.ndarray) -> np.ndarray:
        return v - (1.0 - self.beta_2) * delta**2 * np.sign(v - delta**2)
