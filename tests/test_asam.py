"""FedASAM / FedSAM: the ascent step on a two-tensor model against a hand computation, the
weights restored before the base step, and the presets."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from objectives.asam import ASAM, asam_perturbation
from objectives.base import build_local_update
from fedmm.config import compose, to_container


class TwoTensors(nn.Module):
    """y = w·x + b with w of shape (1, 2) ("fc.weight") and b of shape (1,) ("fc.bias")."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 1)
        with torch.no_grad():
            self.fc.weight.copy_(torch.tensor([[1.0, -2.0]]))
            self.fc.bias.copy_(torch.tensor([0.5]))


def test_perturbation_matches_a_hand_computation() -> None:
    w, b = torch.tensor([[1.0, -2.0]]), torch.tensor([0.5])
    gw, gb = torch.tensor([[3.0, 1.0]]), torch.tensor([2.0])
    rho, eta = 0.7, 0.2
    # ASAM: T_w = |w| + η = (1.2, 2.2), T_b = 1; n = sqrt((1.2·3)² + (2.2·1)² + 2²)
    n = math.sqrt(3.6**2 + 2.2**2 + 2.0**2) + 1e-16
    ew, eb = asam_perturbation([("fc.weight", w, gw), ("fc.bias", b, gb)], rho, eta, adaptive=True)
    assert torch.allclose(ew, torch.tensor([[rho * 1.2**2 * 3 / n, rho * 2.2**2 * 1 / n]]))
    assert torch.allclose(eb, torch.tensor([rho * 2.0 / n]))
    # SAM: T = 1 everywhere, e = ρ·g/‖g‖
    n = math.sqrt(9 + 1 + 4)
    ew, eb = asam_perturbation([("fc.weight", w, gw), ("fc.bias", b, gb)], 0.1, 0.0, adaptive=False)
    assert torch.allclose(ew, 0.1 * gw / n) and torch.allclose(eb, 0.1 * gb / n)


def test_the_gradient_is_taken_at_the_perturbed_point_and_the_weights_restored() -> None:
    x, y = torch.tensor([[1.0, 1.0], [2.0, -1.0]]), torch.tensor([0, 0])
    params = {"rho": 0.7, "eta": 0.2, "adaptive": True}
    update = ASAM({"objective": {"name": "asam", **params}})

    class Logits(TwoTensors):  # two logits (z, -z) so that cross-entropy applies
        def forward(self, x):
            z = self.fc(x)
            return torch.cat([z, -z], dim=1)

    model = Logits()
    w0 = [p.detach().clone() for p in model.parameters()]
    # by hand: g at w, e from it, g' at w + e
    loss = nn.functional.cross_entropy(model(x), y)
    g = torch.autograd.grad(loss, list(model.parameters()))
    e = asam_perturbation([(n, p, gi) for (n, p), gi in zip(model.named_parameters(), g)], **params)
    shifted = Logits()
    with torch.no_grad():
        for p, w, ei in zip(shifted.parameters(), w0, e):
            p.copy_(w + ei)
    g2 = torch.autograd.grad(nn.functional.cross_entropy(shifted(x), y), list(shifted.parameters()))
    # the gradient left in .grad is g' (at w + e), the weights are exactly w again (w + e − e)
    returned = update.gradient(model, x, y)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), w0))
    for p, gp in zip(model.parameters(), g2):
        assert torch.allclose(p.grad, gp, atol=1e-6)
    assert float(returned) == pytest.approx(float(loss))  # the reported loss is the one at w
    # the loop's step then uses it: w − 0.1·g' from w
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    for p, w, gp in zip(model.parameters(), w0, g2):
        assert torch.allclose(p, w - 0.1 * gp, atol=1e-6)


@pytest.mark.parametrize(("preset", "rho", "eta", "adaptive"),
                         [("fedasam", 0.7, 0.2, True), ("fedasam_fedmr_repo", 0.1, 0.0, True), ("fedsam", 0.1, 0.0, False)])
def test_presets_select_the_asam_plugin(preset: str, rho: float, eta: float, adaptive: bool) -> None:
    cfg = to_container(compose([f"strategy={preset}"]))
    assert cfg["strategy"]["name"] == "fedavg"
    assert (cfg["objective"]["rho"], cfg["objective"]["eta"], cfg["objective"]["adaptive"]) == (rho, eta, adaptive)
    assert isinstance(build_local_update(cfg), ASAM)
