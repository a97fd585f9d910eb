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
    return real.secure.handle(msg, context, real.secure_train)


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


class _Draws:
    """Stands in for :mod:`secrets` in :mod:`fedmm.secure`: the layer draws of one message,
    from a seed of the message's place in the protocol (not from the OS)."""

    def __init__(self, seed: int) -> None:
        import random

        self._random = random.Random(seed)

    def randbits(self, k: int) -> int:
        return self._random.getrandbits(k)


def engines_client_app() -> ClientApp:
    """The ClientApp that both engines run in tests/test_engines.py: bench/faults.py's (the real
    ClientApp, with the fault the experiment's folder names injected: a hostile node), and
    secure recombination's random layer choices drawn from a seed of (partition, round, message
    type, exchange, attempt, repetition), so that the same run is the same on both engines (the
    real ClientApp draws them from the OS, as the protocol requires)."""
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parent.parent / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import faults

    from fedmm import protocol, secure_protocol

    app = faults.faulty_client_app()

    def seeded(msg: Message, context: Context) -> Message:
        from fedmm import secure as library

        s = msg.content[secure_protocol.SECURE]
        place = (int(context.node_config["partition-id"]), protocol.server_round(msg), msg.metadata.message_type,
                 str(s.get(secure_protocol.SECURE_EXCHANGE, "")), int(s.get(secure_protocol.SECURE_ATTEMPT, 0)),
                 int(s.get(secure_protocol.SECURE_REP, 0)))
        saved, library.secrets = library.secrets, _Draws(int.from_bytes(hashlib.sha256(repr(place).encode()).digest()[:8], "big"))
        try:
            return real.secure.handle(msg, context, real.secure_train)
        finally:
            library.secrets = saved

    for action in ("secure_keys", "secure_send", "secure_return", "secure_upload"):
        app.train(action)(seeded)
    return app


def node_ids_by_partition(grid: Grid, nodes: int) -> list[int]:
    """The node ids of a federation of ``nodes`` nodes in partition order, asked of the nodes (a
    roster query) once all of them are connected."""
    from flwr.app import ConfigRecord, RecordDict

    from fedmm import protocol
    from server_app.runner import federation_size

    assert federation_size(grid, expected=nodes) == nodes

    queries = [Message(RecordDict({protocol.CONFIG: ConfigRecord({protocol.ROSTER_QUERY: 1})}), n, MessageType.QUERY)
               for n in grid.get_node_ids()]
    replies = grid.send_and_receive(queries, timeout=300)
    keyed = {str(r.content[protocol.ROSTER][protocol.NODE_KEY]): r.metadata.src_node_id for r in replies}
    return [keyed[key] for key in sorted(keyed)]
