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
from strategies.aggregators import Mean
from strategies.extrapolation import is_buffer
from strategies.fedavg import FedAvg
from strategies.method import refused
from strategies.selection import ClientSelector
from strategies.strategy_settings import StrategySettings


def feddyn_server_step(
    server: Mapping[str, np.ndarray], models: Sequence[Mapping[str, np.ndarray]], h: Mapping[str, np.ndarray],
    alpha: float, num_clients: int, robust_mean: ModelDict | None = None,
) -> tuple[ModelDict, ModelDict, ModelDict]:
    """One FedDyn server update: (the next server model θ, the next h, the mean of ``models``).

    ``server`` is the model the clients received, ``h`` holds one array per trainable parameter
    (its keys), ``num_clients`` is m. Computed in float64, returned in each array's own dtype.
    ``robust_mean``: a robust mean of ``models`` (``strategy.defence.aggregator``) standing in
    for each of them (the sum of the updates is then |P_t| times its update).
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
    alpha: float = setting(0.01, Number(gt=0), "α of the regularizer and of h's update",
                           paper="0.1, 0.01, 0.001 (tuned per setting; the authors' code: 0.01)", label="α {}")


class FedDyn(FedAvg):
    """FedDyn's server: only :meth:`aggregate` differs from FedAvg.

    Parameters
    ----------
    clients_per_round, seed, fraction_evaluate, selector, settings, changes
        See :class:`~strategies.base.FedmmStrategy`.
    num_clients : int
        m, the number of clients in the federation (h's denominator).
    """

    Settings = FedDynSettings
    global_is_next = False  # it evaluates the mean of the trained models, trains the corrected θ
    releases = refused("its state h sums every round's client drifts into the model it sends: a second release this "
                       "analysis does not cover")

    def __init__(self, clients_per_round: int | None = None, seed: int = 0, num_clients: int | None = None,
                 fraction_evaluate: float | None = None, selector: ClientSelector | None = None, **settings: Any) -> None:
        if num_clients is None:
            raise TypeError("FedDyn() missing the argument num_clients (m: the clients of the federation, h's denominator)")
        super().__init__(clients_per_round, seed, fraction_evaluate, selector, num_clients=int(num_clients), **settings)
        self.h: ModelDict | None = None

    def initialize(self, initial: ModelDict) -> None:
        """The model, and h = 0 for every trainable parameter."""
        super().initialize(initial)
        self.h = {k: np.zeros_like(v) for k, v in initial.items() if not is_buffer(k, v)}

    def aggregate(self, server_round: int, updates: list[ClientUpdate], mean: Mean) -> ModelDict | None:
        """θ and h after the round (:func:`feddyn_server_step`); the evaluated model is the mean."""
        if not updates:
            return None
        assert self.models is not None and self.h is not None
        models = [u.model for u in updates]
        nxt, self.h, average = feddyn_server_step(self.models[0], models, self.h, self.settings.alpha, self.num_clients,
                                                   mean(models) if mean.robust else None)
        self.models = [nxt]
        self.round_log["h_norm"] = float(np.sqrt(sum(float(np.square(v, dtype=np.float64).sum()) for v in self.h.values())))
        return average

    def state_dict(self) -> dict[str, Any]:
        """The base state plus h."""
        return {**super().state_dict(), "h": self.h}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        super().load_state_dict(state)
        self.h = state["h"]
