"""FedDyn: federated learning with dynamic regularization (Acar et al., ICLR 2021), the server.

The server keeps the model θ it sends (the "cloud" model of the authors' code) and a state h
(zeros at first). With P_t the round's accepted clients, θ_k their trained models and m the
number of clients in the federation (Algorithm 1):

    h ← h − (α/m)·Σ_{k∈P_t} (θ_k − θ)
    θ ← (1/|P_t|)·Σ_{k∈P_t} θ_k − h/α

(:func:`feddyn_server_step`; trainable parameters only: buffers such as BatchNorm's running
statistics are the plain mean). Each client keeps its own linear term in ``Context.state``
(the ``feddyn`` objective, :mod:`objectives.feddyn`), selected with this strategy.

The model evaluated and saved is the mean of the round's trained models (the authors' code
evaluates that one, ``avg_model``); the corrected θ is what the clients train next.

Kept differences from the authors' code: one α for every client (their code divides α by the
client's share of the data, n_k·N/Σn); a failed client leaves h unchanged for its part.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedmm.errors import ConfigError
from fedmm.protocol import ClientUpdate, ModelDict
from fedmm.settings import Number, setting
from strategies.aggregation import mean_models
from strategies.base import StrategySettings
from strategies.defence import robust_mean
from strategies.extrapolation import is_buffer
from strategies.fedavg import FedAvg
from strategies.selection import ClientSelector


def feddyn_server_step(
    server: Mapping[str, np.ndarray], models: Sequence[Mapping[str, np.ndarray]], h: Mapping[str, np.ndarray],
    alpha: float, num_clients: int, robust_mean: ModelDict | None = None,
) -> tuple[ModelDict, ModelDict, ModelDict]:
    """One FedDyn server update: (the next server model θ, the next h, the mean of ``models``).

    ``server`` is the model the clients received, ``h`` holds one array per trainable parameter
    (its keys), ``num_clients`` is m. Computed in float64, returned in each array's own dtype.
    """
    mean = mean_models(models) if robust_mean is None else robust_mean
    new_h: ModelDict = {}
    nxt: ModelDict = dict(mean)
    for key, h_old in h.items():
        if robust_mean is None:
            drift = sum(np.asarray(m[key], dtype=np.float64) - server[key] for m in models)
        else:  # Σ_i (θ_i − θ) with each θ_i replaced by the robust mean
            drift = len(models) * (np.asarray(robust_mean[key], dtype=np.float64) - server[key])
        h_new = np.asarray(h_old, dtype=np.float64) - (alpha / num_clients) * drift
        new_h[key] = h_new.astype(h_old.dtype)
        nxt[key] = (mean[key].astype(np.float64) - h_new / alpha).astype(mean[key].dtype)
    return nxt, new_h, mean


@dataclass
class FedDynSettings(StrategySettings):
    """FedDyn's α, the weight of the dynamic regularizer (server and clients)."""

    option = "feddyn"
    title = "FedDyn"
    companions = {"objective": "feddyn"}
    alpha: float = setting(0.01, Number(gt=0), "α of the regularizer and of h's update",
                           paper="0.1, 0.01, 0.001 (tuned per setting; the authors' code: 0.01)", label="α {}")

    def check(self, run: Any) -> None:
        """The clients must run FedDyn's objective."""
        super().check(run)
        if run.objective.name != "feddyn":
            raise ConfigError("objective", run.objective.name, "feddyn with strategy feddyn (the clients keep the linear term)")


class FedDyn(FedAvg):
    """FedDyn's server: only :meth:`aggregate` differs from FedAvg.

    Parameters
    ----------
    clients_per_round, seed, fraction_evaluate, selector, settings, changes
        See :class:`~strategies.base.RoundLoopStrategy`.
    num_clients : int
        m, the number of clients in the federation (h's denominator).
    """

    Settings = FedDynSettings

    def __init__(self, clients_per_round: int, seed: int, num_clients: int, fraction_evaluate: float | None = None,
                 selector: ClientSelector | None = None, **settings: Any) -> None:
        super().__init__(clients_per_round, seed, fraction_evaluate, selector, **settings)
        if num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        self.num_clients = int(num_clients)
        self.h: ModelDict | None = None

    @classmethod
    def from_settings(cls, run: Any) -> FedDyn:
        """FedDyn of a run: m from ``num_clients``."""
        return cls(run.clients_per_round, run.seed, run.num_clients, settings=run.strategy)

    def initialize(self, initial: ModelDict) -> None:
        """The model, and h = 0 for every trainable parameter."""
        super().initialize(initial)
        self.h = {k: np.zeros_like(v) for k, v in initial.items() if not is_buffer(k, v)}

    def aggregate(self, server_round: int, updates: list[ClientUpdate]) -> ModelDict | None:
        """θ and h after the round (:func:`feddyn_server_step`); the evaluated model is the mean."""
        if not updates:
            return None
        assert self.models is not None and self.h is not None
        nxt, self.h, mean = feddyn_server_step(self.models[0], [u.model for u in updates], self.h, self.alpha, self.num_clients,
                                                    robust_mean(self.settings.defence, [u.model for u in updates]))
        self.models = [nxt]
        self.round_log["h_norm"] = float(np.sqrt(sum(float(np.square(v, dtype=np.float64).sum()) for v in self.h.values())))
        return mean

    def state_dict(self) -> dict[str, Any]:
        """The base state plus h."""
        return {**super().state_dict(), "h": self.h}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        super().load_state_dict(state)
        self.h = state["h"]
