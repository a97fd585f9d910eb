"""The in-process engine (fedmm/local_engine.py) holds to Flower's semantics: node ids and node
config, one Context per node that persists (and is left as it was by a call that raises), message
ids, replies to their messages pulled once, TTLs, timeouts, a ClientApp's exception as its node's
error reply, mods on the call path; and it keeps the server's records and the clients' apart
(a ClientApp that writes into its received model leaves the server's unchanged)."""

from __future__ import annotations

import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid, ServerApp

from fedmm import local_engine, protocol
from fedmm.local_engine import LocalGrid, run_local_simulation

REPO = Path(__file__).resolve().parent.parent


def serve(main: Callable[[Grid], Any], client_app: ClientApp, nodes: int = 3) -> Any:
    """Run ``main(grid)`` as a ServerApp on the in-process engine; return what it returns."""
    out: dict[str, Any] = {}
    server = ServerApp()

    @server.main()
    def _main(grid: Grid, context: Context) -> None:
        out["result"] = main(grid)

    run_local_simulation(server_app=server, client_app=client_app, num_supernodes=nodes)
    return out["result"]


def train_message(node: int, arrays: ArrayRecord | None = None, ttl: float | None = None, **config: Any) -> Message:
    content = {"config": ConfigRecord(config)}
    if arrays is not None:
        content["arrays"] = arrays
    return Message(RecordDict(content), node, "train", ttl=ttl)


def model_record(n: int = 8) -> ArrayRecord:
    return ArrayRecord({"w": protocol.encode_array(np.arange(n, dtype=np.float32)),
                        "b": protocol.encode_array(np.ones(3, dtype=np.float32))})


def record_bytes(record: ArrayRecord) -> dict[str, bytes]:
    """A copy of each array's bytes (``bytes(b)`` would be ``b`` itself)."""
    return {key: memoryview(array.data).tobytes() for key, array in record.items()}


def test_nodes_have_flowers_node_config_and_one_context_each() -> None:
    app = ClientApp()

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"r": ConfigRecord({**context.node_config, "node": context.node_id,
                                                      "run": context.run_id})}), reply_to=msg)

    def main(grid: Grid) -> Any:
        nodes = list(grid.get_node_ids())
        replies = grid.send_and_receive([Message(RecordDict(), n, "query") for n in nodes], timeout=30)
        return nodes, grid.run.run_id, {r.metadata.src_node_id: dict(r.content["r"]) for r in replies}

    nodes, run_id, seen = serve(main, app, nodes=5)
    assert len(set(nodes)) == 5 and all(0 < n < 2**63 and n != 1 for n in nodes)
    assert [seen[n]["partition-id"] for n in nodes] == [0, 1, 2, 3, 4]
    assert {seen[n]["num-partitions"] for n in nodes} == {5}
    assert all(seen[n]["node"] == n and seen[n]["run"] == run_id for n in nodes)


