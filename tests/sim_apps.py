"""Apps for the simulation tests: a ClientApp whose partition 0 always fails, and a
ServerApp factory that records every train message it sends (as pushed to the grid)."""

from __future__ import annotations

import hashlib
from typing import Any

from flwr.app import Context, Message, MessageType
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from client_app import client_app as real

failing_client_app = ClientApp()


@failing_client_app.train()
def train(msg: Message, context: Context) -> Message:
    if int(context.node_config["partition-id"]) == 0:
        raise RuntimeError("injected failure on partition 0")
    return real.train(msg, context)


@failing_client_app.query()
def query(msg: Message, context: Context) -> Message:
    return real.query(msg, context)


def _secure(msg: Message, context: Context) -> Message:
    # secure recombination: partition 0 takes the key setup, then fails in stage 1 (its exchange
    # partners must roll back and go on without it)
    if int(context.node_config["partition-id"]) == 0 and msg.metadata.message_type.endswith("secure_send"):
        raise RuntimeError("injected failure on partition 0")
    return real.secure.handle(msg, context, real._secure_train)


for _action in ("secure_keys", "secure_send", "secure_return", "secure_upload"):
    failing_client_app.train(_action)(_secure)


def arrays_digest(msg: Message) -> str:
    h = hashlib.sha1()
    for key, arr in msg.content["arrays"].items():
        h.update(key.encode())
        h.update(arr.data)
    return h.hexdigest()


class RecordingGrid:
    """Grid proxy that notes (round, destination, digest of the arrays) of every train message."""

    def __init__(self, grid: Grid, log: list[tuple[int, int, str]]) -> None:
        self._grid, self.log = grid, log

    def push_messages(self, messages):
        messages = list(messages)
        for m in messages:
            if m.metadata.message_type == MessageType.TRAIN:
                self.log.append((int(m.content["config"]["server-round"]), m.metadata.dst_node_id, arrays_digest(m)))
        return self._grid.push_messages(messages)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


def recording_server_app(cfg: dict | list[dict], log: list, out: dict) -> ServerApp:
    """A ServerApp that runs one experiment, or several one after the other (``out["dirs"]``),
    on one simulation, logging every train message."""
    from server_app.runner import run_experiment

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        for one in cfg if isinstance(cfg, list) else [cfg]:
            out.setdefault("dirs", []).append(run_experiment(RecordingGrid(grid, log), one))
            out["dir"] = out["dirs"][-1]

    return app
