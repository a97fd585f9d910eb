"""FedAdagrad (Reddi et al., ICLR 2021) as a server optimizer: m_t = δ_t (β₁ = 0), v_t = v_{t−1} + δ_t²,
as Flower's ``FedAdagrad`` (its defaults: η = 0.1, τ = 1e-3). ``server_optimizer=fedadagrad``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedmm.settings import Number, setting
from strategies.fedopt import FedOpt, FedOptSettings


@dataclass
class FedAdagradSettings(FedOptSettings):
    """FedAdagrad's settings (Flower's defaults; no moment decay: β₁ = β₂ = 0)."""

    option = "fedadagrad"
    title = "FedAdagrad"
    beta_1: float = setting(0.0, Number(ge=0, le=0, allowed="0 (Adagrad keeps no first moment)"), "β₁: 0")
    beta_2: float = setting(0.0, Number(ge=0, le=0, allowed="0 (Adagrad sums the squares)"), "β₂: 0")


class FedAdagrad(FedOpt):
    """Adagrad's summed squares on the server."""

    Settings = FedAdagradSettings

    def second_moment(self, v: np.ndarray, delta: np.ndarray) -> np.ndarray:
        return v + delta**2