def counting_app(fail_on: set[int]) -> ClientApp:
    """Adds 1 to the node's count in its state every call, then raises in the rounds ``fail_on``."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        record = context.state.config_records.get("count", ConfigRecord({"n": 0, "seen": []}))
        rnd = int(msg.content["config"]["round"])
        context.state["count"] = ConfigRecord({"n": int(record["n"]) + 1, "seen": [*record["seen"], rnd]})
        if rnd in fail_on:
            raise ValueError(f"broken in round {rnd}")
        return Message(RecordDict({"m": MetricRecord({"n": int(record["n"]) + 1})}), reply_to=msg)

    return app


def test_node_state_persists_across_rounds_and_a_call_that_raises_leaves_it_as_it_was() -> None:
    def main(grid: Grid) -> Any:
        node = list(grid.get_node_ids())[0]
        errors = []
        for rnd in range(1, 5):
            (reply,) = grid.send_and_receive([train_message(node, round=rnd)], timeout=30)
            errors.append(reply.error.code if reply.has_error() else None)
        return errors, dict(grid.context(node).state["count"])

    errors, state = serve(main, counting_app(fail_on={2}))
    assert errors == [None, ErrorCode.CLIENT_APP_RAISED_EXCEPTION, None, None]
    # round 2's call counted, then raised: as in Flower's engine, its change of the state is dropped
    assert state == {"n": 3, "seen": [1, 3, 4]}


def test_message_ids_replies_to_them_and_each_reply_pulled_once() -> None:
    def main(grid: Grid) -> Any:
        nodes = list(grid.get_node_ids())
        messages = [train_message(n, round=1) for n in nodes]
        ids = list(grid.push_messages(messages))
        assert [m.metadata.message_id for m in messages] == ids and len(set(ids)) == len(ids)
        got: list[Message] = []
        waiting, deadline = set(ids), time.time() + 30
        while waiting and time.time() < deadline:
            pulled = grid.pull_messages(waiting)
            got += pulled
            waiting -= {r.metadata.reply_to_message_id for r in pulled}
            time.sleep(0.01)
        again = grid.pull_messages(ids)  # each reply once; then the message is gone, as in Flower's link state
        unknown = grid.pull_messages(["no-such-id"])
        return nodes, ids, got, again, unknown

    nodes, ids, got, again, unknown = serve(main, counting_app(fail_on=set()))
    assert sorted(r.metadata.reply_to_message_id for r in got) == sorted(ids)
    assert {r.metadata.src_node_id for r in got} == set(nodes)
    assert all(r.metadata.dst_node_id == 1 and r.metadata.delivered_at and r.metadata.message_id for r in got)
    assert [r.error.code for r in again] == [ErrorCode.MESSAGE_UNAVAILABLE] * len(ids)
    assert unknown[0].error.code == ErrorCode.MESSAGE_UNAVAILABLE and unknown[0].metadata.reply_to_message_id == "no-such-id"


def slow_app(seconds: float, seen: list[int]) -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        seen.append(int(msg.content["config"]["round"]))
        time.sleep(seconds)
        return Message(RecordDict(), reply_to=msg)

    return app


def test_a_message_whose_ttl_runs_out_before_delivery_never_reaches_its_client() -> None:
    seen: list[int] = []

    def main(grid: Grid) -> Any:
        node = list(grid.get_node_ids())[0]
        slow = grid.push_messages([train_message(node, round=1)])  # occupies the one worker for 1 s
        short = grid.push_messages([train_message(node, ttl=0.3, round=2)])
        time.sleep(1.5)
        return grid.pull_messages(slow + short), slow, short

    replies, slow, short = serve(main, slow_app(1.0, seen))
    by_id = {r.metadata.reply_to_message_id: r for r in replies}
    assert not by_id[slow[0]].has_error()
    assert by_id[short[0]].error.code == ErrorCode.MESSAGE_UNAVAILABLE
    assert seen == [1]  # the expired message was never delivered


def test_send_and_receive_returns_what_came_in_before_its_timeout() -> None:
    def main(grid: Grid) -> Any:
        nodes = list(grid.get_node_ids())
        start = time.monotonic()
        replies = grid.send_and_receive([train_message(n, round=r) for r, n in enumerate(nodes)], timeout=1.2)
        return len(replies), time.monotonic() - start

    got, waited = serve(main, slow_app(0.5, []), nodes=4)
    assert 1 <= got <= 3 and 1.2 <= waited < 3.0  # one worker, 0.5 s each: not all four within 1.2 s


def test_a_clientapp_exception_is_its_nodes_error_reply_and_the_server_goes_on() -> None:
    def main(grid: Grid) -> Any:
        node = list(grid.get_node_ids())[0]
        (failed,) = grid.send_and_receive([train_message(node, round=2)], timeout=30)
        (fine,) = grid.send_and_receive([train_message(node, round=3)], timeout=30)
        return failed, fine

    failed, fine = serve(main, counting_app(fail_on={2}))
    assert failed.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert protocol.client_error(failed.error.reason) == "ValueError: broken in round 2"
    assert "Traceback" in failed.error.reason and "raise ValueError(f\"broken in round {rnd}\")" in failed.error.reason
    assert not fine.has_error()


def test_mods_run_on_flowers_call_path() -> None:
    calls: list[str] = []

    def mod(msg: Message, context: Context, call_next: Any) -> Message:
        calls.append(f"before {msg.metadata.message_type}")
        reply = call_next(msg, context)
        reply.content["mod"] = MetricRecord({"seen": 1})
        return reply

    app = ClientApp(mods=[mod])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        calls.append("train")
        return Message(RecordDict(), reply_to=msg)

    def main(grid: Grid) -> Any:
        node = list(grid.get_node_ids())[0]
        return grid.send_and_receive([train_message(node, round=1)], timeout=30)

    (reply,) = serve(main, app)
    assert calls == ["before train", "train"] and dict(reply.content["mod"]) == {"seen": 1}


def writing_app() -> ClientApp:
    """A ClientApp that changes its received model every way a ClientApp can: into the bytes
    (``torch.frombuffer``), the ``Array`` objects, the record; then echoes the content back."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        arrays = msg.content["arrays"]
        for key, array in list(arrays.items()):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch: "the given buffer is not writable"
                torch.frombuffer(array.data, dtype=torch.uint8)[-4:].fill_(255)  # the bytes, in place
            array.dtype = "float64"
        arrays["w"] = Array(np.zeros(2, dtype=np.float32))
        del arrays["b"]
        msg.content["config"]["round"] = -1
        return Message(msg.content, reply_to=msg)  # the received content itself as the reply

    return app


