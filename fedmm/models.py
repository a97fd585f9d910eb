"""Model registry: the networks the experiments train, selected by ``model.name``.

Every model is a :class:`LayeredModel`: an ordered list of top-level blocks
("layers" in the sense of the FedMR / FedRL papers: a conv block, a residual
stage, a fully connected layer ...). Running the blocks in order is the forward
pass; running only the first ``m`` of them gives the intermediate representation
that layer-wise methods (FedMR layer recombination, FedRL review learning) use.

Public API
----------
MODEL_NAMES
    The names accepted by :func:`build_model`.
build_model(name, in_channels, num_classes, image_size)
    Build a freshly initialised model. Initialisation draws only from torch's
    global RNG, so ``torch.manual_seed(s)`` before the call makes it reproducible.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from fedmm.errors import ConfigError

__all__ = [
    "MODEL_NAMES",
    "LayeredModel",
    "PreActBottleneck",
    "build_model",
]


class LayeredModel(nn.Module):
    """A network made of an ordered sequence of top-level blocks.

    Parameters
    ----------
    layers : Iterable[nn.Module]
        The blocks in the order they are applied. The last one must produce the
        logits, shape ``[B, num_classes]``. Any flattening happens inside the
        first fully connected block, so every intermediate output is a plain
        tensor.

    Attributes
    ----------
    layers : nn.ModuleList
        The blocks, in order.
    """

    def __init__(self, layers: Iterable[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        if len(self.layers) == 0:
            raise ValueError("a LayeredModel needs at least one layer")

    @property
    def num_layers(self) -> int:
        """Number of top-level blocks."""
        return len(self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply all blocks in order and return the logits ``[B, num_classes]``."""
        for layer in self.layers:
            x = layer(x)
        return x

    def forward_prefix(self, x: torch.Tensor, m: int) -> torch.Tensor:
        """Return the output of the first ``m`` blocks.

        Parameters
        ----------
        x : torch.Tensor
            Input batch ``[B, C, H, W]``.
        m : int
            How many blocks to apply, ``1 <= m <= num_layers``. ``m == num_layers``
            gives exactly :meth:`forward`'s output.

        Returns
        -------
        torch.Tensor
            The representation after block ``m``.

        Raises
        ------
        ValueError
            If ``m`` is not an integer in ``[1, num_layers]``.
        """
        # bool is an int subclass; True/False as a layer count is a caller bug.
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= self.num_layers:
            raise ValueError(f"m must be an int in [1, {self.num_layers}], got {m!r}")
        for layer in self.layers[:m]:
            x = layer(x)
        return x


def _fc_block(in_features: int, out_features: int, *, flatten: bool = False,
              relu: bool = True, dropout: float = 0.0) -> nn.Sequential:
    """A fully connected "layer": [Flatten] + Linear [+ ReLU] [+ Dropout]."""
    mods: list[nn.Module] = [nn.Flatten()] if flatten else []
    mods.append(nn.Linear(in_features, out_features))
    if relu:
        mods.append(nn.ReLU(inplace=True))
    if dropout > 0:
        mods.append(nn.Dropout(dropout))
    return nn.Sequential(*mods)


def _too_small(image_size: int, model: str, minimum: int) -> ConfigError:
    return ConfigError("dataset.image_size", image_size, f">= {minimum} for model {model!r}")


# --------------------------------------------------------------------------- cnn


def _build_cnn(in_channels: int, num_classes: int, image_size: int) -> LayeredModel:
    """CNN of the FedAvg paper (McMahan et al. 2017), 4 layers.

    conv5x5(32)+ReLU+pool2, conv5x5(64)+ReLU+pool2, FC 512+ReLU, FC num_classes.
    "Same" padding, so the spatial side is ``image_size // 4`` after the convs
    (28 -> 7). On 1x28x28 / 10 classes: 1,663,370 parameters.
    """
    side = image_size // 4
    if side < 1:
        raise _too_small(image_size, "cnn", 4)
    return LayeredModel([
        nn.Sequential(nn.Conv2d(in_channels, 32, 5, padding=2), nn.ReLU(inplace=True),
                      nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(inplace=True),
                      nn.MaxPool2d(2)),
        _fc_block(64 * side * side, 512, flatten=True),
        _fc_block(512, num_classes, relu=False),
    ])


# ------------------------------------------------------------------------- lenet


