"""Observers: what sees a run without being part of it (recording, checkpoints, trackers, benches).

One callback interface, :class:`RunObserver`, whose every method does nothing by default; an
observer overrides the events it wants. The runner (``server_app/runner.py``) and the strategy
it runs both emit to the run's :class:`Observers`:

=======================  ===================================================================
``on_run_start(info)``   the run begins (the ServerApp's main: before data and model)
``on_restore(rows)``     a resumed run: the metrics rows of the rounds done before
``on_strategy_start(s)`` the strategy ``s``'s ``start`` begins (its initial evaluation and rounds follow)
``on_phase(r, p, s)``    a phase of round ``r`` took ``s`` seconds: ``select`` (the selector,
                         the roster query included), ``configure`` (the train messages),
                         ``exchange`` (their send and replies), ``aggregate`` (the round's end),
                         ``evaluate`` (the central evaluation), ``evaluate_exchange`` (federated)
``on_stage(r, u, v)``    the defence stage judged the round's updates ``u`` (each with its
                         ``sent`` model): its verdict ``v`` (kept, rejected, scores, numbers)
``on_aggregate(r, u)``   the updates the method aggregates in round ``r`` (kept and refilled)
``on_metrics(row)``      a row of ``metrics.jsonl`` (a round whose global model was evaluated)
``on_round_end(r)``      round ``r`` is over, its evaluation included (every round)
``on_strategy_end()``    the strategy's ``start`` returns
``on_run_end(...)``      the run ends: (status, reason, the run's files)
=======================  ===================================================================

An observer must not change what it is shown; it may end the run (:class:`StopRun`). Imports nothing of either app (the ground layer).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any


class StopRun(Exception):
    """Raised by an observer to end the run at once, cleanly: the run's ``summary.json`` gets
    ``status`` (e.g. ``pruned``) and ``reason``, its checkpoint is kept, and the runner returns the
    run directory (no error). Raised from ``on_round_end``, the round it ends is a completed one
    (its metrics row, its checkpoint and ``rounds_completed`` all hold it); raised from an event
    inside a round (``on_metrics``), that round is not counted as completed."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(f"{status}: {reason}")
        self.status, self.reason = status, reason


class RunObserver:
    """Sees a run's events (module docstring); every method does nothing by default."""

    def on_run_start(self, info: Any) -> None:
        """The run begins (``info``: :class:`server_app.tracking.RunInfo`)."""

    def on_restore(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """A resumed run: the metrics rows of the rounds done before."""

    def on_strategy_start(self, strategy: Any) -> None:
        """The strategy's ``start`` begins (an observer may read, never change, its state)."""

    def on_phase(self, server_round: int, phase: str, seconds: float) -> None:
        """A phase of a round took ``seconds`` (module docstring)."""

    def on_stage(self, server_round: int, updates: Sequence[Any], verdict: Any) -> None:
        """The defence stage's verdict on the round's updates (:class:`strategies.defence.Verdict`)."""

    def on_aggregate(self, server_round: int, updates: Sequence[Any]) -> None:
        """The updates the method aggregates (kept and refilled; each a ClientUpdate)."""

    def on_metrics(self, row: Mapping[str, Any]) -> None:
        """A row of ``metrics.jsonl``."""

    def on_round_end(self, server_round: int) -> None:
        """Round ``server_round`` is over (its evaluation included)."""

    def on_strategy_end(self) -> None:
        """The strategy's ``start`` returns."""

    def on_run_end(self, status: str, reason: str, files: Sequence[Path]) -> None:
        """The run ends with ``status`` (completed, failed, ...) and its files."""


class Observers(RunObserver):
    """Several observers as one: each event goes to each, in order."""

    def __init__(self, observers: Iterable[RunObserver] = ()) -> None:
        self.observers = list(observers)

    def add(self, observer: RunObserver, index: int | None = None) -> None:
        """``observer`` last, or at position ``index`` (it then sees each event before those after it)."""
        self.observers.insert(len(self.observers) if index is None else index, observer)

    def _emit(self, event: str, *args: Any) -> None:
        for observer in self.observers:
            getattr(observer, event)(*args)

    def on_run_start(self, info: Any) -> None:
        self._emit("on_run_start", info)

    def on_restore(self, rows: Sequence[Mapping[str, Any]]) -> None:
        self._emit("on_restore", rows)

    def on_strategy_start(self, strategy: Any) -> None:
        self._emit("on_strategy_start", strategy)

    def on_phase(self, server_round: int, phase: str, seconds: float) -> None:
        self._emit("on_phase", server_round, phase, seconds)

    def on_stage(self, server_round: int, updates: Sequence[Any], verdict: Any) -> None:
        self._emit("on_stage", server_round, updates, verdict)

    def on_aggregate(self, server_round: int, updates: Sequence[Any]) -> None:
        self._emit("on_aggregate", server_round, updates)

    def on_metrics(self, row: Mapping[str, Any]) -> None:
        self._emit("on_metrics", row)

    def on_round_end(self, server_round: int) -> None:
        self._emit("on_round_end", server_round)

    def on_strategy_end(self) -> None:
        self._emit("on_strategy_end")

    def on_run_end(self, status: str, reason: str, files: Sequence[Path]) -> None:
        self._emit("on_run_end", status, reason, files)

    @contextlib.contextmanager
    def phase(self, server_round: int, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` of ``server_round`` (:meth:`on_phase`), also when it raises."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.observers:
                self.on_phase(server_round, name, time.perf_counter() - start)
