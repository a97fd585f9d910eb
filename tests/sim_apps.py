"""Apps for the simulation tests: a ClientApp whose partition 0 always fails, and a
ServerApp factory that records every train message it sends."""

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

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        for m in messages:
            if m.metadata.message_type == MessageType.TRAIN:
                self.log.append((int(m.content["config"]["server-round"]), m.metadata.dst_node_id, arrays_digest(m)))
        return self._grid.send_and_receive(messages, timeout=timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


def recording_server_app(cfg: dict, log: list, out: dict) -> ServerApp:
    from server_app.runner import run_experiment

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        out["dir"] = run_experiment(RecordingGrid(grid, log), cfg)

    return app
