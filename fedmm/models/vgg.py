"""CIFAR VGG-16 with BatchNorm."""

from __future__ import annotations

from torch import nn

from fedmm.models.layered import LayeredModel, _fc_block, _too_small

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
