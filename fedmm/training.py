"""Local training's settings (the ``training`` group) and the learning rate of a round.

Declared here, in the ground layer, because both sides read them: the clients train with them
(:mod:`client_app.training`, the objectives' optimizer arguments), the server validates them.
Imports neither Flower nor hydra.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedmm.settings import Bool, Choice, Int, ListOf, Nullable, Number, Settings, setting


@dataclass
class TrainingSettings(Settings):
    """Local training on each client (the ``training`` group; ``conf/training/*.yaml`` are presets)."""

    group = "training"
    option = "default"
    keyed = False
    lr: float = setting(0.01, Number(gt=0), "SGD learning rate", paper="0.01 (FedMR, FedCross)")
    momentum: float = setting(0.5, Number(ge=0, lt=1), "SGD momentum", paper="0.5 (the authors' code; the text says 0.9)")
    weight_decay: float = setting(0.0, Number(ge=0), "SGD weight decay")
    local_epochs: int = setting(2, Int(min=1), "local epochs per round", paper="5")
    batch_size: int = setting(50, Int(min=1), "local batch size", paper="50")
    lr_decay_rounds: list = setting([], ListOf(Int(min=1), "a list of rounds >= 1"),
                                    "divide lr by lr_decay_factor at these rounds", paper="[40, 80] (FedRL)")
    lr_decay_factor: float = setting(0.1, Number(gt=0, le=1), "the factor of each lr decay")
    lr_round_decay: float = setting(1.0, Number(gt=0, le=1),
                                    "multiply lr by this every round: round r trains with lr × lr_round_decay^(r−1)",
                                    paper="0.998 (FedExP's and SCAFFOLD's original code)", label="lr ×{}/round")
    clip_grad_norm: float | None = setting(None, Nullable(Number(gt=0), "null (no clipping) or a norm > 0"),
                                           "clip the gradient's global L2 norm to this before each optimizer step",
                                           paper="10 (FedExP's original code)", label="clip {}")
    local_steps: int | None = setting(None, Nullable(Int(min=1), "null (local_epochs) or an integer >= 1"),
                                      "a fixed number of SGD steps per round instead of local_epochs (batches "
                                      "drawn epoch after epoch, each epoch reshuffled)", paper="20 (FedExP's original code)",
                                      label="{} steps")
    drop_last: bool = setting(False, Bool(), "drop each epoch's last batch when it is smaller than batch_size "
                              "(not a client's only batch)",
                              paper="true (SCAFFOLD's lab code, FedExP's original code)", label="drop_last={}")
    device: str = setting("auto", Choice("auto", "cpu", "cuda"), "auto (cuda when present) | cpu | cuda")

    #: Declared after runs were made: the values that reproduce those runs.
    added = {"lr_round_decay": 1.0, "clip_grad_norm": None, "local_steps": None, "drop_last": False}


def round_lr(training: TrainingSettings, server_round: int) -> float:
    """Learning rate of a round: ``lr`` times ``lr_decay_factor`` per passed decay round, times
    ``lr_round_decay`` per round before this one."""
    passed = sum(1 for r in training.lr_decay_rounds if server_round >= r)
    decayed = float(training.lr_round_decay) ** (server_round - 1) if training.lr_round_decay != 1.0 else 1.0
    return float(training.lr) * float(training.lr_decay_factor) ** passed * decayed


def host_values(values: Sequence[Any]) -> list[float]:
    """Scalar tensors a training loop kept on the device (so that no step waits for the device to
    report one) as floats, read in one transfer."""
    if not values:
        return []
    import torch

    return torch.stack([value.reshape(()) for value in values]).cpu().tolist()


def weighted_sum(values: Sequence[float], weights: Sequence[float] | None = None) -> float:
    """``values`` (times ``weights``) added in their order in double precision: the arithmetic of
    adding ``float(value) * weight`` step after step."""
    total = 0.0
    for i, value in enumerate(values):
        total += value * weights[i] if weights is not None else value
    return total