def run_writing_app() -> tuple[dict[str, bytes], dict[str, bytes], dict[str, str], Message]:
    def main(grid: Grid) -> Any:
        record = model_record()
        before = record_bytes(record)
        messages = [train_message(n, record, round=1) for n in grid.get_node_ids()]  # one record for all, as FedAvg
        config = messages[0].content["config"]
        replies = grid.send_and_receive(messages, timeout=30)
        return before, record_bytes(record), {k: a.dtype for k, a in record.items()}, (config, replies)

    before, after, dtypes, (config, replies) = serve(main, writing_app())
    return before, after, dtypes, (config, replies)


def test_a_client_writing_into_its_received_model_leaves_the_servers_unchanged() -> None:
    before, after, dtypes, (config, replies) = run_writing_app()
    assert after == before and set(after) == {"w", "b"}
    assert dtypes == {"w": "float32", "b": "float32"}
    assert config["round"] == 1
    assert not any(r.has_error() for r in replies)
    assert all(list(r.content["arrays"]) == ["w"] for r in replies)  # each client's own change came back


@pytest.mark.parametrize("shared", ["records", "bytes"])
def test_the_aliasing_check_fails_on_an_engine_that_shares_the_servers_records(shared: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted bugs: the engine hands the ClientApp the server's own records, or new records
    around the server's own bytes."""
    detached = local_engine.detached
    if shared == "records":
        monkeypatch.setattr(local_engine, "detached", lambda content, copy_bytes: content)
    else:
        monkeypatch.setattr(local_engine, "detached", lambda content, copy_bytes: detached(content, False))
    before, after, _, _ = run_writing_app()
    assert after != before


@pytest.mark.parametrize("handler", [None, "each alone"])
def test_the_grid_releases_each_delivered_message_once_its_reply_is_made(handler: str | None) -> None:
    """A round of K train messages, each with its own 1 MiB model, delivered one after another or
    handed to a batch handler that sends each back to the ClientApp ("each alone", as
    ``simulation.vectorize=auto`` on a CPU): while the last client trains, the grid holds the
    arrays of no message already answered (at most the one in hand and the client's copy), and
    neither does the server once it has pushed them."""
    import tracemalloc

    k, size = 8, 1 << 20
    seen: list[int] = []
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        seen.append(tracemalloc.get_traced_memory()[0])
        return Message(RecordDict({"metrics": MetricRecord({"n": 1})}), reply_to=msg)

    def main(grid: Grid) -> Any:
        nodes = list(grid.get_node_ids())
        tracemalloc.start()
        try:
            messages = [train_message(nodes[i], ArrayRecord({"w": protocol.encode_array(np.full(size // 4, i, np.float32))}),
                                      round=1) for i in range(k)]
            ids = grid.push_messages(messages)
            del messages
            replies = [m for m in grid.pull_messages(ids)]
            while len(replies) < k:
                replies += grid.pull_messages(set(ids) - {r.metadata.reply_to_message_id for r in replies})
        finally:
            tracemalloc.stop()
        return replies

    out: dict[str, Any] = {}
    server = ServerApp()

    @server.main()
    def _main(grid: Grid, context: Context) -> None:
        out["replies"] = main(grid)

    run_local_simulation(server_app=server, client_app=app, num_supernodes=k,
                         train_batch=None if handler is None else (lambda messages, contexts: None))
    assert len(out["replies"]) == k and not any(r.has_error() for r in out["replies"])
    # traced from the messages' making on: the K pushed records, released one by one as they are answered
    assert seen[0] >= (k - 1) * size
    assert seen[-1] < 3 * size, f"while the last client trains the grid holds {seen[-1] / size:.1f} MiB of arrays"


def test_consuming_a_reply_leaves_what_the_client_kept_of_it() -> None:
    """The server pops the arrays of a reply as it decodes it; a ClientApp that keeps the record
    it replied with in its state (as MOON keeps its model) still has all of it."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        record = model_record()
        context.state["mine"] = record
        return Message(RecordDict({"arrays": record}), reply_to=msg)

    def main(grid: Grid) -> Any:
        node = list(grid.get_node_ids())[0]
        (reply,) = grid.send_and_receive([train_message(node, round=1)], timeout=30)
        protocol.record_to_model(reply.content["arrays"], consume=True, copy=False)
        return list(reply.content["arrays"]), list(grid.context(node).state["mine"]), grid.state_bytes(), node

    emptied, kept, held, node = serve(main, app)
    assert emptied == [] and kept == ["w", "b"]
    # what each node keeps across rounds, for the memory bench: the one node that kept its record
    assert held == {node: model_record().count_bytes()}


def test_a_reply_that_is_not_a_reply_to_its_message_is_an_error_reply_naming_why() -> None:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        if int(msg.content["config"]["round"]) == 1:
            return Message(RecordDict(), msg.metadata.dst_node_id, "train")  # a new message, not a reply
        context.run_config["changed"] = 1
        return Message(RecordDict(), reply_to=msg)

    def main(grid: Grid) -> Any:
        node = list(grid.get_node_ids())[0]
        return [grid.send_and_receive([train_message(node, round=r)], timeout=30)[0] for r in (1, 2)]

    wrong, changed = serve(main, app)
    assert wrong.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert "invalid reply" in wrong.error.reason and "reply_to=message" in wrong.error.reason
    assert "`run_config` field of the `Context` object cannot be modified" in changed.error.reason


def test_the_clients_global_random_state_is_not_the_servers() -> None:
    """A ClientApp that seeds the global generators (as ours does before its batches) draws the
    same numbers every call, and the server's draws go on as if no client had run (as on Ray)."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        np.random.seed(7)
        torch.manual_seed(7)
        return Message(RecordDict({"m": MetricRecord({"np": float(np.random.rand()), "torch": float(torch.rand(1))})}),
                       reply_to=msg)

    def main(grid: Grid) -> Any:
        node = list(grid.get_node_ids())[0]
        np.random.seed(0)
        torch.manual_seed(0)
        server = []
        for _ in range(2):
            server.append((float(np.random.rand()), float(torch.rand(1))))
            grid.send_and_receive([train_message(node, round=1)], timeout=30)
        return server

    server = serve(main, app)
    np.random.seed(0)
    torch.manual_seed(0)
    assert server == [(float(np.random.rand()), float(torch.rand(1))) for _ in range(2)]


def test_pushes_are_checked_as_flowers_grid_checks_them(caplog: pytest.LogCaptureFixture) -> None:
    def main(grid: Grid) -> Any:
        node = list(grid.get_node_ids())[0]
        answered = Message(RecordDict(), node, "train")
        answered.metadata.__dict__["_message_id"] = "an-earlier-message"
        reply_like = Message(RecordDict(), reply_to=answered)
        with pytest.raises(ValueError, match="Invalid message"):
            grid.push_messages([reply_like])
        return grid.push_messages([train_message(12345, round=1)])

    assert serve(main, counting_app(set())) == []
    assert "destination node 12345 is not a node of this federation" in caplog.text


def test_a_local_simulation_imports_no_ray() -> None:
    code = (
        "import sys\n"
        "from tests.test_local_engine import serve, counting_app, train_message\n"
        "serve(lambda grid: grid.send_and_receive([train_message(n, round=1) for n in grid.get_node_ids()], timeout=30),"
        " counting_app(set()))\n"
        "print('ray' in sys.modules, 'flwr.simulation' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["False", "False"]


def test_the_unavailable_replies_are_flowers_own() -> None:
    """The engine's reply for an unknown or expired message, and for a reply that expired, has
    the metadata and error Flower's link state gives them (all but the fresh id and the time)."""
    from flwr.app.metadata import Metadata
    from flwr.server.superlink.linkstate.utils import (
        create_message_error_unavailable_ins_message,
        create_message_error_unavailable_res_message,
    )

    from fedmm.local_engine import _unavailable

    def fields(msg: Message) -> dict:
        m = msg.metadata
        return {"run_id": m.run_id, "src": m.src_node_id, "dst": m.dst_node_id, "reply_to": m.reply_to_message_id,
                "group": m.group_id, "type": m.message_type, "ttl": round(m.ttl), "code": msg.error.code,
                "reason": msg.error.reason, "src_task": m.src_task_id, "dst_task": m.dst_task_id}

    assert fields(_unavailable("abc", 7, None, False)) == fields(create_message_error_unavailable_ins_message("abc", 7))
    ins = Metadata(run_id=7, message_id="m1", src_node_id=1, dst_node_id=5, reply_to_message_id="", group_id="g",
                   created_at=time.time() - 10, ttl=100.0, message_type="train", src_task_id=3, dst_task_id=4)
    ours, theirs = _unavailable("m1", 7, ins, True), create_message_error_unavailable_res_message(ins, "msg_unavail")
    assert fields(ours) == fields(theirs) and ours.metadata.message_id


def test_error_replies_are_messages_of_their_own_and_say_what_raised() -> None:
    """Every error reply has an id of its own (the server tells replies apart by it), the
    exception's own line first, then its traceback; a changed run_config is Flower's UNKNOWN error."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        if int(msg.content["config"]["round"]) == 2:
            context.run_config["changed"] = 1
            return Message(RecordDict(), reply_to=msg)
        raise ValueError("broken here")

    def main(grid: Grid) -> Any:
        nodes = list(grid.get_node_ids())
        raised = grid.send_and_receive([train_message(n, round=1) for n in nodes], timeout=30)
        changed = grid.send_and_receive([train_message(nodes[0], round=2)], timeout=30)
        return raised, changed[0]

    raised, changed = serve(main, app)
    ids = [r.metadata.message_id for r in raised]
    assert len(set(ids)) == len(raised) == 3 and all(len(i) == 36 for i in ids)
    reason = raised[0].error.reason
    assert reason.startswith("<class 'flwr.") and "ValueError: broken here\n\nTraceback (most recent call last):" in reason
    assert changed.error.code == ErrorCode.UNKNOWN and changed.metadata.message_id not in ids


def test_an_invalid_push_is_left_out_and_the_valid_ones_after_it_are_queued(caplog: pytest.LogCaptureFixture) -> None:
    """A message to a node that is not in the federation, or with a TTL of 0, is refused (logged,
    no id), and the messages pushed with it still go."""
    def main(grid: Grid) -> Any:
        node = list(grid.get_node_ids())[0]
        zero = train_message(node, round=1)
        zero.metadata.ttl = 0.0
        with pytest.raises(ValueError, match="Invalid message"):
            grid.push_messages([zero])
        ids = grid.push_messages([train_message(12345, round=1), train_message(node, round=2)])
        return ids, grid.pull_messages(ids)

    ids, replies = serve(main, counting_app(set()))
    assert len(ids) == 1 and [r.metadata.reply_to_message_id for r in replies] == ids
    assert "destination node 12345" in caplog.text
