"""The small CNNs: the FedAvg paper's CNN and the authors' LeNet-style CIFAR "cnn"."""

from __future__ import annotations

from torch import nn

from fedmm.models.layered import LayeredModel, _fc_block, _too_small


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
