"""Client selectors: which nodes take part in a round.

A selector is pluggable (:class:`ClientSelector`); the default, :class:`SeededRosterSelector`,
gives the same clients for the same seed on every run although Flower assigns random node ids.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from logging import INFO, WARNING
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord
from flwr.serverapp import Grid
from flwr.supercore import log

from fedmm import protocol
from fedmm.interrupt import raise_if_stopped
from fedmm.protocol import ClientUpdate, ModelDict
from fedmm.settings import Settings


class NotEnoughNodes(RuntimeError):
    """Fewer nodes than a round needs connected within the deadline."""


class ClientSelector(ABC):
    """Chooses the nodes of a round.

    ``stream`` separates independent draws of the same round (0: training, 1: evaluation).
    A selector may also see every round's accepted updates (:meth:`observe`) and decide the
    aggregation weights of a one-model method (:meth:`aggregation_weights`).
    """

    #: Numbers about the latest training draw, written into the round's row of ``metrics.jsonl``.
    round_info: dict[str, float] = {}
    #: How many nodes were connected at the last selection (None: not known).
    last_connected: int | None = None

    @abstractmethod
    def select(self, grid: Grid, server_round: int, count: int, stream: int = 0) -> list[int]:
        """``count`` distinct node ids, in the order their slots are filled."""

    def prepare(self, server_round: int, arrays: ArrayRecord) -> None:
        """Called before a round's training draw with the global model the round starts from (a
        selector that asks the nodes about that model: Power-of-Choice). Default: nothing."""

    def node_key(self, node_id: int) -> str:
        """A name of the node that stays the same across runs where the selector knows one
        (default: its node id)."""
        return f"node:{node_id:020d}"

    def ordered_nodes(self, grid: Grid, minimum: int) -> list[int]:
        """The connected node ids ordered by their stable keys (default: by :meth:`node_key`,
        without waiting for ``minimum`` nodes)."""
        return sorted(grid.get_node_ids(), key=lambda n: (self.node_key(n), n))

    def num_examples(self, node_id: int) -> int | None:
        """The node's number of training examples where the selector knows it (default: None)."""
        return None

    def roster_keys(self) -> list[str]:
        """The stable keys of every node ordered so far (default: none kept)."""
        return []

    def observe(self, server_round: int, updates: Sequence[ClientUpdate], sent: Sequence[ModelDict]) -> None:
        """Called with the round's accepted updates and the model each was sent, before the
        method aggregates. Default: nothing."""

    def aggregation_weights(self, updates: Sequence[ClientUpdate]) -> list[float] | None:
        """Weights of the updates in a one-model method's mean, or None: the method's own
        (``num-examples``). Default: None."""
        return None

    def describe(self) -> str:
        """One line for the strategy's summary."""
        return type(self).__name__

    def state_dict(self) -> dict[str, Any]:
        """What the selector must carry across a resume (nothing for a stateless one)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""

    def snapshot(self) -> Any:
        """What :meth:`restore` needs to undo one round's :meth:`observe` (a rolled-back round:
        strategies/stages.py). Default: :meth:`state_dict`."""
        return self.state_dict()

    def restore(self, saved: Any) -> None:
        """Undo the observations since :meth:`snapshot`."""
        self.load_state_dict(saved)


class SeededRosterSelector(ClientSelector):
    """Seeded sampling over the nodes ordered by a stable key.

    Flower assigns random node ids, so sampling from ``grid.get_node_ids()`` directly would pick
    different partitions on every run. The selector first asks every new node for its stable key
    (its partition id in simulation, its data path in deployment) with a QUERY message, orders
    the nodes by that key and samples with ``rng(seed, round[, stream])``: no state to save.

    The roster query is an optional capability of the ClientApp, sent only when ``query`` is on
    (the ``fedmm`` app turns it on; a strategy created in another Flower app sends none, since a
    plain Flower ClientApp has no query handler and would log an error per node): without it, or
    for a node that does not answer it, nodes are ordered by their node id, which is
    reproducible only as far as the node ids are.
    """

    def __init__(
        self,
        seed: int,
        timeout: float = 120.0,
        chunk: int = 100,
        min_nodes_timeout: float | None = None,
        query_config: Mapping[str, Any] | None = None,
        query: bool = True,
    ) -> None:
        self.seed = seed
        #: Ask new nodes for their stable key (and size) with a QUERY message.
        self.query = query
        self.timeout = timeout
        self.chunk = chunk
        #: Seconds to wait for enough nodes to connect (None: forever).
        self.min_nodes_timeout = min_nodes_timeout
        #: Further entries of the roster query: with the run config and ``ROSTER_EXAMPLES`` a
        #: fedmm ClientApp also reports its number of training examples.
        self.query_config = dict(query_config or {})
        self._keys: dict[int, str] = {}
        self._examples: dict[int, int] = {}

    def ordered_nodes(self, grid: Grid, minimum: int) -> list[int]:
        """Connected node ids ordered by their stable key; waits until ``minimum`` are connected
        (at most ``min_nodes_timeout`` seconds, then :class:`NotEnoughNodes`)."""
        start = time.monotonic()
        last_log = -10.0
        while len(node_ids := sorted(grid.get_node_ids())) < minimum:
            raise_if_stopped()
            waited = time.monotonic() - start
            if self.min_nodes_timeout is not None and waited >= self.min_nodes_timeout:
                raise NotEnoughNodes(
                    f"only {len(node_ids)} node(s) connected within min_nodes_timeout={self.min_nodes_timeout:g}s; "
                    f"this round needs {minimum} (clients_per_round): start more SuperNodes or lower clients_per_round"
                )
            if waited - last_log >= 10:
                log(INFO, "Waiting for nodes: %d connected, %d required.", len(node_ids), minimum)
                last_log = waited
            time.sleep(0.5)
        self.last_connected = len(node_ids)
        unknown = [n for n in node_ids if n not in self._keys]
        if unknown:
            self._keys.update(self.query_keys(grid, unknown))
        return sorted(node_ids, key=lambda n: (self._keys[n], n))

    def query_keys(self, grid: Grid, node_ids: list[int]) -> dict[int, str]:
        """Node id -> stable key of ``node_ids``: the roster query's answers (sent in chunks of
        ``chunk``), ``~node:<id>`` for a node that gives none or when ``query`` is off."""
        keys = {node_id: f"~node:{node_id:020d}" for node_id in node_ids}
        if not self.query:
            if not self._keys:
                log(INFO, "Sampling nodes ordered by node id (no roster query: reproducible as far as the node ids are)")
            return keys
        # In chunks: Flower's in-memory message store scans every pending message for every
        # node, so N messages in flight cost N² (1,000 clients: seconds per poll).
        unanswered: list[str] = []
        for start in range(0, len(node_ids), self.chunk):
            answered, errors = self._query_chunk(grid, node_ids[start : start + self.chunk])
            keys.update(answered)
            unanswered += errors
        if unanswered:
            log(
                WARNING,
                "%d node(s) did not report a stable key (ordered by node id instead), e.g. %s",
                len(unanswered),
                unanswered[0],
            )
        return keys

    def _query_chunk(self, grid: Grid, node_ids: list[int]) -> tuple[dict[int, str], list[str]]:
        messages = [
            protocol.server_message(protocol.QUERY, node_id, {protocol.ROSTER_QUERY: 1, **self.query_config})
            for node_id in node_ids
        ]
        keys: dict[int, str] = {}
        errors: list[str] = []
        for reply in grid.send_and_receive(messages, timeout=self.timeout):
            if reply.has_error():
                errors.append(f"node {reply.metadata.src_node_id}: {protocol.printable(protocol.client_error(reply.error.reason))}")
                continue
            node = reply.metadata.src_node_id
            key, examples, reason = protocol.read_roster(reply)
            if reason:  # a malformed roster reply: the node keeps its id order, the round goes on
                errors.append(f"node {node}: {reason}")
            if key is not None:
                keys[node] = key
            if examples is not None:
                self._examples[node] = examples
        return keys, errors

    def num_examples(self, node_id: int) -> int | None:
        """The node's number of training examples, where it reported one in the roster query."""
        return self._examples.get(node_id)

    def roster_keys(self) -> list[str]:
        """The stable keys of every node ordered so far (the roster the virtual clock's exact
        shares are taken over: :mod:`strategies.heterogeneity`)."""
        return sorted(self._keys.values())

    def all_num_examples(self) -> dict[int, int]:
        """Node id -> training examples, of every node that reported its size."""
        return dict(self._examples)

    def node_key(self, node_id: int) -> str:
        """The node's stable key from the roster query (its partition id or data path)."""
        return self._keys.get(node_id) or super().node_key(node_id)

    def select(self, grid: Grid, server_round: int, count: int, stream: int = 0) -> list[int]:
        """``count`` distinct nodes drawn with ``rng(seed, server_round[, stream])``, in random order."""
        nodes = self.ordered_nodes(grid, count)
        rng = np.random.default_rng([self.seed, server_round] + ([stream] if stream else []))
        return [nodes[i] for i in rng.choice(len(nodes), size=count, replace=False)]


@dataclass
class UniformSettings(Settings):
    """Uniform sampling: K distinct clients per round, drawn with rng(seed, round) over the
    clients ordered by their stable keys (the same clients for the same seed on every run)."""

    group = "selection"
    option = "uniform"

    def build(self, run: Any) -> ClientSelector | None:
        """The selector of a run (None: the strategy's default, :class:`SeededRosterSelector`)."""
        return None
