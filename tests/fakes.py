"""An in-process Grid for strategy unit tests: every node is a Python function."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable

from flwr.app import ConfigRecord, Message, MessageType, RecordDict

# node function: (message, node_key) -> reply content (RecordDict) or an Exception to raise
NodeFn = Callable[[Message, str], RecordDict]


class FakeGrid:
    """Delivers messages to node functions; replies come back in shuffled order."""

    def __init__(
        self, node_fn: NodeFn, num_nodes: int, seed: int = 0, drop: Iterable[str] = (), examples: dict[str, int] | None = None
    ) -> None:
        self.node_fn = node_fn
        # node key -> training examples reported to a roster query that asks for them
        self.examples = examples or {}
        self.queries: list[Message] = []
        rng = random.Random(seed)
        # random node ids, like Flower's: the key is what identifies a node's data
        self.keys = {rng.getrandbits(63): f"partition:{i:09d}" for i in range(num_nodes)}
        self.drop = set(drop)  # node keys whose replies never come back (timeouts)
        self.sent: list[Message] = []
        self._ids = itertools.count()
        self._shuffle = random.Random(seed + 1)

    def get_node_ids(self) -> list[int]:
        return list(self.keys)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        """Deliver now; the replies wait for :meth:`pull_messages` (in shuffled order)."""
        messages = list(messages)
        self._waiting = getattr(self, "_waiting", []) + self.send_and_receive(messages)
        return [m.metadata.message_id for m in messages]

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        ids = set(message_ids)
        out = [r for r in self._waiting if r.metadata.reply_to_message_id in ids]
        self._waiting = [r for r in self._waiting if r.metadata.reply_to_message_id not in ids]
        return out

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        replies = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = f"msg-{next(self._ids)}"
            key = self.keys[msg.metadata.dst_node_id]
            if msg.metadata.message_type == MessageType.QUERY:
                self.queries.append(msg)
                roster = {"node-key": key}
                if "fedmm-roster-examples" in msg.content["config"] and key in self.examples:
                    roster["num-examples"] = self.examples[key]
                replies.append(Message(RecordDict({"r": ConfigRecord(roster)}), reply_to=msg))
                continue
            self.sent.append(msg)
            if key in self.drop:
                continue
            try:
                content = self.node_fn(msg, key)
            except Exception as err:  # a failing ClientApp becomes an error reply
                from flwr.app import Error

                replies.append(Message(Error(code=0, reason=str(err)), reply_to=msg))
                continue
            replies.append(Message(content, reply_to=msg))
        self._shuffle.shuffle(replies)
        return replies


def train_rounds(strategy, node, initial, rounds: int = 4) -> list:  # noqa: ANN001
    """The global arrays (float64) after each of ``rounds`` rounds, driving ``strategy`` through
    Flower's API (as Flower's own ``start`` does) over four nodes that answer with ``node``,
    from the model ``initial``."""
    import numpy as np

    from fedmm import protocol

    grid = FakeGrid(node, num_nodes=4)
    arrays = protocol.model_to_record(initial)
    out = []
    for server_round in range(1, rounds + 1):
        messages = list(strategy.configure_train(server_round, arrays, ConfigRecord({"x": 1}), grid))
        arrays, _ = strategy.aggregate_train(server_round, grid.send_and_receive(messages))
        out.append({n: np.asarray(a.numpy(), np.float64) for n, a in arrays.items()})
    return out
