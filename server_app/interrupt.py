"""Clean stops: SIGINT (Ctrl-C) and SIGTERM end a run within seconds, with a checkpoint.

The entry point installs :func:`install_signal_handlers`; the first signal only sets
:data:`STOP`. The server's message loop (:class:`server_app.runner.CountingGrid`) checks it
between polls and raises ``KeyboardInterrupt`` in the ServerApp, whose runner then writes the
checkpoint of the last completed round and ``status: interrupted``; the simulation engine then
shuts Ray down and ``fedmm`` exits with status 130. A second signal stops at once.
"""

from __future__ import annotations

import signal
import sys
import threading

#: Set by the first SIGINT / SIGTERM.
STOP = threading.Event()


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
    """``KeyboardInterrupt`` once a stop was requested."""
    if STOP.is_set():
        raise KeyboardInterrupt("stop requested by a signal")
