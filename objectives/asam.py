"""FedASAM / FedSAM's client step (Caldarola, Caputo, Ciccone, ECCV 2022)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fedmm.settings import Bool, Number, setting
from objectives.base import LocalUpdate, ObjectiveSettings


@dataclass
class ASAMSettings(ObjectiveSettings):
    """(A)SAM's neighbourhood (the original's values; the presets ``sam`` and ``asam_fedmr_repo``)."""

    option = "asam"
    title = "FedASAM"
    rho: float = setting(0.7, Number(gt=0), "neighbourhood size ρ", paper="0.7 (ASAM), 0.1 (SAM)", label="ρ {}")
    eta: float = setting(0.2, Number(ge=0), "η: T = |w| + η for \"weight\" tensors", paper="0.2", label="η {}")
    adaptive: bool = setting(True, Bool(), "true: ASAM | false: SAM (T = 1)")

    @property
    def display(self) -> str:
        return "FedASAM" if self.adaptive else "FedSAM"

    def label_parts(self) -> list[str]:
        if not self.adaptive:
            return []
        return [f"ρ {self.rho}, η {self.eta}"] if (self.rho, self.eta) != (0.7, 0.2) else []


def asam_perturbation(
    named: list[tuple[str, torch.Tensor, torch.Tensor | None]], rho: float, eta: float, adaptive: bool
) -> list[torch.Tensor | None]:
    """The (A)SAM ascent step e for each (name, weight, gradient) (Caldarola et al. 2022, as
    their code): T = |w| + η for tensors whose name contains "weight" (BatchNorm's γ too) when
    ``adaptive``, T = 1 otherwise (and for every tensor in SAM); n = ‖T⊙g‖₂ over all tensors
    together + 1e-16; e = ρ·T²⊙g / n. None where a tensor has no gradient."""
    scaled = []
    for name, w, g in named:
        if g is None:
            scaled.append(None)
            continue
        t = (w.detach().abs() + eta) if adaptive and "weight" in name else None
        scaled.append((t, g))
    sq = [((t * g) if t is not None else g).pow(2).sum() for t, g in (x for x in scaled if x is not None)]
    norm = torch.sqrt(torch.stack(sq).sum()) + 1e-16 if sq else torch.tensor(1.0)
    out: list[torch.Tensor | None] = []
    for item in scaled:
        if item is None:
            out.append(None)
            continue
        t, g = item
        out.append(rho * (t * t * g if t is not None else g) / norm)
    return out


class ASAM(LocalUpdate):
    """FedASAM / FedSAM's client gradient (Caldarola, Caputo, Ciccone, ECCV 2022): per batch, a
    forward-backward at w, the ascent e (:func:`asam_perturbation`), a second forward-backward on
    the same batch at w + e, w restored; the loop's SGD step then acts on the second gradient
    (momentum and weight decay too). BatchNorm statistics are updated by both passes, as the reference code
    does. The server is FedAvg."""

    Settings = ASAMSettings

    def gradient(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The gradient at w + e (two passes on the batch); returns the loss at w."""
        loss, _ = self.loss(model, x, y)
        loss.backward()
        named = [(n, p, p.grad) for n, p in model.named_parameters() if p.requires_grad]
        shifts = asam_perturbation(named, self.params.rho, self.params.eta, self.params.adaptive)
        with torch.no_grad():
            for (_, p, _), e in zip(named, shifts):
                if e is not None:
                    p.add_(e)
        for p in model.parameters():
            p.grad = None
        perturbed, _ = self.loss(model, x, y)
        perturbed.backward()
        with torch.no_grad():
            for (_, p, _), e in zip(named, shifts):
                if e is not None:
                    p.sub_(e)
        return loss
