"""CIFAR ResNets: ResNet-20 (BasicBlocks) and the authors' pre-activation bottleneck variant."""

from __future__ import annotations

import torch
from torch import nn

from fedmm.models.layered import LayeredModel, _too_small


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
