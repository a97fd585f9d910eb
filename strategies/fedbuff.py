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

from fedmm.errors import ConfigError
from fedmm.protocol import ClientUpdate, ModelDict
from fedmm.settings import Choice, Int, Nullable, Number, setting
from strategies.aggregators import Mean
from strategies.asynchronous import AsyncRound, buffer_setting, check_async, half, max_staleness_setting
from strategies.method import Method
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
    concurrency: int | None = setting(None, Nullable(Int(min=1), "null (clients_per_round) or an integer >= 1"),
                                      "C: clients training at the same time (null: clients_per_round)", label="C {}")
    buffer_size: int | None = buffer_setting("accepted updates", "the concurrency")
    server_lr: float = setting(1.0, Number(gt=0), "η_g: θ ← θ + η_g·Δ̄/B", label="η_g {}")
    staleness_weight: str = setting("sqrt", Choice(*STALENESS_WEIGHTS), "sqrt: 1/sqrt(1 + τ) (the paper's) | none: 1",
                                    paper="1/sqrt(1 + staleness)", label="staleness weight {}")
    max_staleness: int | None = max_staleness_setting("drop an update")

    updates_named = "strategy.buffer_size"

    def updates_per_round(self, run: Any) -> int:
        """B: the accepted updates of a round."""
        return self.buffer_size or half(self.concurrency or run.clients_per_round)

    def check(self, run: Any) -> None:
        """The async rules; C at most the clients."""
        super().check(run)
        check_async(self, run)
        if self.concurrency is not None and self.concurrency > run.num_clients:
            raise ConfigError("strategy.concurrency", self.concurrency, f"at most num_clients ({run.num_clients})")


class FedBuff(Method):
    """FedBuff: a one-model method run by the asynchronous driver; its own are the buffer's
    staleness-weighted sum and the server step.

    Parameters
    ----------
    clients_per_round, seed, fraction_evaluate, selector, settings
        See :class:`~strategies.base.FedmmStrategy` (C defaults to ``clients_per_round``).
    concurrency, buffer_size, server_lr, staleness_weight, max_staleness
        C, B, η_g, s(τ) and the staleness bound (the module docstring).
    """

    Settings = FedBuffSettings
    releases = ""
    private_refused = "its jobs run without a round barrier: no round samples K of N clients, which the accounting assumes"
    Driver = AsyncRound

    def aggregate(self, server_round: int, updates: list[ClientUpdate], mean: Mean) -> ModelDict | None:
        """θ ← θ + η_g·Δ̄/B over the round's buffered updates, each against the version it was
        sent (in arrival order); with a robust mean, θ + η_g·(robust mean of the s(τ_i)·Δ_i)."""
        if not updates:
            return None
        assert self.models is not None
        weights = [staleness_weight(u.staleness, self.settings.staleness_weight) for u in updates]
        if mean.robust:
            scaled = [add_update(None, u.model, u.sent, w) for u, w in zip(updates, weights)]
            step = server_step(self.models[0], mean(scaled, deltas=True), 1, self.server_lr)
        else:
            delta = None
            for update, weight in zip(updates, weights):
                delta = add_update(delta, update.model, update.sent, weight)
            step = server_step(self.models[0], delta or {}, len(updates), self.server_lr)
        self.models = [step]
        return step
