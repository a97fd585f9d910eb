"""Vectorized rounds on the in-process engine (``simulation.vectorize``): the grid hands the round's
queued train messages to the ClientApp's batch handler with Flower's per-message semantics; whole
FedMR and FedCross runs trained as one computation per round give the sequential runs' numbers
within the same-results tolerance; what does not vectorize is named once and trains one at a
time, or is refused with ``vectorize: on``; clients are chunked (by setting, and when CUDA runs out
of memory) and one client's failure stays its own."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid, ServerApp

import client_app.vectorized as vectorized
from fedmm.errors import ConfigError
from fedmm.local_engine import run_local_simulation
from fedmm.results import read_metrics
from tests.conftest import composed
from tests.test_same_results import assert_same_results

#: A FedMR / FedCross run small enough for a test (lenet); ``ON`` trains its rounds together on the CPU.
SMALL = ("model=lenet", "num_rounds=2", "num_clients=6", "clients_per_round=3", "training.local_epochs=1", "seed=3")
ON = "simulation.vectorize=on"


# ------------------------------------------------------------------ the grid's side
def counting_app(app_mods: list | None = None, train_mods: list | None = None) -> ClientApp:
    app = ClientApp(mods=app_mods)

    @app.train(mods=train_mods)
    def train(msg: Message, context: Context) -> Message:
        n = int(context.state.config_records.get("count", ConfigRecord({"n": 0}))["n"]) + 1
        context.state["count"] = ConfigRecord({"n": n})
        return Message(RecordDict({"m": MetricRecord({"n": n, "alone": 1})}), reply_to=msg)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"m": MetricRecord({"query": 1})}), reply_to=msg)

    return app


def serve(main: Any, train_batch: Any, nodes: int = 4, app: ClientApp | None = None) -> Any:
    out: dict[str, Any] = {}
    server = ServerApp()

    @server.main()
    def _main(grid: Grid, context: Context) -> None:
        out["result"] = main(grid)

    run_local_simulation(server_app=server, client_app=app or counting_app(), num_supernodes=nodes, train_batch=train_batch)
    return out["result"]


@pytest.mark.parametrize("where", ["app", "train handler"])
def test_a_clientapp_with_mods_is_never_batched_its_mods_see_every_train_message(where: str) -> None:
    """A ClientApp whose train messages pass through mods (Flower's clipping or local-DP mods,
    say) is delivered one message at a time through ``ClientApp.__call__``: the batch handler,
    which would skip the mods, is not called."""
    seen: list[str] = []

    def mod(msg: Message, context: Context, call_next: Any) -> Message:
        seen.append(msg.metadata.message_type)
        return call_next(msg, context)

    batched: list[int] = []

    def train_batch(messages: list[Message], contexts: list[Context]) -> list[Any] | None:
        batched.append(len(messages))
        return [Message(RecordDict({"m": MetricRecord({"together": 1})}), reply_to=m) for m in messages]

    def main(grid: Grid) -> Any:
        nodes = list(grid.get_node_ids())
        msgs = [Message(RecordDict({"config": ConfigRecord({})}), node, "train") for node in nodes[:3]]
        return grid.send_and_receive(msgs, timeout=30)

    app = counting_app(app_mods=[mod]) if where == "app" else counting_app(train_mods=[mod])
    replies = serve(main, train_batch, app=app)
    assert batched == [] and seen == ["train"] * 3
    assert all(dict(r.content["m"]) == {"n": 1, "alone": 1} for r in replies)


def test_the_grid_hands_queued_train_messages_over_together_with_flowers_semantics() -> None:
    calls: list[int] = []

    def train_batch(messages: list[Message], contexts: list[Context]) -> list[Any] | None:
        calls.append(len(messages))
        if len(calls) == 2:
            return None  # "one at a time": each goes through the ClientApp
        out: list[Any] = []
        for index, (msg, context) in enumerate(zip(messages, contexts)):
            n = int(context.state.config_records.get("count", ConfigRecord({"n": 0}))["n"]) + 1
            context.state["count"] = ConfigRecord({"n": n})
            if index == 1 and len(calls) == 1:
                out.append(ValueError("this client's data is broken"))
            elif index == 0 and len(calls) == 3:
                out.append(None)  # this one alone, through the ClientApp
            else:
                out.append(Message(RecordDict({"m": MetricRecord({"n": n, "together": 1})}), reply_to=msg))
        return out

    def main(grid: Grid) -> Any:
        nodes = list(grid.get_node_ids())
        rounds = []
        for _ in range(3):
            msgs = [Message(RecordDict({"config": ConfigRecord({})}), node, "train") for node in nodes[:3]]
            msgs.append(Message(RecordDict({"config": ConfigRecord({})}), nodes[3], "query"))
            rounds.append(grid.send_and_receive(msgs, timeout=30))
        return nodes, rounds, [int(grid.context(n).state["count"]["n"]) for n in nodes[:3]]

    nodes, rounds, counts = serve(main, train_batch)
    assert calls == [3, 3, 3]  # the three train messages of each round, never the query
    first = {r.metadata.src_node_id: r for r in rounds[0]}
    assert first[nodes[1]].error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert "this client's data is broken" in first[nodes[1]].error.reason
    assert dict(first[nodes[0]].content["m"]) == {"n": 1, "together": 1}
    assert dict(first[nodes[3]].content["m"]) == {"query": 1}
    second = {r.metadata.src_node_id: r for r in rounds[1]}
    assert dict(second[nodes[0]].content["m"]) == {"n": 2, "alone": 1}  # None: through the ClientApp
    third = {r.metadata.src_node_id: r for r in rounds[2]}
    assert dict(third[nodes[0]].content["m"]) == {"n": 3, "alone": 1}
    assert dict(third[nodes[1]].content["m"]) == {"n": 2, "together": 1}
    # the failed call's change of its node's state is dropped, as for one ClientApp call that raises
    assert counts == [3, 2, 3]
    for replies in rounds:
        assert all(r.metadata.reply_to_message_id for r in replies) and len(replies) == 4


# ------------------------------------------------------------------ whole runs
def run(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    from fedmm.config import to_container
    from launch.cli import run_job

    return read_metrics(run_job(to_container(composed(*SMALL, *overrides, f"output_dir={tmp_path / name}"))))


@pytest.mark.parametrize("strategy", ["fedmr", "fedcross"])
def test_a_whole_run_trained_as_one_computation_per_round_gives_the_sequential_numbers(
        strategy: str, tmp_path: Path, stacked_calls: list[int]) -> None:
    one_at_a_time = run(tmp_path, "off", f"strategy={strategy}", "simulation.vectorize=off")
    assert stacked_calls == []
    together = run(tmp_path, "on", f"strategy={strategy}", ON)
    assert stacked_calls == [3, 3]  # each round's K = 3 clients in one computation
    assert_same_results(together, one_at_a_time)


def test_asynchronous_fedmr_on_the_virtual_clock_trains_its_queued_jobs_together(tmp_path: Path, stacked_calls: list[int]) -> None:
    """The asynchronous loop keeps K jobs in flight and pushes one after each reply: the queued
    jobs (each of its own round of the model it trains) train together by round, the rest alone;
    the virtual clock decides what is aggregated, so the numbers are those of one at a time."""
    settings = ("strategy=fedmr_async", "strategy.asynchronous.buffer_size=2", "strategy.heterogeneity.profile=tiers",
                "strategy.heterogeneity.tiers=[[0.25,10.0]]", "num_rounds=3")
    one_at_a_time = run(tmp_path, "off", *settings, "simulation.vectorize=off")
    together = run(tmp_path, "on", *settings, ON)
    assert stacked_calls and max(stacked_calls) >= 2
    # not compared: the bytes of the replies pulled by the time a row is written (arrival order,
    # as tests/test_engines.py says); the virtual clock decides what each round aggregates
    arrival = lambda rows: [{k: v for k, v in row.items() if k != "bytes_received"} for row in rows]  # noqa: E731
    assert_same_results(arrival(together), arrival(one_at_a_time))


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def flwr_log() -> Any:
    handler = Lines()
    logger = logging.getLogger("flwr")
    logger.addHandler(handler)
    vectorized._told.clear()
    yield handler.lines
    logger.removeHandler(handler)


def test_an_objective_that_does_not_vectorize_trains_one_at_a_time_named_once(
        tmp_path: Path, stacked_calls: list[int], flwr_log: list[str]) -> None:
    run(tmp_path, "moon", "strategy=fedavg", "objective=moon")
    assert stacked_calls == []
    named = [line for line in flwr_log if "Vectorized rounds" in line]
    assert len(named) == 1 and "objective.name='moon' trains one client at a time" in named[0], named


def test_auto_trains_one_at_a_time_on_the_cpu_named_once(tmp_path: Path, stacked_calls: list[int],
                                                          flwr_log: list[str]) -> None:
    run(tmp_path, "auto", "simulation.vectorize=auto")
    assert stacked_calls == []
    named = [line for line in flwr_log if "Vectorized rounds" in line]
    assert len(named) == 1 and "vectorize=auto on cpu: one client at a time" in named[0], named


@pytest.mark.parametrize(("overrides", "named"), [
    (("objective=moon",), "objective.name='moon'"),
    (("objective=sam",), "objective.name='asam'"),
    (("dataset=shakespeare", "model=char_lstm"), "model.name='char_lstm'"),
    (("simulation.engine=ray",), "on the ray engine"),
])
def test_vectorize_on_refuses_what_cannot_vectorize(overrides: tuple[str, ...], named: str) -> None:
    with pytest.raises(ConfigError, match="simulation.vectorize") as err:
        composed("simulation.vectorize=on", *overrides)
    assert named in str(err.value)


def test_a_chunk_size_without_vectorized_rounds_is_refused() -> None:
    with pytest.raises(ConfigError, match="simulation.vectorize_clients=2 is invalid; allowed: null with simulation.vectorize=off"):
        composed("simulation.vectorize=off", "simulation.vectorize_clients=2")
    with pytest.raises(ConfigError, match="simulation.vectorize_clients=2 is invalid; allowed: null on the ray engine"):
        composed("simulation.engine=ray", "simulation.vectorize_clients=2")


def test_clients_are_chunked_by_setting_and_when_cuda_runs_out_of_memory(
        tmp_path: Path, stacked_calls: list[int], monkeypatch: pytest.MonkeyPatch, flwr_log: list[str]) -> None:
    whole = run(tmp_path, "whole", "strategy=fedmr", ON)
    assert stacked_calls == [3, 3]
    stacked_calls.clear()
    chunked = run(tmp_path, "chunked", "strategy=fedmr", ON, "simulation.vectorize_clients=2")
    assert stacked_calls == [2, 1, 2, 1]
    assert_same_results(chunked, whole)

    counted = vectorized.train_stacked

    def small_device(model, states, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        if len(states) > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return counted(model, states, *args, **kwargs)

    monkeypatch.setattr(vectorized, "train_stacked", small_device)
    vectorized._fitted.clear()
    stacked_calls.clear()
    halved = run(tmp_path, "halved", "strategy=fedmr", "seed=4", ON)
    assert stacked_calls == [1] * 6  # 3 fails, 1 fits; then 1 from the start
    assert any("CUDA out of memory with 3 clients in one computation; 1 from now on" in line for line in flwr_log)
    monkeypatch.setattr(vectorized, "train_stacked", counted)
    assert_same_results(halved, run(tmp_path, "halved_off", "strategy=fedmr", "seed=4", "simulation.vectorize=off"))


def test_one_clients_failure_is_its_own_as_on_the_sequential_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  stacked_calls: list[int]) -> None:
    from client_app import work
    from client_app.node_data import NodeDataError

    real = work.local_data

    def broken_node(run_settings, context, part="train"):  # noqa: ANN001
        if int(context.node_config["partition-id"]) in (0, 2, 4):
            raise NodeDataError(f"node {context.node_id}: its data is unreadable")
        return real(run_settings, context, part)

    monkeypatch.setattr(work, "local_data", broken_node)
    together = run(tmp_path, "on", "strategy=fedavg", "num_rounds=3", ON)
    alone = run(tmp_path, "off", "strategy=fedavg", "num_rounds=3", "simulation.vectorize=off")
    assert [r.get("replies") for r in together] == [r.get("replies") for r in alone]
    assert any(r.get("replies", 3) < 3 for r in together)  # some sampled node failed
    assert_same_results(together, alone)


def test_an_expired_train_message_never_reaches_the_batch_and_is_an_unavailable_reply() -> None:
    """The batched path keeps Flower's TTL: a train message whose TTL ran out before delivery is
    taken out of the batch and answered with MESSAGE_UNAVAILABLE; the others train together."""
    import time

    batched: list[int] = []

    def train_batch(messages: list[Message], contexts: list[Context]) -> list[Any] | None:
        batched.append(len(messages))
        return [Message(RecordDict({"m": MetricRecord({"together": 1})}), reply_to=m) for m in messages]

    def main(grid: Grid) -> Any:
        nodes = list(grid.get_node_ids())
        msgs = [Message(RecordDict({"config": ConfigRecord({})}), node, "train") for node in nodes[:3]]
        msgs[1].metadata.ttl = 0.2
        ids = grid.push_messages(msgs)
        time.sleep(0.4)
        replies = grid.pull_messages(ids)
        rest = set(ids) - {r.metadata.reply_to_message_id for r in replies}
        return ids, replies + (grid.pull_messages(rest) if rest else [])

    ids, replies = serve(main, train_batch)
    by_id = {r.metadata.reply_to_message_id: r for r in replies}
    assert batched == [2]
    assert by_id[ids[1]].error.code == ErrorCode.MESSAGE_UNAVAILABLE
    assert dict(by_id[ids[0]].content["m"]) == {"together": 1} and dict(by_id[ids[2]].content["m"]) == {"together": 1}


def test_a_message_the_batch_hands_back_goes_through_the_clientapp_on_its_own_copy() -> None:
    """A train message the batch handler leaves to the ClientApp (None) is delivered with its own
    copy of the bytes: the ClientApp writing into its received model leaves the server's unchanged."""
    import numpy as np
    from flwr.app import ArrayRecord

    from fedmm import protocol

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        import warnings

        for array in msg.content["arrays"].values():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch: "the given buffer is not writable"
                torch.frombuffer(array.data, dtype=torch.uint8)[-4:].fill_(255)  # the bytes, in place
        return Message(RecordDict({"m": MetricRecord({"alone": 1})}), reply_to=msg)

    def train_batch(messages: list[Message], contexts: list[Context]) -> list[Any] | None:
        return [None] * len(messages)  # every message one at a time, through the ClientApp

    record = ArrayRecord({"w": protocol.encode_array(np.arange(4, dtype=np.float32))})
    before = memoryview(record["w"].data).tobytes()

    def main(grid: Grid) -> Any:
        nodes = list(grid.get_node_ids())
        msgs = [Message(RecordDict({"config": ConfigRecord({}), "arrays": record}), node, "train") for node in nodes[:2]]
        return grid.send_and_receive(msgs, timeout=30)

    replies = serve(main, train_batch, app=app)
    assert all(dict(r.content["m"]) == {"alone": 1} for r in replies)
    assert memoryview(record["w"].data).tobytes() == before
