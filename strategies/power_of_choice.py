"""Power-of-Choice client selection (pow-d: Cho, Wang, Joshi, AISTATS 2022).

Each round the selector draws d candidate clients without replacement, each with probability
proportional to its share of the training data (the sizes the nodes report in the roster
query), sends each candidate the round's global model in an evaluate message that asks for the
loss on its training rows (``fedmm-measure: loss-before``; the fedmm ClientApp answers it), and
selects the K candidates with the highest loss (ties: the draw's order). Biasing the sample
towards clients the model serves badly speeds up convergence under label skew; the replies are
then averaged unweighted, as the paper's update does (the sampling already weighed the clients
by their data). A candidate that does not answer counts as the lowest loss.

``selection=power_of_choice`` with any one-model method (``selection.candidates``: d, null: 2K,
at most N). It reads the clients' data (their losses), so a differentially private run refuses
it (the accounting assumes K of N drawn uniformly), as the asynchronous driver does.
"""

from __future__ import annotations

from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord
from flwr.serverapp import Grid
from flwr.supercore import log

from fedmm import protocol
from fedmm.errors import ConfigError
from fedmm.protocol import ClientUpdate
from fedmm.settings import Int, Nullable, setting
from strategies.selection import SeededRosterSelector, UniformSettings

#: rng stream of the candidates' draw.
CANDIDATES_STREAM = 0xD0


@dataclass
class PowerOfChoiceSettings(UniformSettings):
    """pow-d: d candidates drawn by data size, the K with the highest loss selected."""

    option = "power_of_choice"
    title = "Power-of-Choice"
    candidates: int | None = setting(None, Nullable(Int(min=1), "null (2K, at most N) or an integer >= 1"),
                                     "d: the candidates whose loss is measured each round (at least clients_per_round)",
                                     paper="d in {2K, 3K, ...} (Cho et al., Fig. 3)", label="d {}")

    @property
    def display(self) -> str:
        return "pow-d"

    def check(self, run: Any) -> None:
        """d between K and N; the replies of one model are weighed (a one-model method)."""
        d = self.candidates
        if d is not None and not run.clients_per_round <= d <= run.num_clients:
            raise ConfigError("selection.candidates", d, f"from clients_per_round={run.clients_per_round} to "
                              f"num_clients={run.num_clients}")
        if not run.strategy.weighs_replies:
            raise ConfigError("selection", self.option, f"selection=uniform with strategy.name={run.strategy.name} "
                              "(Power-of-Choice weighs the replies of one model: FedAvg or a preset built on it)")

    def build(self, run: Any) -> PowerOfChoiceSelector:
        """The selector; its roster query asks the nodes for their sizes, its loss queries carry the run config."""
        record = protocol.run_config_record(run)
        d = self.candidates or min(run.num_clients, 2 * run.clients_per_round)
        return PowerOfChoiceSelector(run.seed, d, query_config={protocol.ROSTER_EXAMPLES: 1, protocol.RUN_CONFIG: record},
                                     min_nodes_timeout=float(run.min_nodes_timeout) or None)


class PowerOfChoiceSelector(SeededRosterSelector):
    """pow-d over the connected nodes (module docstring).

    Parameters
    ----------
    seed : int
        Seeds the candidates' draw: round r uses ``rng(seed, r, 0xD0)``.
    candidates : int
        d.
    query_config : mapping
        The roster query's entries (the run config, and the ask for the nodes' sizes); the loss
        queries carry the run config too.
    """

    def __init__(self, seed: int, candidates: int, query_config: dict[str, Any], **roster: Any) -> None:
        super().__init__(seed, query_config=query_config, **roster)
        self.candidates = int(candidates)
        self.model: ArrayRecord | None = None

    def prepare(self, server_round: int, arrays: ArrayRecord) -> None:
        """The global model the round starts from: the candidates' losses are measured on it."""
        self.model = arrays

    def select(self, grid: Grid, server_round: int, count: int, stream: int = 0) -> list[int]:
        """Evaluation draws (``stream`` ≠ 0) are uniform; a training draw is pow-d."""
        if stream or self.model is None:
            return super().select(grid, server_round, count, stream)
        nodes = self.ordered_nodes(grid, count)
        sizes = np.array([float(self.num_examples(n) or 0) for n in nodes])
        p = sizes / sizes.sum() if sizes.sum() > 0 else np.full(len(nodes), 1 / len(nodes))
        rng = np.random.default_rng([self.seed, server_round, CANDIDATES_STREAM])
        d = min(max(self.candidates, count), int((p > 0).sum()))
        drawn = [nodes[i] for i in rng.choice(len(nodes), size=d, replace=False, p=p)]
        losses = self.losses(grid, server_round, drawn)
        order = sorted(range(d), key=lambda i: (-losses.get(drawn[i], -np.inf), i))
        chosen = [drawn[i] for i in order[:count]]
        known = [losses[n] for n in drawn if n in losses]
        self.round_info = {"candidates": float(d), "candidate_loss_mean": float(np.mean(known)) if known else float("nan"),
                           "selected_loss_mean": float(np.mean([losses.get(n, np.nan) for n in chosen]))}
        return chosen

    def losses(self, grid: Grid, server_round: int, nodes: list[int]) -> dict[int, float]:
        """Each answering node's loss of the round's model on its training rows."""
        config = {**self.query_config, protocol.SERVER_ROUND: server_round, protocol.MEASURE: [protocol.LOSS_BEFORE]}
        config.pop(protocol.ROSTER_EXAMPLES, None)
        messages = [protocol.server_message(protocol.EVALUATE, n, config, self.model) for n in nodes]
        out: dict[int, float] = {}
        for reply in grid.send_and_receive(messages, timeout=self.timeout):
            node, value = reply.metadata.src_node_id, None
            if not reply.has_error():
                value = protocol.reply_metrics(reply).get(protocol.LOSS_BEFORE)
            if value is None or not np.isfinite(value):
                log(WARNING, "round %d: node %d gave no loss for Power-of-Choice (it counts as the lowest)", server_round, node)
                continue
            out[node] = float(value)
        log(INFO, "Power-of-Choice: %d of %d candidates answered", len(out), len(nodes))
        return out

    def aggregation_weights(self, updates: list[ClientUpdate]) -> list[float]:
        """Unweighted, as the paper's update (the sampling weighed the clients by their data)."""
        return [1.0] * len(updates)

    def describe(self) -> str:
        return f"Power-of-Choice (pow-d, d={self.candidates})"
