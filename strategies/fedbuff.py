"""FedBuff: federated learning with buffered asynchronous aggregation (Nguyen et al., AISTATS 2022).

Up to C clients train at the same time, each on the model version it received; a client that
ends gets the current model at once. The server adds every arriving update, weighted by its
staleness τ (versions since the client's copy), to a buffer (the paper's Algorithm 1, with
Δ_i = trained − received, so the step is an addition):

    Δ̄ ← Δ̄ + s(τ_i)·Δ_i,  s(τ) = 1/√(1 + τ)
    after B updates:  θ ← θ + η_g·Δ̄ / B,  version ← version + 1,  Δ̄ ← 0

Updates are not weighted by ``num-examples`` (the paper's). An update older than
``max_staleness`` versions is dropped, as is a failed client's. The event loop (ordering on the
virtual clock, faults, resume) is :mod:`strategies.asynchronous`; one aggregation is one round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from logging import ERROR
from typing import Any

import numpy as np
from flwr.app import MetricRecord
from flwr.supercore import log

from fedmm import protocol
from fedmm.errors import ConfigError
from fedmm.protocol import ClientUpdate, ModelDict
from fedmm.settings import Choice, Int, Nullable, Number, setting
from strategies.aggregation import non_finite_key
from strategies.asynchronous import AsyncRoundLoop, Job, buffer_setting, check_async, half, max_staleness_setting
from strategies.base import StrategySettings
from strategies.defence import COMPARING, defend

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
    refused_defences = dict.fromkeys(
        COMPARING,
        "FedBuff folds each update into its buffer's sum as it arrives, so no update is compared with the "
        "others; clip_update_norm bounds each")

    def check(self, run: Any) -> None:
        """The async rules; C at most the clients."""
        super().check(run)
        check_async(self, run)
        if self.concurrency is not None and self.concurrency > run.num_clients:
            raise ConfigError("strategy.concurrency", self.concurrency, f"at most num_clients ({run.num_clients})")


class FedBuff(AsyncRoundLoop):
    """FedBuff on the asynchronous event loop: only the buffer and the server step are its own.

    Parameters
    ----------
    clients_per_round, seed, fraction_evaluate, selector, settings
        See :class:`~strategies.base.RoundLoopStrategy` (C defaults to ``clients_per_round``).
    concurrency, buffer_size, server_lr, staleness_weight, max_staleness
        C, B, η_g, s(τ) and the staleness bound (the module docstring).
    """

    Settings = FedBuffSettings

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: The model versions that jobs in flight were sent (and the current one).
        self.versions: dict[int, ModelDict] = {}
        #: Δ̄, the updates in it (metrics only) and their staleness.
        self.delta: dict[str, np.ndarray] | None = None
        self.buffered: list[ClientUpdate] = []
        self.buffered_staleness: list[int] = []
        #: Jobs in a row that failed (B of them end a round with no aggregation: max_failed_rounds).
        self.failed_in_a_row = 0

    def limit(self) -> int:
        """C."""
        return self.settings.concurrency or self.clients_per_round

    def minimum_nodes(self) -> int:
        return self.limit()

    def buffer(self) -> int:
        return self.settings.buffer_size or half(self.limit())

    def initialize(self, initial: ModelDict) -> None:
        self.models = [initial]
        self.global_model = initial
        self.versions = {0: initial}

    # ------------------------------------------------------------------ the event loop's hooks
    def wanted(self) -> list[int]:
        return [0] * max(0, self.limit() - len(self.jobs))

    def payload(self, job: Job) -> ModelDict:
        return self.versions[job.version]

    def arrive(self, server_round: int, job: Job) -> bool:
        """Add the update to the buffer (or drop it); the round is over after B updates, or
        after B failed jobs in a row (no aggregation)."""
        staleness = self.staleness(job)
        reason = job.failure
        if not reason and self.max_staleness is not None and staleness > self.max_staleness:
            reason = f"staleness {staleness} exceeds max_staleness ({self.max_staleness}): update dropped"
            self.failures.append(f"{self.name_job(job)}: {reason}")
        if reason or job.update is None:
            self.failed_in_a_row += 1
            self.forget_versions()
            return self.failed_in_a_row >= self.buffer()
        self.failed_in_a_row = 0
        sent = self.versions[job.version]
        model = job.update.model
        if self.defence.clip_update_norm is not None:  # the defence stage, one update at a time
            before = dict(self.round_log)
            [update], _ = defend(self.settings.defence, [job.update], [sent], [self.name_job(job)], self.failures, self.round_log)
            model = update.model
            self.round_log["largest_update_norm"] = max(before.get("largest_update_norm", 0.0), self.round_log["largest_update_norm"])
            self.round_log["updates_scaled"] += before.get("updates_scaled", 0.0)
        self.delta = add_update(self.delta, model, sent, staleness_weight(staleness, self.settings.staleness_weight))
        self.buffered.append(ClientUpdate(job.node, 0, {}, job.update.num_examples, job.update.metrics))
        self.buffered_staleness.append(staleness)
        self.replies.accepted_rounds[job.node] = job.server_round
        self.forget_versions()
        return len(self.buffered) >= self.buffer()

    def forget_versions(self) -> None:
        """Keep only the versions a job in flight was sent, and the current one."""
        keep = {job.version for job in self.jobs.values()} | {self.version}
        self.versions = {v: m for v, m in self.versions.items() if v in keep}

    def close(self, server_round: int):  # type: ignore[no-untyped-def]
        """θ ← θ + η_g·Δ̄/B (none when the round ended on failures)."""
        assert self.models is not None
        updates, staleness = self.buffered, self.buffered_staleness
        if len(updates) < self.buffer():  # B failed jobs in a row: no step this round
            self.last_round.replies = 0
            self.log_round(server_round, 0, self.failed_in_a_row)
            self.failed_in_a_row = 0
            return None, MetricRecord({"replies": 0.0})
        step = server_step(self.models[0], self.delta or {}, len(updates), self.server_lr)
        bad = non_finite_key(step)
        metrics = self.train_metrics(updates)
        self.buffered, self.buffered_staleness, self.delta = [], [], None
        if bad:
            log(ERROR, "round %d: the server step has NaN/Inf in %s; the model is kept", server_round, bad)
            self.last_round.replies = 0
            return None, metrics
        self.version += 1
        self.models, self.global_model = [step], step
        self.versions[self.version] = step
        self.forget_versions()
        self.freeze()
        self.last_round.replies = len(updates)
        self.round_log.update({"staleness_mean": float(np.mean(staleness)), "staleness_max": float(max(staleness))})
        self.log_round(server_round, len(updates), len(updates) + len(self.failures))
        return protocol.model_to_record(step), metrics

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The loop's state plus the versions in flight and the buffer (Δ̄ and its updates)."""
        return {**super().state_dict(), "fedbuff": {
            "versions": dict(self.versions), "delta": self.delta, "failed_in_a_row": self.failed_in_a_row,
            "buffered": [(u.node_id, u.num_examples, dict(u.metrics)) for u in self.buffered],
            "buffered_staleness": list(self.buffered_staleness),
        }}

    def load_state_dict(self, state: Any) -> None:
        super().load_state_dict(state)
        saved = state["fedbuff"]
        self.versions = {int(v): m for v, m in saved["versions"].items()}
        self.delta = None if saved["delta"] is None else {k: np.array(v, np.float64) for k, v in saved["delta"].items()}
        self.failed_in_a_row = int(saved["failed_in_a_row"])
        self.buffered = [ClientUpdate(int(n), 0, {}, float(e), dict(m)) for n, e, m in saved["buffered"]]
        self.buffered_staleness = [int(s) for s in saved["buffered_staleness"]]
