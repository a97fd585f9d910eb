"""Asynchronous FedMR and FedCross: K models that never wait for one another (docs/async.md).

The server keeps K models, as the synchronous methods do. A model at the server goes to the next
free client at once; when B of them have come back (B ≤ K), the method's operation is applied
among those B models only (the models "currently at the server"): FedMR recombines them layer
by layer, FedCross fuses each with a collaborative model chosen among them (with α), each in the
stage its aggregation number r is in (first stage, propellers, dynamic α: the synchronous
schedules, counted in aggregations); then the B models go out again. The models still in flight
are not touched. The global model (evaluation only) is the mean of the K models, taken before
the operation, as in the synchronous methods.

A model whose job failed comes back as it was sent and counts among the B (a failed node keeps
its model in a synchronous round, and that model is recombined too). With ``max_staleness`` a
model whose client trained on a copy more than that many aggregations old is not used: it
restarts from the global model.

With B = K every aggregation waits for all K models, all nodes are free when they go out again
and the first draw of a round is the synchronous sample: the method is then the synchronous one,
model for model (``tests/test_async.py``), whatever the clients' speeds.
"""

from __future__ import annotations

from dataclasses import dataclass
from logging import ERROR, WARNING
from typing import Any

from flwr.supercore import log

from fedmm import protocol
from fedmm.errors import ConfigError
from fedmm.protocol import ClientUpdate, ModelDict
from strategies.aggregation import mean_models, non_finite_key
from strategies.asynchronous import AsyncRoundLoop, Job, buffer_setting, check_async, half, max_staleness_setting
from strategies.defence import client_mean, defend
from strategies.fedcross import FedCross, FedCrossSettings
from strategies.fedmr import FedMR, FedMRSettings
from strategies.multimodel import cosine_summary


class AsyncMultiModel(AsyncRoundLoop):
    """The asynchronous multi-model loop; mixed in before a :class:`~strategies.multimodel.MultiModelStrategy`
    whose :meth:`update_models` is the operation (applied to the B arrived models)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Models at the server waiting for a free client, in the order they go out.
        self.ready: list[int] = list(range(self.num_models))
        #: Models back since the last aggregation: index -> the accepted update (None: failed, or too stale).
        self.arrived: dict[int, ClientUpdate | None] = {}
        #: Staleness of the updates back since the last aggregation.
        self.used_staleness: list[int] = []

    def minimum_nodes(self) -> int:
        return self.num_models

    def buffer(self) -> int:
        return self.settings.buffer_size or half(self.num_models)

    # ------------------------------------------------------------------ the event loop's hooks
    def wanted(self) -> list[int]:
        return list(self.ready)

    def payload(self, job: Job) -> ModelDict:
        assert self.models is not None
        return self.models[job.model_index]

    def sent(self, job: Job) -> None:
        self.ready.remove(job.model_index)

    def arrive(self, server_round: int, job: Job) -> bool:
        """The model is back: trained, or as it was sent (failed), or restarted (too stale)."""
        assert self.models is not None
        staleness = self.staleness(job)
        update = None if job.failure else job.update
        if update is not None and self.max_staleness is not None and staleness > self.max_staleness:
            self.failures.append(f"{self.name_job(job)}: staleness {staleness} exceeds max_staleness "
                                 f"({self.max_staleness}): the model restarts from the global model")
            self.models[job.model_index] = self.global_model  # type: ignore[assignment]
            update = None
        if update is not None:
            self.replies.accepted_rounds[job.node] = job.server_round
            self.used_staleness.append(staleness)
        self.arrived[job.model_index] = update
        return len(self.arrived) >= self.buffer()

    def close(self, server_round: int):  # type: ignore[no-untyped-def]
        """The operation among the B arrived models; the K-model mean is the global model."""
        assert self.models is not None
        indices = sorted(self.arrived)
        updates = [u for u in (self.arrived[i] for i in indices) if u is not None]
        if updates:  # the defence stage, against the model each was sent
            before = len(self.failures)
            kept, stand_ins = defend(self.settings.defence, updates, [self.models[u.slot] for u in updates],
                                     [f"node {u.node_id} (model {u.slot})" for u in updates], self.failures,
                                     self.round_log)
            refilled = {u.slot: u for u in stand_ins}
            for update in updates:
                if all(update is not k for k in kept):  # its stand-in (refill), or None: back as it was sent
                    self.arrived[update.slot] = refilled.get(update.slot)
            for reason in self.failures[before:]:
                log(WARNING, "\t> rejected: %s", reason)
            self.last_round.rejections = list(self.failures)
            updates = kept
        current = list(self.models)
        for update in (self.arrived[i] for i in indices):  # the kept updates and the stand-ins
            if update is not None:
                current[update.slot] = update.model
        if self.log_model_cosine:
            self.round_log.update(cosine_summary([u.model for u in updates]))
        if self.used_staleness:
            self.round_log.update({"staleness_mean": sum(self.used_staleness) / len(self.used_staleness),
                                   "staleness_max": float(max(self.used_staleness))})
        self.used_staleness = []
        metrics = self.train_metrics(updates)
        previous = (list(self.models), self.global_model)
        global_model = self.round_mean = client_mean(self.settings.defence, current, lambda: mean_models(current))
        trained = [position for position, i in enumerate(indices) if self.arrived[i] is not None]
        fused = self.update_models(self.version + 1, [dict(current[i]) for i in indices], trained)
        self.round_mean = None
        for i, model in zip(indices, fused):
            self.models[i] = model
        self.arrived = {}
        self.ready = sorted(self.ready + indices)
        bad = non_finite_key(global_model) or next((k for m in self.models if (k := non_finite_key(m))), None)
        if bad:
            self.models, self.global_model = previous
            log(ERROR, "round %d: the aggregate has NaN/Inf in %s; the models before it are kept", server_round, bad)
            self.last_round.replies = 0
            metrics["replies"] = 0.0
            self.version += 1
            return None, metrics
        self.version += 1
        self.global_model = global_model
        self.freeze()
        self.last_round.replies = len(updates)
        self.log_round(server_round, len(updates), len(indices))
        return protocol.model_to_record(global_model), metrics

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The loop's state plus the models waiting for a client (and those back, none at a round's end)."""
        return {**super().state_dict(), "multimodel": {
            "ready": list(self.ready),
            "arrived": {i: (None if u is None else (u.node_id, u.model, u.num_examples, dict(u.metrics)))
                        for i, u in self.arrived.items()},
        }}

    def load_state_dict(self, state: Any) -> None:
        super().load_state_dict(state)
        saved = state["multimodel"]
        self.ready = [int(i) for i in saved["ready"]]
        self.arrived = {int(i): (None if u is None else ClientUpdate(int(u[0]), int(i), u[1], float(u[2]), dict(u[3])))
                        for i, u in saved["arrived"].items()}


