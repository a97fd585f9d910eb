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
from typing import Any

from strategies.asynchronous import AsyncRound, buffer_setting, check_async, half, max_staleness_setting
from strategies.fedcross import FedCross, FedCrossSettings
from strategies.fedmr import FedMR, FedMRSettings

#: What B counts for the multi-model methods, and what it is half of by default.
MODELS_BACK = ("models back (trained or failed)", "clients_per_round (K); K: the synchronous method")


def _buffer(settings: Any, run: Any) -> int:
    """B: the models back that end a round."""
    return settings.buffer_size or half(run.clients_per_round)


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

    updates_named = "strategy.buffer_size"

    def updates_per_round(self, run: Any) -> int:
        return _buffer(self, run)

    def check(self, run: Any) -> None:
        super().check(run)
        _check(self, run)

    @property
    def display(self) -> str:
        return "Indep (async)" if self.partition_ratio == 1.0 else self.title


class FedMRAsync(FedMR):
    """FedMR run by the asynchronous driver: FedMR's :meth:`~strategies.fedmr.FedMR.update_models`
    on the B models that came back."""

    Settings = FedMRAsyncSettings
    Driver = AsyncRound


@dataclass
class FedCrossAsyncSettings(FedCrossSettings):
    """Asynchronous FedCross (docs/async.md): every B models that come back are each fused with a
    collaborative model chosen among them and go out again; the other models keep training."""

    option = "fedcross_async"
    title = "FedCross (async)"
    buffer_size: int | None = buffer_setting(*MODELS_BACK)
    max_staleness: int | None = max_staleness_setting("restart a model from the global model")

    updates_named = "strategy.buffer_size"

    def updates_per_round(self, run: Any) -> int:
        return _buffer(self, run)

    def check(self, run: Any) -> None:
        super().check(run)
        _check(self, run)


class FedCrossAsync(FedCross):
    """FedCross run by the asynchronous driver: FedCross's :meth:`~strategies.fedcross.FedCross.update_models`
    on the B models that came back."""

    Settings = FedCrossAsyncSettings
    Driver = AsyncRound
