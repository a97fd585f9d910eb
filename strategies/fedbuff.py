"""FedBuff: federated learning with buffered asynchronous aggregation (Nguyen et al., AISTATS 2022).

Up to C clients train at the same time, each on the model version it received; a client that
ends gets the current model at once. The server adds every arriving update, weighted by its
staleness τ (versions since the client's copy), to a buffer (the paper's Algorithm 1, with
Δ_i = trained − received, so the step is an addition):

    Δ̄ ← Δ̄ + s(τ_i)·Δ_i,  s(τ) = 1/√(1 + τ)
    after B updates:  θ ← θ + η_g·Δ̄ / B,  version ← version + 1,  Δ̄ ← 0

Updates are not weighted by ``num-examples`` (the paper's). An update older than
``max_staleness`` versions is dropped, as is a failed client's. The event loop (ordering on the
virtual clock, faults, resume) is the asynchronous driver's (:mod:`strategies.asynchronous`);
one aggregation is one round, which ends as every round does (:mod:`strategies.rounds`: the
defence stage on the B updates, each against the version it was sent).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedmm.protocol import ClientUpdate, ModelDict
from fedmm.settings import Choice, Number, setting
from strategies.aggregators import Mean
from strategies.asynchronous import AsyncSettings
from strategies.method import ASYNC, Method, refused
from strategies.strategy_settings import StrategySettings

STALENESS_WEIGHTS = ("sqrt", "none")


def staleness_weight(staleness: int, kind: str = "sqrt") -> float:
    """s(τ): ``sqrt`` is the paper's 1/√(1 + τ); ``none`` weighs every update 1."""
    if kind == "sqrt":
        return 1.0 / math.sqrt(1.0 + staleness)
    if kind == "none":
        return 1.0
    raise ValueError(f"staleness_weight={kind!r}; allowed: {', '.join(STALENESS_WEIGHTS)}")


def add_update(buffer: dict[str, np.ndarray] | None, model: ModelDict, sent: ModelDict, weight: float) -> dict[str, np.ndarray]:
    """Δ̄ + weight·(model − sent), every entry in float64 (integer buffers too)."""
    out = buffer if buffer is not None else {key: np.zeros(np.shape(value), np.float64) for key, value in sent.items()}
    for key, value in model.items():
        out[key] += weight * (np.asarray(value, np.float64) - np.asarray(sent[key], np.float64))
    return out


def server_step(model: ModelDict, buffer: dict[str, np.ndarray], count: int, server_lr: float) -> ModelDict:
    """θ + η_g·Δ̄ / count, in each entry's own dtype (integer buffers rounded)."""
    out: ModelDict = {}
    for key, value in model.items():
        new = np.asarray(value, np.float64) + (server_lr / count) * buffer[key]
        out[key] = np.asarray(new if np.issubdtype(value.dtype, np.floating) else np.rint(new)).astype(value.dtype)
    return out


@dataclass
class FedBuffSettings(StrategySettings):
    """FedBuff (Nguyen et al., AISTATS 2022): buffered asynchronous aggregation."""

    option = "fedbuff"
    title = "FedBuff"
    server_lr: float = setting(1.0, Number(gt=0), "η_g: θ ← θ + η_g·Δ̄/B", label="η_g {}")
    staleness_weight: str = setting("sqrt", Choice(*STALENESS_WEIGHTS), "sqrt: 1/sqrt(1 + τ) (the paper's) | none: 1",
                                    paper="1/sqrt(1 + staleness)", label="staleness weight {}")
    asynchronous: AsyncSettings = setting(AsyncSettings(enabled=True), help="its asynchronous driver: C clients at once "
                                          "(concurrency), B accepted updates per aggregation (buffer_size), stale updates "
                                          "dropped (max_staleness); docs/async.md")

    #: Its driver's settings were its own before every method had them: a run made then is asynchronous.
    added = {"asynchronous": AsyncSettings(enabled=True).to_dict()}


class FedBuff(Method):
    """FedBuff: a one-model method run by the asynchronous driver; its own are the buffer's
    staleness-weighted sum and the server step.

    Parameters
    ----------
    clients_per_round, seed, fraction_evaluate, selector, settings
        See :class:`~strategies.base.FedmmStrategy` (C defaults to ``clients_per_round``).
    server_lr, staleness_weight, asynchronous
        η_g, s(τ), and C, B and the staleness bound (the module docstring).
    """

    Settings = FedBuffSettings
    drivers = (ASYNC,)
    releases = refused("its jobs run without a round barrier: no round samples K of N clients, which the accounting assumes")

    def aggregate(self, server_round: int, updates: list[ClientUpdate], mean: Mean) -> ModelDict | None:
        """θ ← θ + η_g·Δ̄/B over the round's buffered updates, each against the version it was
        sent (in arrival order); with a robust mean, θ + η_g·(robust mean of the s(τ_i)·Δ_i)."""
        if not updates:
            return None
        assert self.models is not None
        weights = [staleness_weight(u.staleness, self.settings.staleness_weight) for u in updates]
        if mean.robust:
            scaled = [add_update(None, u.model, u.sent, w) for u, w in zip(updates, weights)]
            step = server_step(self.models[0], mean(scaled, deltas=True), 1, self.settings.server_lr)
        else:
            delta = None
            for update, weight in zip(updates, weights):
                delta = add_update(delta, update.model, update.sent, weight)
            step = server_step(self.models[0], delta or {}, len(updates), self.settings.server_lr)
        self.models = [step]
        return step
