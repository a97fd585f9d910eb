"""Local training's settings (the ``training`` group) and the learning rate of a round.

Declared here, in the ground layer, because both sides read them: the clients train with them
(:mod:`client_app.training`, the objectives' optimizer arguments), the server validates them.
Imports neither Flower nor hydra.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedmm.settings import Choice, Int, ListOf, Number, Settings, setting


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
    device: str = setting("auto", Choice("auto", "cpu", "cuda"), "auto (cuda when present) | cpu | cuda")


def round_lr(training: TrainingSettings, server_round: int) -> float:
    """Learning rate of a round: ``lr`` times ``lr_decay_factor`` per passed decay round."""
    passed = sum(1 for r in training.lr_decay_rounds if server_round >= r)
    return float(training.lr) * float(training.lr_decay_factor) ** passed
