"""MOON: ℓ_con on hand cases, no gradient into the frozen models, the previous model kept in the
node's state, the first-negative options, and the preset (the shared simulation in
tests/test_simulation.py checks the state across rounds in a real run)."""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import RecordDict

from client_app.training import sgd_steps
from objectives.base import build_local_update
from objectives import moon
from objectives.moon import Moon, contrastive_loss
from fedmm import protocol
from fedmm.config import compose, to_container
from fedmm.data import InputSpec
from fedmm.models import build_model

SPEC = InputSpec(kind="image", num_classes=10, shape=(1, 28, 28))


def test_contrastive_loss_on_hand_cases() -> None:
    z, zg, zp = torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 3.0]])
    # sim(z, z_g) = 1, sim(z, z_p) = 0, τ = 0.5: −log(e² / (e² + e⁰)) = log(1 + e⁻²)
    assert float(contrastive_loss(z, zg, [zp], 0.5)) == pytest.approx(math.log(1 + math.exp(-2)))
    assert float(contrastive_loss(z, zg, [], 0.5)) == 0.0  # no negative: a single logit, CE = 0
    assert float(contrastive_loss(z, zg, [zg], 0.5)) == pytest.approx(math.log(2))  # negative = positive
    # batch mean over rows
    two = contrastive_loss(torch.cat([z, z]), torch.cat([zg, zp]), [torch.cat([zp, zg])], 1.0)
    assert float(two) == pytest.approx((math.log(1 + math.exp(-1)) + math.log(1 + math.exp(1))) / 2)


def plugin(state: RecordDict, first_negative: str = "init", mu: float = 1.0) -> Moon:
    cfg = {"objective": {"name": "moon", "mu": mu, "mu_by_dataset": {}, "default_mu": 1.0, "tau": 0.5,
                         "projection_dim": 16, "first_negative": first_negative},
           "dataset": {"name": "mnist5k"}, "seed": 0}
    return Moon(cfg, state, RecordDict())


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(8, 1, 28, 28, generator=gen), torch.randint(0, 10, (8,), generator=gen)


def train_round(update: Moon, model: torch.nn.Module, server_round: int, steps: int = 2) -> None:
    update.begin(model, server_round)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sgd_steps(model, update, opt, [batch() for _ in range(steps)])
    update.end(model)


def test_frozen_models_get_no_gradient_and_the_previous_model_is_kept() -> None:
    torch.manual_seed(0)
    model = build_model("cnn", SPEC, projection_dim=16)
    state = RecordDict()
    first = plugin(state)
    train_round(first, model, 1)
    assert first.negative is None and first.metrics()[moon.CONTRASTIVE] == 0.0  # round 1: CE only
    assert moon.PREVIOUS in state and first.metrics()[moon.AGE] == 1.0
    previous = {k: v.clone() for k, v in model.state_dict().items()}

    second = plugin(state)
    second.begin(model, 2)
    assert second.had_previous
    assert all(torch.equal(second.negative.state_dict()[k], previous[k]) for k in previous)
    frozen = [{k: v.clone() for k, v in m.state_dict().items()} for m in (second.global_model, second.negative)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sgd_steps(model, second, opt, [batch()])
    for net, before in zip((second.global_model, second.negative), frozen):
        assert not net.training
        assert all(p.grad is None and not p.requires_grad for p in net.parameters())
        assert all(torch.equal(net.state_dict()[k], before[k]) for k in before)
    assert not torch.equal(model.state_dict()["layers.0.0.weight"], previous["layers.0.0.weight"])  # the local one moved
    second.end(model)
    assert second.metrics()[moon.CONTRASTIVE] > 0 and second.metrics()[moon.AGE] == 2.0


@pytest.mark.parametrize("mode", ["none", "init", "global"])
def test_first_negative_options(mode: str) -> None:
    torch.manual_seed(0)
    model = build_model("cnn", SPEC, projection_dim=16)
    update = plugin(RecordDict(), first_negative=mode)
    update.begin(model, 3)  # a later round, no previous model in this node's state
    if mode == "none":
        assert update.negative is None
    elif mode == "global":
        assert update.negative is update.global_model
    else:  # the node's own initial network: neither the received model nor another node's
        other = plugin(RecordDict(), first_negative=mode)
        other.node = 7
        other.begin(model, 3)
        key = "layers.0.0.weight"
        assert not torch.equal(update.negative.state_dict()[key], model.state_dict()[key])
        assert not torch.equal(update.negative.state_dict()[key], other.negative.state_dict()[key])
        again = plugin(RecordDict(), first_negative=mode)
        again.begin(model, 3)
        assert torch.equal(update.negative.state_dict()[key], again.negative.state_dict()[key])  # reproducible


def test_preset_builds_the_projection_head_into_the_model() -> None:
    cfg = to_container(compose(["strategy=moon"]))
    assert cfg["model"]["projection_dim"] == 256 and isinstance(build_local_update(cfg), Moon)
    assert build_local_update(cfg).mu() == 1.0  # mnist5k: the code's default; cifar10: 5
    assert build_local_update(to_container(compose(["strategy=moon", "dataset=cifar10"]))).mu() == 5.0
    assert to_container(compose(["strategy=moon", "objective.projection_dim=null"]))["model"]["projection_dim"] is None
