"""LayeredModel: a network as an ordered list of top-level blocks, and block helpers."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from fedmm.errors import ConfigError


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


    # ----------------------------------------------------------------- latent / classifier
    def _classifier(self) -> nn.Linear:
        last = self.layers[-1]
        final = last[-1] if isinstance(last, nn.Sequential) and len(last) else last
        if not isinstance(final, nn.Linear):
            raise TypeError(f"the last block of this model does not end with nn.Linear ({type(final).__name__})")
        return final

    @property
    def latent_dim(self) -> int:
        """Size of the latent vector: the input of the final linear classifier."""
        return int(self._classifier().in_features)

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """The input of the final linear classifier (a contrastive objective's representation, a generator's latent)."""
        for layer in self.layers[:-1]:
            x = layer(x)
        last = self.layers[-1]
        if isinstance(last, nn.Sequential):
            for module in list(last)[:-1]:
                x = module(x)
        return x

    def classify(self, z: torch.Tensor) -> torch.Tensor:
        """The classifier head alone: logits from a latent vector (``forward(x) == classify(latent(x))``)."""
        return self._classifier()(z)


def with_projection_head(model: LayeredModel, out_dim: int) -> LayeredModel:
    """The network with a projection head, as model-contrastive learning uses it (Li et al.,
    CVPR 2021): the classifier replaced by a projection head Linear(d, d) → ReLU → Linear(d, out_dim) and a classifier Linear(out_dim, C) on the
    projection. With d the latent size, the last block becomes three:
    [what preceded the classifier] + Linear(d, d) + ReLU | Linear(d, out_dim) | Linear(out_dim, C);
    the representation (``latent``) is then the projection, ``out_dim`` wide."""
    classifier = model._classifier()
    d, classes = classifier.in_features, classifier.out_features
    last = model.layers[-1]
    before = list(last)[:-1] if isinstance(last, nn.Sequential) else []
    blocks = list(model.layers[:-1]) + [
        nn.Sequential(*before, nn.Linear(d, d), nn.ReLU(inplace=True)),
        nn.Sequential(nn.Linear(d, out_dim)),
        nn.Sequential(nn.Linear(out_dim, classes)),
    ]
    return LayeredModel(blocks)


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
