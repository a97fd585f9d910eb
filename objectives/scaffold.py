"""SCAFFOLD's client (Karimireddy et al., ICML 2020, Option II)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from fedmm.settings import Choice, Nullable, Number, setting
from fedmm.training import TrainingSettings
from objectives.base import LocalUpdate, ObjectiveSettings

#: ArrayRecord of a train message: the server's control variate c (trainable parameters).
CONTROL = "control"
#: ArrayRecord of a train reply: Δc_i = c_i⁺ − c_i.
CONTROL_DELTA = "control-delta"
#: ``Context.state`` ArrayRecord: this client's control variate c_i.
CONTROL_STATE = "scaffold-c-i"
#: ``Context.state`` MetricRecord: rounds this client's c_i has been trained for.
CONTROL_AGE_STATE = "scaffold-age"
#: ConfigRecord of a train message (``weighting: examples``): the client's data weight.
CONTROL_CONFIG = "scaffold"
#: ``scaffold`` record: w_i = N·n_i/Σn, the client's correction is c/w_i − c_i.
CONTROL_WEIGHT = "data-weight"
#: Reply metric: rounds this client's c_i has been trained for, this one included (1 after a
#: first participation, or after a SuperNode restart lost its state).
CONTROL_AGE = "control-rounds"


@dataclass
class ScaffoldClientSettings(ObjectiveSettings):
    """The client's SGD for SCAFFOLD (``scaffold_lab``: the authors' lab code)."""

    option = "scaffold"
    title = "SCAFFOLD"
    momentum: float = setting(0.0, Number(ge=0, lt=1), "replaces training.momentum: Option II assumes plain SGD "
                              "(momentum β inflates c_i by ~1/(1−β))", paper="0")
    clip_norm: float | None = setting(None, Nullable(Number(gt=0), "null (no clipping) or a gradient norm > 0"),
                                      "clip the corrected gradient to this norm", paper="10 (the lab code)")
    control_lr: str = setting("used", Choice("used", "initial"), "lr in c_i⁺ = c_i − c + (x − y)/(K·lr): used (this "
                              "round's) | initial (training.lr, as the lab code)")

    server = "scaffold"


class Scaffold(LocalUpdate):
    """SCAFFOLD's client (Karimireddy et al., ICML 2020, Option II).

    The train message carries the server's control variate c (``control``: one array per
    trainable parameter); the node keeps its own c_i in ``Context.state`` (zeros at its first
    round, and again after a SuperNode restart, which is logged). Every optimizer step uses the
    corrected gradient g − c_i + c (with the ``scaffold`` record's data weight w_i: g − c_i + c/w_i),
    clipped to ``clip_norm`` when set. After training, with K the optimizer steps taken and η the
    learning rate of the round (``control_lr: used``) or the configured one (``initial``, as the
    authors' lab code): c_i⁺ = c_i − c + (x − y)/(K·η); the reply carries Δc_i = c_i⁺ − c_i
    (``control-delta``) besides the trained model y, and the node stores c_i⁺.

    ``momentum`` replaces ``training.momentum`` for SCAFFOLD: Option II assumes plain SGD, and
    with momentum β the displacement x − y is about 1/(1 − β) times larger than K·η times the
    mean corrected gradient, so c_i comes out about that much too large (2× at β = 0.5).
    """

    Settings = ScaffoldClientSettings

    def optimizer_args(self, training: TrainingSettings, lr: float) -> dict[str, float]:
        """SGD with SCAFFOLD's own ``momentum``."""
        return {**super().optimizer_args(training, lr), "momentum": float(self.params.momentum)}

    def begin(self, model: nn.Module, server_round: int) -> None:
        """Read c and the stored c_i; keep x."""
        from fedmm import protocol  # here: the objectives import without Flower

        self.own_state()
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        if CONTROL not in self.content:
            raise ValueError(f"the train message has no {CONTROL!r} record: run objective=scaffold with strategy=scaffold")
        c = protocol.record_to_model(self.content[CONTROL])
        if list(c) != self.names:
            raise ValueError(f"the control variate's keys {list(c)[:3]}... do not match the model's trainable parameters {self.names[:3]}...")
        if CONTROL_STATE in self.state:
            ci = protocol.record_to_model(self.state[CONTROL_STATE])
            age = int(self.state[CONTROL_AGE_STATE]["rounds"])
        else:
            ci = {n: np.zeros_like(v) for n, v in c.items()}
            age = 0
            if server_round > 1:
                logging.getLogger("flwr").info(
                    "SCAFFOLD: no c_i in this node's state at round %d: starting from zeros (its first "
                    "participation, or the SuperNode restarted and lost it)", server_round)
        weight = 1.0
        if CONTROL_CONFIG in self.content:
            weight = float(self.content[CONTROL_CONFIG][CONTROL_WEIGHT])
        device = next(model.parameters()).device
        self.c = {n: torch.from_numpy(np.array(v)).to(device) for n, v in c.items()}
        self.ci = {n: torch.from_numpy(np.array(v)).to(device) for n, v in ci.items()}
        self.correction = {n: self.c[n] / weight - self.ci[n] for n in self.names}
        self.x = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        self.age = age
        self.steps, self.lr_used = 0, None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The gradient correction c/w_i − c_i (``correction.<name>``)."""
        return {f"correction.{n}": value for n, value in self.correction.items()}

    def correct_gradient(self, grads: dict[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """g − c_i + c/w_i."""
        return {n: g + tensors[f"correction.{n}"] for n, g in grads.items()}

    def gradient_clip(self) -> float | None:
        """``clip_norm``, on the corrected gradient."""
        return float(self.params.clip_norm) if self.params.clip_norm else None

    def finish_steps(self, steps: int, lr: float) -> None:
        """The steps taken and the round's lr, for c_i⁺."""
        self.steps, self.lr_used = steps, lr

    def end(self, model: nn.Module) -> dict[str, Any]:
        """c_i⁺ into the node's state, Δc_i into the reply."""
        from fedmm import protocol  # here: the objectives import without Flower

        from flwr.app import MetricRecord

        if self.steps == 0:
            raise ValueError("SCAFFOLD: no optimizer step was taken (no training data?)")
        lr = self.lr_used if self.params.control_lr == "used" else float(self.local_training(self.run.training).lr)
        scale = 1.0 / (self.steps * lr)
        new, delta = {}, {}
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n not in self.x:
                    continue
                ci_new = self.ci[n] - self.c[n] + (self.x[n] - p.detach()) * scale
                new[n] = ci_new.cpu().numpy()
                delta[n] = (ci_new - self.ci[n]).cpu().numpy()
        self.keep({CONTROL_STATE: protocol.model_to_record(new), CONTROL_AGE_STATE: MetricRecord({"rounds": self.age + 1})})
        return {CONTROL_DELTA: protocol.model_to_record(delta)}

    def metrics(self) -> dict[str, float]:
        """How many rounds this node's c_i has been trained for (1: first, or state lost)."""
        return {CONTROL_AGE: float(self.age + 1)}
