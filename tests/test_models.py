"""Tests for fedmm.models: shapes, parameter counts, layer prefixes, config errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from torch import nn
from torchvision.models.resnet import BasicBlock

from fedmm.errors import ConfigError
from fedmm.data import InputSpec
from fedmm.models import IMAGE_MODEL_NAMES, MODEL_NAMES, LayeredModel, PreActBottleneck, build_model

MNIST = (1, 28, 10)  # (in_channels, image_size, num_classes)
CIFAR10 = (3, 32, 10)
CIFAR100 = (3, 32, 100)

EXPECTED_NUM_LAYERS = {"cnn": 4, "lenet": 5, "resnet20": 5, "resnet20-preact": 5, "vgg16": 16}


def _build(name: str, shape: tuple[int, int, int], seed: int = 0) -> LayeredModel:
    in_channels, image_size, num_classes = shape
    torch.manual_seed(seed)
    return build_model(name, image(in_channels, num_classes, image_size))


def image(in_channels: object, num_classes: object, image_size: object) -> InputSpec:
    return InputSpec(kind="image", num_classes=num_classes, shape=(in_channels, image_size, image_size))  # type: ignore[arg-type]


def _batch(shape: tuple[int, int, int], batch: int = 2) -> torch.Tensor:
    in_channels, image_size, _ = shape
    gen = torch.Generator().manual_seed(123)
    return torch.randn(batch, in_channels, image_size, image_size, generator=gen)


def _num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_model_names() -> None:
    assert MODEL_NAMES == ("cnn", "lenet", "resnet20", "resnet20-preact", "vgg16", "char_lstm", "sent_lstm")


@pytest.mark.parametrize("name", IMAGE_MODEL_NAMES)
@pytest.mark.parametrize("shape", [MNIST, CIFAR10, CIFAR100], ids=["mnist", "cifar10", "cifar100"])
def test_output_shape(name: str, shape: tuple[int, int, int]) -> None:
    if name == "vgg16" and shape is MNIST:
        # Five max-pools leave nothing of a 28x28 input: rejected by design.
        with pytest.raises(ConfigError, match="dataset.image_size"):
            _build(name, shape)
        return
    model = _build(name, shape).eval()
    assert isinstance(model, LayeredModel)
    assert model.num_layers == EXPECTED_NUM_LAYERS[name]
    with torch.no_grad():
        out = model(_batch(shape))
    assert out.shape == (2, shape[2])
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()


# Exact parameter counts (weights + biases, BN affine parameters; BN running
# stats are buffers and do not count).
#
# cnn, 1x28x28/10: conv 1*32*25+32 = 832, conv 32*64*25+64 = 51,264,
#   FC 7*7*64*512+512 = 1,606,144, FC 512*10+10 = 5,130 -> 1,663,370 (FedAvg paper).
# lenet, 3x32x32/10: conv 456 + conv 2,416 + FC 400*120+120 = 48,120
#   + FC 10,164 + FC 850 -> 62,006.
# resnet20 (option B), 3x32x32/10:
#   stem conv 3*16*9 = 432 + BN 32                                    =     464
#   stage 1: 3 blocks x (2 convs 16*16*9 + 2 BN of 16)  = 3 x 4,672     =  14,016
#   stage 2: first block 16*32*9 + 32*32*9 + 2 BN + shortcut 16*32 + BN = 14,528,
#            2 blocks x (2 * 32*32*9 + 2 BN) = 2 x 18,560              =  51,648
#   stage 3: first block 32*64*9 + 64*64*9 + 2 BN + shortcut 32*64 + BN = 57,728,
#            2 blocks x (2 * 64*64*9 + 2 BN) = 2 x 73,984              = 205,696
#   FC 64*10+10                                                       =     650
#   total 272,474 (~0.27M; the paper's option-A shortcuts would give 269,722).
# resnet20-preact, 3x32x32/10: stem 432, stages 9,248 + 41,600 + 165,120,
#   final BN 512, FC 256*10+10 = 2,570 -> 219,482 (~0.22M).
# vgg16, 3x32x32/10: 13 convs with bias 14,714,688 + BN 8,448
#   + FC 512*4096+4096 = 2,101,248 + FC 4096*4096+4096 = 16,781,312
#   + FC 4096*10+10 = 40,970 -> 33,646,666.
@pytest.mark.parametrize(
    ("name", "shape", "expected"),
    [
        ("cnn", MNIST, 1_663_370),
        ("lenet", CIFAR10, 62_006),
        ("resnet20", CIFAR10, 272_474),
        ("resnet20-preact", CIFAR10, 219_482),
        ("vgg16", CIFAR10, 33_646_666),
    ],
)
def test_parameter_count(name: str, shape: tuple[int, int, int], expected: int) -> None:
    assert _num_params(_build(name, shape)) == expected


def test_resnet20_preact_size_matches_paper() -> None:
    n = _num_params(_build("resnet20-preact", CIFAR10))
    assert 200_000 <= n <= 250_000


def test_lenet_flatten_size_follows_image_size() -> None:
    # 28x28 -> 4x4x16 = 256 inputs to the first FC layer; 32x32 -> 5x5x16 = 400.
    assert _build("lenet", MNIST).layers[2][1].in_features == 256
    assert _build("lenet", CIFAR10).layers[2][1].in_features == 400


def test_resnet20_structure() -> None:
    model = _build("resnet20", CIFAR10)
    stages = list(model.layers[1:4])
    assert [len(s) for s in stages] == [3, 3, 3]
    assert all(isinstance(b, BasicBlock) for s in stages for b in s)
    # Option B: projection shortcut only where the shape changes.
    assert [b.downsample is not None for s in stages for b in s] == [
        False, False, False, True, False, False, True, False, False]
    feats = model.forward_prefix(_batch(CIFAR10), 4)
    assert feats.shape == (2, 64, 8, 8)


def test_resnet20_preact_structure() -> None:
    model = _build("resnet20-preact", CIFAR10)
    stages = list(model.layers[1:4])
    assert [len(s) for s in stages] == [2, 2, 2]
    assert all(isinstance(b, PreActBottleneck) for s in stages for b in s)
    with torch.no_grad():
        feats = model.eval().forward_prefix(_batch(CIFAR10), 4)
    assert feats.shape == (2, 256, 8, 8)  # 64 * expansion 4, two stride-2 stages


@pytest.mark.parametrize("name", IMAGE_MODEL_NAMES)
def test_forward_prefix(name: str) -> None:
    model = _build(name, CIFAR10).eval()
    x = _batch(CIFAR10)
    with torch.no_grad():
        full = model(x)
        assert torch.equal(model.forward_prefix(x, model.num_layers), full)
        # Every prefix is a plain tensor and the remaining layers complete it.
        for m in range(1, model.num_layers + 1):
            h = model.forward_prefix(x, m)
            assert isinstance(h, torch.Tensor)
            for layer in model.layers[m:]:
                h = layer(h)
            torch.testing.assert_close(h, full, rtol=0, atol=0)


@pytest.mark.parametrize("name", IMAGE_MODEL_NAMES)
@pytest.mark.parametrize("m", [0, -1, "num_layers+1", True, 1.0])
def test_forward_prefix_out_of_range(name: str, m: object) -> None:
    model = _build(name, CIFAR10)
    if m == "num_layers+1":
        m = model.num_layers + 1
    with pytest.raises(ValueError, match="m must be an int"):
        model.forward_prefix(_batch(CIFAR10, batch=1), m)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["cnn", "lenet", "resnet20", "resnet20-preact"])
def test_backward(name: str) -> None:
    # Training mode catches in-place ops that break autograd (e.g. around shortcuts).
    model = _build(name, CIFAR10).train()
    loss = nn.functional.cross_entropy(model(_batch(CIFAR10)), torch.tensor([1, 7]))
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_unknown_name() -> None:
    with pytest.raises(ConfigError) as excinfo:
        build_model("resnet18", image(3, 10, 32))
    msg = str(excinfo.value)
    assert "model.name" in msg and "resnet18" in msg
    for name in IMAGE_MODEL_NAMES:
        assert name in msg
    assert isinstance(excinfo.value, ValueError)
    assert excinfo.value.key == "model.name"


def test_vgg16_rejects_small_images() -> None:
    with pytest.raises(ConfigError, match="dataset.image_size") as excinfo:
        build_model("vgg16", image(1, 10, 28))
    assert excinfo.value.value == 28


def test_vgg16_larger_images_use_global_pool() -> None:
    model = _build("vgg16", (3, 64, 10)).eval()
    assert isinstance(model.layers[13][0], nn.AdaptiveAvgPool2d)
    assert not isinstance(_build("vgg16", CIFAR10).layers[13][0], nn.AdaptiveAvgPool2d)
    with torch.no_grad():
        out = model(_batch((3, 64, 10), batch=1))
    assert out.shape == (1, 10)


@pytest.mark.parametrize(("name", "too_small", "smallest_ok"), [("cnn", 3, 4), ("lenet", 15, 16)])
def test_small_images(name: str, too_small: int, smallest_ok: int) -> None:
    with pytest.raises(ConfigError, match="dataset.image_size"):
        build_model(name, image(1, 10, too_small))
    model = _build(name, (1, smallest_ok, 10)).eval()
    with torch.no_grad():
        assert model(_batch((1, smallest_ok, 10))).shape == (2, 10)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"in_channels": 0}, "dataset.in_channels"),
        ({"num_classes": 0}, "dataset.num_classes"),
        ({"image_size": -32}, "dataset.image_size"),
        ({"num_classes": 10.0}, "dataset.num_classes"),
    ],
)
def test_invalid_shape_arguments(kwargs: dict[str, object], key: str) -> None:
    args: dict[str, object] = {"in_channels": 3, "num_classes": 10, "image_size": 32, **kwargs}
    with pytest.raises(ConfigError, match=key):
        build_model("lenet", image(args["in_channels"], args["num_classes"], args["image_size"]))


def test_an_image_model_refuses_token_inputs() -> None:
    with pytest.raises(ConfigError) as info:
        build_model("cnn", InputSpec(kind="tokens", num_classes=80, shape=(80,), vocab_size=80))
    assert info.value.key == "model.name" and "image" in str(info.value)


@pytest.mark.parametrize("name", IMAGE_MODEL_NAMES)
def test_seed_determinism(name: str) -> None:
    a = _build(name, CIFAR10, seed=7).state_dict()
    b = _build(name, CIFAR10, seed=7).state_dict()
    c = _build(name, CIFAR10, seed=8).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_every_model_is_an_option_whose_head_follows_the_objective() -> None:
    from fedmm.config import compose, group_options, to_container

    assert sorted(group_options("model")) == sorted(MODEL_NAMES)
    for name in MODEL_NAMES:
        cfg = to_container(compose([f"model={name}"], validate_config=False))["model"]
        extra = {"embedding_dim": 100} if name == "sent_lstm" else {}
        assert cfg == {"name": name, "projection_dim": None, **extra}
    moon = to_container(compose(["model=lenet", "strategy=moon"], validate_config=False))
    assert moon["model"]["projection_dim"] == moon["objective"]["projection_dim"] == 256


@pytest.mark.parametrize("name", IMAGE_MODEL_NAMES)
def test_latent_and_classifier_split_the_forward_pass_and_the_projection_head(name: str) -> None:
    from fedmm.models import build_model

    torch.manual_seed(0)
    model = build_model(name, image(3, 10, 32)).eval()
    x = torch.randn(2, 3, 32, 32)
    z = model.latent(x)
    assert z.shape == (2, model.latent_dim)
    assert torch.allclose(model.classify(z), model(x), atol=1e-5)
    head = build_model(name, image(3, 10, 32), projection_dim=256).eval()
    assert head.num_layers == model.num_layers + 2 and head.latent_dim == 256
    assert head.latent(x).shape == (2, 256) and head(x).shape == (2, 10)
    assert torch.allclose(head.classify(head.latent(x)), head(x), atol=1e-5)
    # the projection is Linear(d, d) -> ReLU -> Linear(d, 256), the classifier Linear(256, C)
    linears = [m for m in head.layers[-3:].modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(model.latent_dim, model.latent_dim),
                                                                  (model.latent_dim, 256), (256, 10)]
