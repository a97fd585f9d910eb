"""The server's root set and its training on it: FLTrust's reference update (strategies/trust.py).

A change of threat model: the server holds a small clean set (``strategy.defence.trust_root``
rows). They are drawn from the test split, which no client trains on; the server's central
evaluation then uses the rest of the test split, so that no row it trained on is scored.

Shared ground (no Flower, no app): the runner builds a :class:`RootTrainer` and hands it to the
run's context (``strategy.context.reference``); the strategies only see the function.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedmm.data import TensorData, batches
from fedmm.errors import ConfigError
from fedmm.training import TrainingSettings, round_lr

#: Drawn apart from the clients' partitions and the run's other draws.
ROOT_SEED_OFFSET = 0x7A57


def split_root(test: TensorData, rows: int, seed: int) -> tuple[TensorData, TensorData]:
    """(the root set: ``rows`` rows of ``test`` drawn with ``seed``, the rest of ``test``)."""
    if rows >= len(test):
        raise ConfigError("strategy.defence.trust_root", rows, f"fewer rows than the test split's {len(test)} (the "
                          "server evaluates on the rest)")
    order = np.random.default_rng(seed + ROOT_SEED_OFFSET).permutation(len(test))
    return test.subset(np.sort(order[:rows])), test.subset(np.sort(order[rows:]))


def client_steps(training: TrainingSettings, train_rows: int, num_clients: int) -> int:
    """The SGD steps of a client's round: ``local_steps``, else ``local_epochs`` passes over a
    partition of the mean size (``train_rows`` / ``num_clients``) in batches of ``batch_size``."""
    if training.local_steps is not None:
        return int(training.local_steps)
    return int(training.local_epochs) * max(1, -(-train_rows // max(num_clients, 1)) // training.batch_size)


class RootTrainer:
    """(the model a node was sent, the round) → the model trained from it on the root set, with the
    clients' local training (``steps``: a client's SGD steps of a round, :func:`client_steps`, the
    paper's R local iterations, passes over the root set reshuffled; ``training``: batch size, the
    round's lr, momentum, weight decay, gradient clipping) and plain cross-entropy: FLTrust's
    server update. With fewer steps than the clients its update would be shorter than theirs, and
    rescaling every update to its norm would slow the run down.

    Parameters
    ----------
    model : nn.Module
        A model of the run's architecture (copied: the caller's stays as it is).
    root : TensorData
        The root set.
    training : TrainingSettings
        The run's local training.
    steps : int
        SGD steps per round (:func:`client_steps`).
    seed : int
        The run's seed (the batches of round r are drawn from seed and r).
    device : torch.device
        Where it trains.
    """

    def __init__(self, model: nn.Module, root: TensorData, training: TrainingSettings, steps: int, seed: int,
                 device: torch.device) -> None:
        self.model = copy.deepcopy(model).to(device)
        self.root, self.training, self.steps, self.seed, self.device = root, training, steps, seed, device

    def __call__(self, sent: dict[str, np.ndarray], server_round: int) -> dict[str, Any]:
        t = self.training
        self.model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in sent.items()})
        self.model.train()
        optimizer = torch.optim.SGD(self.model.parameters(), lr=round_lr(t, server_round), momentum=t.momentum,
                                    weight_decay=t.weight_decay)
        generator = torch.Generator().manual_seed(self.seed * 100_003 + server_round + ROOT_SEED_OFFSET)
        taken = 0
        while taken < self.steps:
            for x, y in batches(self.root, t.batch_size, shuffle=True, generator=generator, device=self.device):
                optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(self.model(x), y).backward()
                if t.clip_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), float(t.clip_grad_norm))
                optimizer.step()
                taken += 1
                if taken == self.steps:
                    break
        return {k: v.detach().cpu().numpy() for k, v in self.model.state_dict().items()}
