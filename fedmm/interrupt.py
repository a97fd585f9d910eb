"""Clean stops: SIGINT (Ctrl-C) and SIGTERM end a run within seconds, with a checkpoint.

The entry point installs :func:`install_signal_handlers`; the first signal only sets
:data:`STOP`. The server's message loop (:class:`server_app.runner.CountingGrid`) and its waits
for nodes check it and raise ``KeyboardInterrupt`` in the ServerApp, whose runner then writes the
checkpoint of the last completed round and ``status: interrupted``; the simulation engine then
shuts Ray down and ``fedmm`` exits with status 130. A second signal stops at once.

:func:`abort` does the same for a simulation runtime that crashed (e.g. Ray could not place a
single ClientApp): the ServerApp stops at once with ``RunAborted`` and ``status: failed``,
instead of waiting for replies that cannot come.
"""

from __future__ import annotations

import signal
import sys
import threading

#: Set by the first SIGINT / SIGTERM, or by :func:`abort`.
STOP = threading.Event()
_ABORT_REASON: list[str] = []


class RunAborted(RuntimeError):
    """The run cannot go on: its simulation runtime stopped."""


def abort(reason: str) -> None:
    """Stop the ServerApp at once as failed, with ``reason``."""
    _ABORT_REASON.append(reason)
    STOP.set()


def _request_stop(signum: int, frame: object) -> None:
    if STOP.is_set():
        raise KeyboardInterrupt  # second signal: stop now
    STOP.set()
    name = signal.Signals(signum).name
    print(f"fedmm: {name} received: stopping after saving a checkpoint (send it again to stop at once)", file=sys.stderr, flush=True)


def install_signal_handlers() -> None:
    """Route SIGINT and SIGTERM to :data:`STOP` (main thread only; elsewhere nothing changes)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _request_stop)
        signal.signal(signal.SIGTERM, _request_stop)


def raise_if_stopped() -> None:
    """``KeyboardInterrupt`` once a stop was requested, ``RunAborted`` after :func:`abort`."""
    if STOP.is_set():
        if _ABORT_REASON:
            raise RunAborted(_ABORT_REASON[-1])
        raise KeyboardInterrupt("stop requested by a signal")


def reset() -> None:
    """Clear a stop (the next job of a sweep starts afresh)."""
    STOP.clear()
    _ABORT_REASON.clear()