def _build_lenet(in_channels: int, num_classes: int, image_size: int) -> LayeredModel:
    """LeNet-5 style CNN (the FedMR/FedCross authors' CIFAR "cnn"), 5 layers.

    conv5x5(6)+ReLU+pool2, conv5x5(16)+ReLU+pool2, FC 120+ReLU, FC 84+ReLU,
    FC num_classes. No conv padding, so the flattened size depends on the input
    side: 32 -> 5x5x16 = 400, 28 -> 4x4x16 = 256. On 3x32x32 / 10 classes:
    62,006 parameters.
    """
    side = ((image_size - 4) // 2 - 4) // 2
    if side < 1:
        raise _too_small(image_size, "lenet", 16)
    return LayeredModel([
        nn.Sequential(nn.Conv2d(in_channels, 6, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(6, 16, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2)),
        _fc_block(16 * side * side, 120, flatten=True),
        _fc_block(120, 84),
        _fc_block(84, num_classes, relu=False),
    ])


# ---------------------------------------------------------------------- resnets


def _init_resnet(model: nn.Module) -> None:
    """He init for convs, identity BN, as in He et al. 2015/2016 and torchvision."""
    for mod in model.modules():
        if isinstance(mod, nn.Conv2d):
            nn.init.kaiming_normal_(mod.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(mod, nn.BatchNorm2d):
            nn.init.ones_(mod.weight)
            nn.init.zeros_(mod.bias)


def _head(in_features: int, num_classes: int, pre: list[nn.Module] | None = None) -> nn.Sequential:
    """Classifier block: [pre] + global average pool + flatten + FC."""
    return nn.Sequential(*(pre or []), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(in_features, num_classes))


def _basic_stage(in_planes: int, planes: int, blocks: int, stride: int) -> nn.Sequential:
    """A stage of torchvision BasicBlocks; 1x1 conv + BN projection shortcut (option B)."""
    downsample = None
    if stride != 1 or in_planes != planes:
        downsample = nn.Sequential(
            nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
            nn.BatchNorm2d(planes),
        )
    # imported here: torchvision costs seconds to import in every ClientApp process
    from torchvision.models.resnet import BasicBlock

    mods = [BasicBlock(in_planes, planes, stride=stride, downsample=downsample)]
    mods += [BasicBlock(planes, planes) for _ in range(blocks - 1)]
    return nn.Sequential(*mods)


def _build_resnet20(in_channels: int, num_classes: int, image_size: int) -> LayeredModel:
    """CIFAR ResNet-20 (He et al. 2016, sec. 4.2), 5 layers.

    Layers: stem (conv3x3 16 + BN + ReLU); stages of 3 BasicBlocks with 16, 32,
    64 channels and strides 1, 2, 2; head (global average pool + FC). Shortcuts
    that change shape use a 1x1 conv + BN projection (option B) rather than the
    paper's parameter-free zero padding (option A), which adds 2,752 parameters:
    272,474 in total on 3x32x32 / 10 classes. Any image size >= 1 works because
    of the global pool.
    """
    if image_size < 1:
        raise _too_small(image_size, "resnet20", 1)
    model = LayeredModel([
        nn.Sequential(nn.Conv2d(in_channels, 16, 3, padding=1, bias=False),
                      nn.BatchNorm2d(16), nn.ReLU(inplace=True)),
        _basic_stage(16, 16, 3, stride=1),
        _basic_stage(16, 32, 3, stride=2),
        _basic_stage(32, 64, 3, stride=2),
        _head(64, num_classes),
    ])
    _init_resnet(model)
    return model


class PreActBottleneck(nn.Module):
    """Pre-activation bottleneck block (He et al. 2016, "Identity Mappings ...").

    ``BN-ReLU-conv1x1(planes)``, ``BN-ReLU-conv3x3(planes, stride)``,
    ``BN-ReLU-conv1x1(4 * planes)``, plus the shortcut. When the shape changes
    the shortcut is a 1x1 conv (stride ``stride``) applied to the pre-activated
    input, as in the paper; otherwise it is the identity on the raw input.

    Parameters
    ----------
    in_planes : int
        Input channels.
    planes : int
        Bottleneck width; the block outputs ``expansion * planes`` channels.
    stride : int
        Stride of the 3x3 conv (and of the projection shortcut).
    """

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out_planes = self.expansion * planes
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_planes, 1, bias=False)
        self.relu = nn.ReLU()  # not in-place: the pre-activation may feed the shortcut
        self.shortcut: nn.Module | None = None
        if stride != 1 or in_planes != out_planes:
            self.shortcut = nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(x))
        identity = x if self.shortcut is None else self.shortcut(out)
        out = self.conv1(out)
        out = self.conv2(self.relu(self.bn2(out)))
        out = self.conv3(self.relu(self.bn3(out)))
        return out + identity


def _preact_stage(in_planes: int, planes: int, blocks: int, stride: int) -> nn.Sequential:
    mods = [PreActBottleneck(in_planes, planes, stride)]
    out_planes = PreActBottleneck.expansion * planes
    mods += [PreActBottleneck(out_planes, planes) for _ in range(blocks - 1)]
    return nn.Sequential(*mods)


def _build_resnet20_preact(in_channels: int, num_classes: int, image_size: int) -> LayeredModel:
    """Pre-activation bottleneck ResNet, [2, 2, 2] blocks (FedMR/FedCross "resnet20").

    Layers: stem (conv3x3 16, no BN: the first block pre-activates it); three
    stages of 2 :class:`PreActBottleneck` blocks with widths 16, 32, 64 (outputs
    64, 128, 256 channels) and strides 1, 2, 2; head (BN + ReLU + global average
    pool + FC on the 256-d feature). 219,482 parameters on 3x32x32 / 10 classes.
    """
    if image_size < 1:
        raise _too_small(image_size, "resnet20-preact", 1)
    feat = 64 * PreActBottleneck.expansion
    model = LayeredModel([
        nn.Conv2d(in_channels, 16, 3, padding=1, bias=False),
        _preact_stage(16, 16, 2, stride=1),
        _preact_stage(16 * PreActBottleneck.expansion, 32, 2, stride=2),
        _preact_stage(32 * PreActBottleneck.expansion, 64, 2, stride=2),
        _head(feat, num_classes, pre=[nn.BatchNorm2d(feat), nn.ReLU(inplace=True)]),
    ])
    _init_resnet(model)
    return model


# ------------------------------------------------------------------------- vgg16

_VGG16_CFG: tuple[int | str, ...] = (
    64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M",
)


def _build_vgg16(in_channels: int, num_classes: int, image_size: int) -> LayeredModel:
    """CIFAR VGG-16 with BatchNorm, 16 layers (13 conv + 3 FC).

    Each conv layer is conv3x3 (padding 1) + BN + ReLU, with the following 2x2
    max-pool folded into the same block. The classifier is FC 512->4096 + ReLU +
    Dropout(0.5), FC 4096->4096 + ReLU + Dropout(0.5), FC 4096->num_classes, as
    in torchvision's VGG. 33,646,666 parameters on 3x32x32 / 10 classes.

    Image sizes below 32 raise :class:`ConfigError` (key ``dataset.image_size``):
    the five max-pools would shrink a 28x28 input to nothing, and padding it
    would silently change the architecture. For sizes of 64 and more the last
    feature map is larger than 1x1; it is reduced by a global average pool at the
    start of the first FC block, so the classifier stays 512-wide.
    """
    if image_size < 32:
        raise _too_small(image_size, "vgg16", 32)
    layers: list[nn.Sequential] = []
    channels = in_channels
    for item in _VGG16_CFG:
        if item == "M":
            # Fold the pool into the preceding conv block: a pool is not a layer.
            layers[-1].append(nn.MaxPool2d(2))
            continue
        layers.append(nn.Sequential(nn.Conv2d(channels, int(item), 3, padding=1),
                                    nn.BatchNorm2d(int(item)), nn.ReLU(inplace=True)))
        channels = int(item)
    fc1 = _fc_block(512, 4096, flatten=True, dropout=0.5)
    if image_size // 32 > 1:
        fc1.insert(0, nn.AdaptiveAvgPool2d(1))
    layers += [fc1, _fc_block(4096, 4096, dropout=0.5), _fc_block(4096, num_classes, relu=False)]
    return LayeredModel(layers)


# ---------------------------------------------------------------------- registry

_BUILDERS: dict[str, Callable[[int, int, int], LayeredModel]] = {
    "cnn": _build_cnn,
    "lenet": _build_lenet,
    "resnet20": _build_resnet20,
    "resnet20-preact": _build_resnet20_preact,
    "vgg16": _build_vgg16,
}

MODEL_NAMES: tuple[str, ...] = tuple(_BUILDERS)


def _check_positive(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, value, "a positive integer")
    return value


def build_model(name: str, in_channels: int, num_classes: int, image_size: int) -> LayeredModel:
    """Build the model called ``name`` for the given input and label shapes.

    Parameters
    ----------
    name : str
        One of :data:`MODEL_NAMES`.
    in_channels : int
        Image channels (1 for MNIST-like data, 3 for CIFAR).
    num_classes : int
        Number of output logits.
    image_size : int
        Side of the square input images (28 or 32 in the experiments).

    Returns
    -------
    LayeredModel
        A freshly initialised model in training mode.

    Raises
    ------
    ConfigError
        ``model.name`` for an unknown name; ``dataset.in_channels``,
        ``dataset.num_classes`` or ``dataset.image_size`` for a non-positive
        value; ``dataset.image_size`` for an image too small for the model
        (``vgg16`` needs at least 32).
    """
    if name not in _BUILDERS:
        raise ConfigError("model.name", name, ", ".join(MODEL_NAMES))
    in_channels = _check_positive("dataset.in_channels", in_channels)
    num_classes = _check_positive("dataset.num_classes", num_classes)
    image_size = _check_positive("dataset.image_size", image_size)
    return _BUILDERS[name](in_channels, num_classes, image_size)
