"""FedGen: teacher weights and losses on hand cases, the generator's output shape for every model,
the server's generator training, the client's terms and label histogram, the presets (a real
run, where the generator's loss goes down every round, is in tests/test_simulation.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import RecordDict
from torch.nn import functional as F

from objectives.base import build_local_update
from objectives import fedgen as fedgen_client
from objectives.fedgen import FedGenClient
from fedmm import protocol
from fedmm.config import compose, to_container
from fedmm.data import InputSpec
from fedmm.models import IMAGE_MODEL_NAMES, build_model
from fedmm.models.generator import Generator, classifier_of, diversity_loss, label_weights, teacher_loss
from fedmm.protocol import model_to_record
from strategies import build_strategy


def test_label_weights_on_a_hand_case() -> None:
    counts = np.array([[3, 0, 1], [1, 2, 0]])
    w, qualified = label_weights(counts, min_samples=1)
    np.testing.assert_allclose(w, [[0.75, 0, 1], [0.25, 1, 0]])
    assert qualified.tolist() == [0, 1]  # label 2: nobody holds more than 1 sample


def test_teacher_loss_keeps_the_codes_broadcast_and_diversity_on_hand_cases() -> None:
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([0, 1])
    heads = [(torch.eye(2), torch.zeros(2)), (torch.tensor([[0.0, 1.0], [1.0, 0.0]]), torch.zeros(2))]
    weights = torch.tensor([[0.75, 0.5], [0.25, 0.5]])
    expected = 0.0
    for u, (w, b) in enumerate(heads):
        ce = F.cross_entropy(z @ w.T + b, y, reduction="none")
        expected += float(ce.mean() * weights[u, y].mean())  # mean_b(CE_b)·mean_b(w_u(y_b))
    assert float(teacher_loss(z, y, heads, weights)) == pytest.approx(expected)
    # diversity: two samples, d_L1(z) = 1, d_L2(ε) = 0.25 off the diagonal -> exp(-(2·0.25)/4)
    eps = torch.tensor([[0.0, 0.0], [0.5, 0.5]])
    assert float(diversity_loss(z, eps)) == pytest.approx(math.exp(-0.125))
    # on a batch, value and gradient equal the definition written out (B × B × d differences)
    z = torch.randn(40, 24, dtype=torch.float64, requires_grad=True)
    eps = torch.rand(40, 7, dtype=torch.float64)
    loss = diversity_loss(z, eps)
    (grad,) = torch.autograd.grad(loss, z)
    dz = (z.unsqueeze(0) - z.unsqueeze(1)).abs().mean(dim=2)
    de = (eps.unsqueeze(0) - eps.unsqueeze(1)).pow(2).mean(dim=2)
    reference = torch.exp(-torch.mean(dz * de))
    (reference_grad,) = torch.autograd.grad(reference, z)
    assert float(loss) == pytest.approx(float(reference), rel=1e-12)
    torch.testing.assert_close(grad, reference_grad, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("name", IMAGE_MODEL_NAMES)
def test_generator_output_fits_every_models_classifier(name: str) -> None:
    spec = InputSpec(kind="image", num_classes=10, shape=(3, 32, 32))
    model = build_model(name, spec).eval()
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    weight, bias = classifier_of(state)
    assert state[weight].shape == (10, model.latent_dim) and state[bias].shape == (10,)
    gen = Generator(100, 10, model.latent_dim).eval()
    z, eps = gen(torch.tensor([0, 3, 9]))
    assert z.shape == (3, model.latent_dim) and eps.shape == (3, 100) and (eps >= 0).all() and (eps < 1).all()
    assert model.classify(z).shape == (3, 10)


def fedgen_cfg(*overrides: str) -> dict:
    return to_container(compose(["strategy=fedgen", *overrides]))


def test_server_trains_the_generator_and_its_loss_goes_down() -> None:
    cfg = fedgen_cfg()
    strategy = build_strategy(cfg)
    torch.manual_seed(0)
    model = build_model("cnn", InputSpec(kind="image", num_classes=10, shape=(1, 28, 28)))
    initial = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    strategy.initialize(initial)
    assert strategy.generator.latent_dim == 512 and strategy.num_classes == 10
    rng = np.random.default_rng(0)
    models = []
    for _ in range(3):  # three "trained" clients: the initial model with perturbed classifiers
        m = dict(initial)
        w, b = classifier_of(m)
        m[w] = (m[w] + rng.normal(0, 0.5, m[w].shape)).astype(np.float32)
        models.append(m)
    counts = np.array([[50, 0, 3, 0, 0, 0, 0, 0, 0, 0], [0, 40, 2, 0, 0, 0, 0, 0, 0, 9], [10, 10, 10, 0, 0, 0, 0, 0, 0, 0]])
    before = {k: v.clone() for k, v in strategy.generator.state_dict().items()}
    first, last = strategy.train_generator(1, models, counts)
    assert last < first
    assert any(not torch.equal(before[k], v) for k, v in strategy.generator.state_dict().items())
    # the generator goes out from round 2 on, and every reply must carry a label histogram
    strategy.prepare_round(1, [])
    assert strategy.extra_records(1, 0) == {}
    strategy.prepare_round(2, [])
    assert fedgen_client.GENERATOR in strategy.extra_records(2, 0)
    assert dict(strategy.needs(2).arrays) == {fedgen_client.LABEL_COUNTS: {fedgen_client.LABEL_COUNTS: ((10,), np.dtype(np.int64))}}
    # checkpoint round trip
    again = build_strategy(cfg)
    again.load_state_dict(strategy.context.state_dict())
    assert all(torch.equal(again.generator.state_dict()[k], v) for k, v in strategy.generator.state_dict().items())


def test_client_terms_from_round_two_and_its_label_histogram() -> None:
    cfg = fedgen_cfg("training.local_epochs=1")
    spec = InputSpec(kind="image", num_classes=10, shape=(1, 28, 28))
    torch.manual_seed(0)
    model = build_model("cnn", spec)
    x, y = torch.randn(6, 1, 28, 28), torch.tensor([0, 0, 1, 3, 3, 3])
    first = FedGenClient(cfg, RecordDict(), RecordDict())
    first.begin(model, 1)
    loss, logits = first.loss(model, x, y)
    assert first.generator is None and float(loss) == pytest.approx(float(F.cross_entropy(logits, y)))  # round 1: CE
    counts = first.end(model)[fedgen_client.LABEL_COUNTS][fedgen_client.LABEL_COUNTS].numpy()
    assert counts.tolist() == [2, 1, 0, 3, 0, 0, 0, 0, 0, 0]

    gen = Generator(cfg["strategy"]["noise_dim"], 10, model.latent_dim)
    content = RecordDict({fedgen_client.GENERATOR: model_to_record({k: v.numpy() for k, v in gen.state_dict().items()})})
    second = FedGenClient(cfg, RecordDict(), content)
    second.begin(model, 2)
    assert second.alpha == pytest.approx(0.2) and second.beta == pytest.approx(0.2)  # mnist5k: the default
    loss, logits = second.loss(model, x, y)
    assert float(loss) > float(F.cross_entropy(logits, y))
    loss.backward()
    assert all(p.grad is None and not p.requires_grad for p in second.generator.parameters())
    assert second.metrics()["fedgen_kl"] >= 0 and second.metrics()["fedgen_ce"] > 0
    # the generator above has noise 100
    original = FedGenClient(fedgen_cfg("strategy=fedgen_original", f"strategy.noise_dim={cfg['strategy']['noise_dim']}"), RecordDict(), content)
    assert original.params.decay == 0.98
    original.begin(model, 11)
    assert original.alpha == pytest.approx(0.2 * 0.98**10)


def test_presets_and_config_rules() -> None:
    from fedmm.errors import ConfigError

    assert isinstance(build_local_update(fedgen_cfg()), FedGenClient)
    original = fedgen_cfg("strategy=fedgen_original")
    assert (original["strategy"]["optimizer"], original["strategy"]["noise_dim"], original["objective"]["gen_batch_size"]) == \
        ("persistent", 64, 32)
    assert build_strategy(fedgen_cfg("dataset=cifar100")).settings["ensemble_lr"] == 1e-4
    with pytest.raises(ConfigError, match="objective"):
        compose(["strategy=fedgen", "objective=ce"])
    with pytest.raises(ConfigError, match="strategy=fedgen"):
        compose(["objective=fedgen"])


def test_a_saved_state_is_not_changed_by_the_next_rounds_steps() -> None:
    """An interrupt checkpoint holds the state of the last completed round: the persistent
    optimizer's moments in a state taken after round 1 stay as they were while round 2 trains."""
    strategy = build_strategy(fedgen_cfg("strategy=fedgen_original"))
    torch.manual_seed(0)
    model = build_model("cnn", InputSpec(kind="image", num_classes=10, shape=(1, 28, 28)))
    initial = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    strategy.initialize(initial)
    counts = np.array([[50, 0, 3, 0, 0, 0, 0, 0, 0, 0], [0, 40, 2, 0, 0, 0, 0, 0, 0, 9]])
    strategy.train_generator(1, [initial, initial], counts)
    saved = strategy.context.state_dict()
    moments = {k: v["exp_avg"].clone() for k, v in saved["optimizer"]["state"].items()}
    strategy.train_generator(2, [initial, initial], counts)
    assert all(torch.equal(saved["optimizer"]["state"][k]["exp_avg"], m) for k, m in moments.items())