#: What B counts for the multi-model methods, and what it is half of by default.
MODELS_BACK = ("models back (trained or failed)", "clients_per_round (K); K: the synchronous method")


def _check(settings: Any, run: Any) -> None:
    check_async(settings, run, buffer_of=run.clients_per_round)


@dataclass
class FedMRAsyncSettings(FedMRSettings):
    """Asynchronous FedMR (docs/async.md): every B models that come back are recombined among
    themselves and go out again; the other models keep training."""

    option = "fedmr_async"
    title = "FedMR (async)"
    buffer_size: int | None = buffer_setting(*MODELS_BACK)
    max_staleness: int | None = max_staleness_setting("restart a model from the global model")

    def check(self, run: Any) -> None:
        super().check(run)
        _check(self, run)
        if self.secure.enabled:
            raise ConfigError("strategy.secure.enabled", True, f"false with strategy={self.option} (secure "
                              "recombination exchanges layers among the clients of one synchronous round)")

    @property
    def display(self) -> str:
        return "Indep (async)" if self.partition_ratio == 1.0 else self.title


class FedMRAsync(AsyncMultiModel, FedMR):
    """FedMR without a round barrier: FedMR's :meth:`~strategies.fedmr.FedMR.update_models` on the
    B models that came back."""

    Settings = FedMRAsyncSettings


@dataclass
class FedCrossAsyncSettings(FedCrossSettings):
    """Asynchronous FedCross (docs/async.md): every B models that come back are each fused with a
    collaborative model chosen among them and go out again; the other models keep training."""

    option = "fedcross_async"
    title = "FedCross (async)"
    buffer_size: int | None = buffer_setting(*MODELS_BACK)
    max_staleness: int | None = max_staleness_setting("restart a model from the global model")

    def check(self, run: Any) -> None:
        super().check(run)
        _check(self, run)


class FedCrossAsync(AsyncMultiModel, FedCross):
    """FedCross without a round barrier: FedCross's :meth:`~strategies.fedcross.FedCross.update_models`
    on the B models that came back."""

    Settings = FedCrossAsyncSettings
