"""The client-data abstraction: a split held in memory, and the fast in-memory batching.

:class:`TensorData` holds any input tensor whose first dimension is the sample (uint8 images
``[N, C, H, W]`` today, int64 token ids ``[N, T]`` for text), int64 labels, optional natural ids,
and a ``transform`` that turns a raw batch into model input on a device
(:class:`ImageNormalize` for images, :class:`Identity` for token ids). The small models of the
FedMR / FedCross experiments train much faster from such tensors than through a DataLoader.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


class Identity:
    """Model input = the raw batch (token ids)."""

    def prepare(self, device: str | torch.device) -> Identity:
        return self

    def __call__(self, xb: torch.Tensor) -> torch.Tensor:
        return xb

    def __repr__(self) -> str:
        return "Identity()"


class ImageNormalize:
    """uint8 images to float: ``x = (uint8 / 255 - mean) / std`` per channel, folded into one
    multiply and one subtract."""

    def __init__(self, mean: Sequence[float] | float, std: Sequence[float] | float) -> None:
        self.mean = torch.as_tensor(mean, dtype=torch.float32).flatten()
        self.std = torch.as_tensor(std, dtype=torch.float32).flatten()
        if self.mean.numel() != self.std.numel():
            raise ValueError("mean and std need the same number of values")
        self._scale = self._shift = None

    def prepare(self, device: str | torch.device) -> ImageNormalize:
        """A copy whose constants live on ``device`` (made once per pass over the data)."""
        out = ImageNormalize.__new__(ImageNormalize)
        out.mean, out.std = self.mean, self.std
        out._scale = (1.0 / (255.0 * self.std)).view(1, -1, 1, 1).to(device)
        out._shift = (self.mean / self.std).view(1, -1, 1, 1).to(device)
        return out

    def __call__(self, xb: torch.Tensor) -> torch.Tensor:
        if self._scale is None:
            raise RuntimeError("call prepare(device) first")
        return xb.float().mul_(self._scale).sub_(self._shift)

    def __repr__(self) -> str:
        return f"ImageNormalize(mean={self.mean.tolist()}, std={self.std.tolist()})"


@dataclass(frozen=True, eq=False)
class TensorData:
    """One split of a dataset held in memory.

    ``eq=False`` keeps hashing by identity, so an instance can be a cache key.

    Attributes
    ----------
    x : torch.Tensor
        Inputs, first dimension N: uint8 images ``[N, C, H, W]`` or int64 token ids ``[N, T]``.
    y : torch.Tensor
        int64 labels, shape ``[N]``.
    ids : numpy.ndarray or None
        Natural-partition id of every row (e.g. FEMNIST ``writer_id``), or None.
    transform : ImageNormalize or Identity
        Turns a raw batch into model input.
    """

    x: torch.Tensor
    y: torch.Tensor
    ids: np.ndarray | None = None
    transform: ImageNormalize | Identity = field(default_factory=Identity)

    def __post_init__(self) -> None:
        if isinstance(self.transform, ImageNormalize):
            if self.x.dtype != torch.uint8 or self.x.ndim != 4:
                raise ValueError(f"images must be uint8 [N, C, H, W], got {self.x.dtype} {tuple(self.x.shape)}")
        if self.x.ndim < 1:
            raise ValueError("x needs a first (sample) dimension")
        if self.y.dtype != torch.int64 or self.y.ndim != 1:
            raise ValueError(f"y must be int64 [N], got {self.y.dtype} {tuple(self.y.shape)}")
        if len(self.x) != len(self.y) or (self.ids is not None and len(self.ids) != len(self.y)):
            raise ValueError("x, y and ids must have the same length")

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, indices: np.ndarray) -> TensorData:
        """Return the rows ``indices`` as a new :class:`TensorData` (copies; same transform)."""
        idx = np.array(indices, dtype=np.int64)  # a writable copy: torch rejects read-only arrays
        tidx = torch.from_numpy(idx)
        return TensorData(
            x=self.x[tidx], y=self.y[tidx], ids=None if self.ids is None else self.ids[idx], transform=self.transform
        )


def batches(
    data: TensorData,
    batch_size: int,
    *,
    shuffle: bool,
    generator: torch.Generator | None,
    device: str | torch.device = "cpu",
    drop_last: bool = False,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield model-ready minibatches from an in-memory split.

    Parameters
    ----------
    data : TensorData
        The split to iterate over; its ``transform`` makes each batch model input.
    batch_size : int
        Rows per batch; the last batch may be smaller (kept unless ``drop_last``).
    shuffle : bool
        Visit the rows in a random order drawn from ``generator``.
    generator : torch.Generator or None
        Source of the permutation (the global RNG when None).
    device : str or torch.device
        Where the batches are placed.
    drop_last : bool
        Leave out the last batch when it has fewer than ``batch_size`` rows.

    Yields
    ------
    (torch.Tensor, torch.Tensor)
        Model inputs ``[B, ...]`` and int64 labels ``[B]``.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    n = len(data)
    if isinstance(data.transform, ImageNormalize) and data.transform.mean.numel() not in (1, data.x.shape[1]):
        raise ValueError(f"mean and std need 1 or {data.x.shape[1]} values")
    transform = data.transform.prepare(device)
    x_all, y_all = data.x.to(device), data.y.to(device)
    if shuffle:
        gen_device = generator.device if generator is not None else "cpu"
        order = torch.randperm(n, generator=generator, device=gen_device).to(device)
    stop = n - n % batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        if shuffle:
            idx = order[start : start + batch_size]
            xb, yb = x_all[idx], y_all[idx]
        else:
            xb, yb = x_all[start : start + batch_size], y_all[start : start + batch_size]
        yield transform(xb), yb
