"""Clustered sampling ("CluSamp", Fraboni et al., ICML 2021) as a client selector.

Usable with any one-model method (FedAvg, FedProx, FedRL's objective, FedExP): choose it with
``selection=clustered`` (or the presets ``strategy=clusamp`` / ``strategy=clusamp_fedmr_repo``,
FedAvg with this selector). The kernels are in :mod:`strategies.clustering`.

Each round the selector builds K distributions over the N clients and draws one client from
each (K = ``clients_per_round``), then tells the method how to weigh the replies
(:meth:`ClusteredSelector.aggregation_weights`). Client i's weight p_i is its share of the
training examples, which every node reports in its answer to the roster query before round 1.

Modes
-----
``faithful`` (as Fraboni et al.'s code)
    the N×N distance matrix between the clients' representative gradients (what each returned
    the last time it trained, minus the model it was sent; trainable parameters only, zeros
    before it first trains) is up to date every round: the rows and columns of the clients
    that trained are recomputed, which gives exactly the full recomputation of the original;
    aggregation weight 1/K per draw.
``fedmr_port`` (as the FedMR authors' port)
    the matrix starts as zeros and after each round only the entries (i, last drawn client) of
    the drawn clients are recomputed, one direction (their update, code-faithful: the
    clustering barely sees the gradients); aggregation weights n_i (sample sizes), which count
    p_i a second time after the sampling already favoured large clients.

``distance`` (``arccos`` / ``L1`` / ``L2``) and ``linkage_input`` (``rows``: the square matrix's
rows as observations, what both codes do; ``condensed``: the distances themselves) are free in
both modes; ``algorithm: 1`` (sample sizes only) needs no gradients.

A client drawn by several distributions in one round gets one train message (a node runs one
training per round) and its update counts once per draw: weight (draws)/K in ``faithful``,
n_i·(draws) in ``fedmr_port``. Its expected aggregation weight stays p_i (the sampling stays
unbiased); the original instead trains it twice, independently, which Flower cannot do on one
node in one round. When a drawn client fails, the weights of the replies that came are
renormalised to sum to 1.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from logging import INFO
from typing import Any

import numpy as np
from flwr.serverapp import Grid
from flwr.supercore import log

from fedmm import protocol
from fedmm.errors import ConfigError
from fedmm.protocol import ClientUpdate, ModelDict
from fedmm.settings import Choice, setting
from strategies import clustering
from strategies.extrapolation import is_buffer
from strategies.selection import SeededRosterSelector, UniformSettings

#: ``selection.mode``: the original's rules, or the FedMR authors' port's.
MODES = ("faithful", "fedmr_port")


@dataclass
class ClusteredSettings(UniformSettings):
    """Clustered sampling (Fraboni et al., ICML 2021); for one-model methods (FedAvg, FedProx,
    FedRL's objective, FedExP, FedGen)."""

    option = "clustered"
    title = "CluSamp"
    mode: str = setting("faithful", Choice(*MODES), "faithful (Fraboni et al.) | fedmr_port (the FedMR "
                        "authors' port: partial matrix update, size weights)")
    algorithm: int = setting(2, Choice(1, 2), "1: sample sizes only | 2: representative gradients", paper="2")
    distance: str = setting("arccos", Choice(*clustering.DISTANCES), "arccos (the original's \"cosine\") | L1 | L2 (squared)")
    linkage_input: str = setting("rows", Choice("rows", "condensed"), "rows: Ward on the matrix rows as observations "
                                 "(both codes) | condensed: on the distances")

    @property
    def display(self) -> str:
        return "CluSamp" + (" (FedMR port)" if self.mode == "fedmr_port" else "") + (" (Alg. 1)" if self.algorithm == 1 else "")

    def check_values(self, prefix: str) -> None:
        """The FedMR port always ran Algorithm 2, on the raw matrix rows."""
        if self.mode == "fedmr_port" and self.algorithm != 2:
            raise ConfigError(f"{prefix}algorithm", self.algorithm, "2 with selection.mode=fedmr_port (the port has only Algorithm 2)")

    def check(self, run: Any) -> None:
        """Clustered sampling weighs the replies of one model."""
        if not run.strategy.weighs_replies:
            raise ConfigError(
                "selection", self.option,
                f"selection=uniform with strategy.name={run.strategy.name} (clustered sampling weighs the replies of one "
                "model: FedAvg, FedExP, FedGen, or presets built on them such as fedprox)")

    def build(self, run: Any) -> ClusteredSelector:
        """The selector; its roster query carries the run config and asks for the nodes' sizes."""
        query = {protocol.ROSTER_EXAMPLES: 1, protocol.RUN_CONFIG: protocol.run_config_record(run)}
        selector = ClusteredSelector(seed=run.seed, num_clients=run.num_clients, query_config=query, mode=self.mode,
                                     algorithm=self.algorithm, distance=self.distance, linkage_input=self.linkage_input,
                                     min_nodes_timeout=float(run.min_nodes_timeout) or None)
        log(INFO, "client selection: %s", selector.describe())
        return selector

class ClusteredSelector(SeededRosterSelector):
    """Clustered sampling over the connected nodes (ordered by their stable keys).

    Parameters
    ----------
    seed : int
        Seeds every draw: round r uses ``rng(seed, r, 0xC1)``.
    num_clients : int
        N: the selector waits until this many nodes are connected (the distributions cover all).
    query_config : mapping
        Entries of the roster query that let a node report its number of training examples
        (the run config; see :meth:`SeededRosterSelector.ordered_nodes`).
    mode, algorithm, distance, linkage_input
        See the module docstring.
    """

    def __init__(
        self,
        seed: int,
        num_clients: int,
        query_config: Mapping[str, Any],
        mode: str = "faithful",
        algorithm: int = 2,
        distance: str = "arccos",
        linkage_input: str = "rows",
        **kwargs: Any,
    ) -> None:
        super().__init__(seed, query_config=query_config, **kwargs)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
        if algorithm not in (1, 2):
            raise ValueError(f"algorithm must be 1 or 2; got {algorithm!r}")
        if distance not in clustering.DISTANCES:
            raise ValueError(f"distance must be one of {clustering.DISTANCES}; got {distance!r}")
        self.num_clients = num_clients
        self.mode, self.algorithm, self.distance, self.linkage_input = mode, algorithm, distance, linkage_input
        # representative gradients: one row per node key (flattened trainable parameters, float32)
        self._grad_row: dict[str, int] = {}
        self._grads: np.ndarray | None = None
        self._undo: dict[int, np.ndarray] | None = None  # rows the round in progress overwrote (snapshot)
        # distance matrix over ``_matrix_keys`` (faithful: a cache; fedmr_port: the port's state)
        self._matrix_keys: list[str] = []
        self._matrix: np.ndarray | None = None
        self._dirty: set[str] = set()
        # the current round's draws
        self._draws: Counter[str] = Counter()
        self._drawn_keys: list[str] = []
        self.last_distributions: np.ndarray | None = None
        self.last_labels: np.ndarray | None = None

    # ----------------------------------------------------------------------- selection
    def select(self, grid: Grid, server_round: int, count: int, stream: int = 0) -> list[int]:
        """The distinct nodes drawn by the K distributions, in order of their first draw
        (``stream`` ≠ 0, e.g. federated evaluation, draws uniformly)."""
        if stream:
            return super().select(grid, server_round, count, stream)
        nodes = self.ordered_nodes(grid, max(count, self.num_clients))
        keys = [self.node_key(n) for n in nodes]
        missing = [k for n, k in zip(nodes, keys) if self.num_examples(n) is None]
        if missing:
            raise RuntimeError(
                f"clustered sampling needs every client's number of training examples; {len(missing)} node(s) did "
                f"not report it in the roster query (e.g. {missing[0]}): run fedmm's ClientApp, or use selection=uniform"
            )
        weights = [float(self.num_examples(n)) for n in nodes]
        rng = np.random.default_rng([self.seed, server_round, 0xC1])
        if self.algorithm == 1:
            distributions, labels = clustering.algorithm1(weights, count), None
        else:
            matrix = self._distance_matrix(keys)
            tree = clustering.ward_linkage(matrix, self.linkage_input)
            distributions, labels = clustering.algorithm2(tree, weights, count, rng)
        drawn = [keys[i] for i in clustering.draw(distributions, rng)]
        self.last_distributions, self.last_labels = distributions, labels
        self._drawn_keys, self._draws = drawn, Counter(drawn)
        by_key = dict(zip(keys, nodes))
        distinct = list(dict.fromkeys(drawn))
        self.round_info = {"distinct_clients": float(len(distinct))}
        if labels is not None:
            self.round_info["clusters"] = float(len(np.unique(labels)))
        return [by_key[k] for k in distinct]

    def draws(self, node_id: int) -> int:
        """How many of the round's K distributions drew this node."""
        return self._draws.get(self.node_key(node_id), 0)

    def aggregation_weights(self, updates: Sequence[ClientUpdate]) -> list[float] | None:
        """``faithful``: (draws)/K per update; ``fedmr_port``: n_i·(draws)."""
        k = sum(self._draws.values()) or 1
        if self.mode == "faithful":
            return [self.draws(u.node_id) / k for u in updates]
        return [float(u.num_examples) * self.draws(u.node_id) for u in updates]

    # ----------------------------------------------------------------------- gradients
    def observe(self, server_round: int, updates: Sequence[ClientUpdate], sent: Sequence[ModelDict]) -> None:
        """Keep each trained client's representative gradient (returned − sent, trainable
        parameters); ``fedmr_port`` then applies the port's partial matrix update."""
        if self.algorithm == 1:
            return
        for update, model in zip(updates, sent):
            grad = np.concatenate(
                [(update.model[key].astype(np.float32) - value.astype(np.float32)).ravel()
                 for key, value in model.items() if not is_buffer(key, value)]
            )
            self._store(self.node_key(update.node_id), grad)
        if self.mode == "fedmr_port" and self._drawn_keys:
            self._ensure_port_matrix(self._matrix_keys or sorted(self._grad_row))
            index = {k: i for i, k in enumerate(self._matrix_keys)}
            grads = self._grads_for(self._matrix_keys)
            clustering.port_partial_update(self._matrix, grads, [index[k] for k in self._drawn_keys if k in index],
                                           self.distance)

    def snapshot(self) -> Any:
        """An undo log of the round's observations: the rows they overwrite are kept as
        :meth:`_store` overwrites them (K rows, not the N × P gradients of a checkpoint)."""
        self._undo = {}
        return {"rows": dict(self._grad_row), "dirty": set(self._dirty), "matrix_keys": list(self._matrix_keys),
                "matrix": None if self._matrix is None else np.array(self._matrix, copy=True), "undo": self._undo}

    def restore(self, saved: Any) -> None:
        """Put back the rows, the distance matrix and the keys as :meth:`snapshot` found them."""
        for row, grad in saved["undo"].items():
            self._grads[row] = grad
        self._grad_row, self._dirty = dict(saved["rows"]), set(saved["dirty"])
        self._matrix_keys, self._matrix = list(saved["matrix_keys"]), saved["matrix"]
        self._undo = None

    def _store(self, key: str, grad: np.ndarray) -> None:
        if self._grads is None:
            self._grads = np.zeros((max(self.num_clients, 1), grad.size), dtype=np.float32)
        if grad.size != self._grads.shape[1]:
            raise ValueError(f"client {key}: its update has {grad.size} trainable values, the others {self._grads.shape[1]}")
        if key not in self._grad_row:
            if len(self._grad_row) == len(self._grads):
                self._grads = np.concatenate([self._grads, np.zeros_like(self._grads)])
            self._grad_row[key] = len(self._grad_row)
        row = self._grad_row[key]
        undo = self._undo
        if undo is not None and row not in undo:  # a round that may be rolled back: keep what it overwrites
            undo[row] = np.array(self._grads[row], copy=True)
        self._grads[row] = grad
        self._dirty.add(key)

    def _grads_for(self, keys: Sequence[str]) -> np.ndarray:
        """N×P representative gradients of ``keys`` (zeros for a client that never trained)."""
        width = 0 if self._grads is None else self._grads.shape[1]
        out = np.zeros((len(keys), width), dtype=np.float32)
        for i, key in enumerate(keys):
            if key in self._grad_row:
                out[i] = self._grads[self._grad_row[key]]
        return out

    def _ensure_port_matrix(self, keys: list[str]) -> None:
        if self._matrix is None or self._matrix_keys != keys:
            old = dict(zip(self._matrix_keys, range(len(self._matrix_keys))))
            matrix = np.zeros((len(keys), len(keys)))
            if self._matrix is not None:  # keep what the port had for the clients it knew
                idx = [old.get(k) for k in keys]
                for a, i in enumerate(idx):
                    for b, j in enumerate(idx):
                        if i is not None and j is not None:
                            matrix[a, b] = self._matrix[i, j]
            self._matrix, self._matrix_keys = matrix, list(keys)

    def _distance_matrix(self, keys: list[str]) -> np.ndarray:
        if self.mode == "fedmr_port":
            self._ensure_port_matrix(keys)
            assert self._matrix is not None
            return self._matrix
        if self._grads is None:
            return np.zeros((len(keys), len(keys)))
        grads = self._grads_for(keys)
        if self._matrix is None or self._matrix_keys != keys:
            self._matrix, self._matrix_keys = clustering.full_distances(grads, self.distance), list(keys)
        else:
            rows = [i for i, k in enumerate(keys) if k in self._dirty]
            if rows:
                part = clustering.distance_rows(grads, rows, self.distance)
                self._matrix[rows, :] = part
                self._matrix[:, rows] = part.T
        self._dirty.clear()
        return self._matrix

    # ----------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Representative gradients by node key and, for ``fedmr_port``, the port's matrix."""
        keys = sorted(self._grad_row)
        return {
            "grad_keys": keys,
            "grads": self._grads_for(keys) if keys else None,
            "matrix_keys": list(self._matrix_keys) if self.mode == "fedmr_port" else [],
            # a copy: the next round updates the matrix in place (an interrupt checkpoint must
            # hold this round's matrix, not a mix of two)
            "matrix": None if self.mode != "fedmr_port" or self._matrix is None else np.array(self._matrix, copy=True),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self._grad_row, self._grads, self._dirty = {}, None, set()
        for key, grad in zip(state.get("grad_keys", []), state.get("grads") if state.get("grads") is not None else []):
            self._store(key, np.asarray(grad, dtype=np.float32))
        self._dirty.clear()
        self._matrix_keys = list(state.get("matrix_keys", []))
        self._matrix = None if state.get("matrix") is None else np.array(state["matrix"], dtype=np.float64)

    def describe(self) -> str:
        """One line for the strategy's summary."""
        if self.algorithm == 1:
            return f"clustered sampling ({self.mode}, Algorithm 1: sample sizes)"
        return f"clustered sampling ({self.mode}, Algorithm 2: {self.distance}, Ward on {self.linkage_input})"

