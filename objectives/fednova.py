"""FedNova's client (Wang, Liu, Liang, Joshi, Poor, NeurIPS 2020): local SGD as any client trains,
reporting how far its steps reach, so that the server can normalize its update.

A client that took τ local steps of SGD with momentum ρ reports its normalizing factor

    a = Σ_{t=1..τ} Σ_{j<t} ρ^j        (a = τ without momentum)

(the authors' code: a counter c ← ρ·c + 1 after every step, a ← a + c) as the reply metric
``fednova-a``; τ is the training loop's own step count (:meth:`~objectives.base.LocalUpdate.finish_steps`,
the same on both training paths). The server half is ``strategy=fednova`` (which selects this objective).
"""

from __future__ import annotations

from dataclasses import dataclass

from objectives.base import LocalUpdate, ObjectiveSettings

#: The reply metric with the client's normalizing factor a.
NORMALIZER = "fednova-a"


def normalizer(steps: int, momentum: float) -> float:
    """a of ``steps`` SGD steps with ``momentum`` (module docstring)."""
    counter, total = 0.0, 0.0
    for _ in range(steps):
        counter = counter * momentum + 1.0
        total += counter
    return total


@dataclass
class FedNovaClientSettings(ObjectiveSettings):
    """FedNova's client has no settings of its own (its steps and momentum are the training group's)."""

    option = "fednova"
    title = "FedNova"
    server = "fednova"


class FedNovaClient(LocalUpdate):
    """Plain cross-entropy SGD that reports its normalizing factor (module docstring)."""

    Settings = FedNovaClientSettings

    def begin(self, model, server_round: int) -> None:  # noqa: ANN001 - see the base
        self.steps = 0

    def finish_steps(self, steps: int, lr: float) -> None:
        self.steps = steps

    def metrics(self) -> dict[str, float]:
        """``fednova-a``: a of this round's steps."""
        return {NORMALIZER: normalizer(self.steps, float(self.local_training(self.run.training).momentum))}
