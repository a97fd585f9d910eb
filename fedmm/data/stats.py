"""Label statistics of partitions: per-client label counts and their bubble plot."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def label_histograms(labels: np.ndarray, partitions: Sequence[np.ndarray], num_classes: int) -> np.ndarray:
    """Count the labels of every partition.

    Parameters
    ----------
    labels : numpy.ndarray
        Labels of all rows, ``[N]``.
    partitions : sequence of numpy.ndarray
        Row indices of each partition.
    num_classes : int
        Number of classes ``C``.

    Returns
    -------
    numpy.ndarray
        int64 counts of shape ``[P, C]``.
    """
    labels = np.asarray(labels, dtype=np.int64)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must lie in 0..{num_classes - 1}")
    hist = np.zeros((len(partitions), num_classes), dtype=np.int64)
    for row, part in enumerate(partitions):
        hist[row] = np.bincount(labels[np.asarray(part, dtype=np.int64)], minlength=num_classes)
    return hist


def plot_label_histograms(hist: np.ndarray, path: str | os.PathLike) -> None:
    """Save a bubble plot of the per-client label counts as a PNG.

    x is the client id, y the class, and each marker's area is proportional to the
    number of samples of that class on that client (as Fig. 3 of the FedCross paper).

    Parameters
    ----------
    hist : numpy.ndarray
        ``[P, C]`` counts from :func:`label_histograms`.
    path : str or os.PathLike
        Output file; parent folders are created.
    """
    # Figure + Agg canvas directly: no pyplot global state, works headless.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    hist = np.asarray(hist)
    num_clients, num_classes = hist.shape
    clients, classes = np.nonzero(hist)
    counts = hist[clients, classes].astype(float)
    max_area = 400.0 if num_clients <= 20 else max(30.0, 400.0 * 20 / num_clients)
    sizes = counts / counts.max() * max_area if counts.size else counts

    fig = Figure(figsize=(min(3 + 0.35 * num_clients, 20), min(2 + 0.3 * num_classes, 16)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.scatter(clients, classes, s=sizes, c="tab:red", alpha=0.6, edgecolors="none")
    if counts.size:  # what a bubble's area means: three reference sizes
        refs = sorted({int(v) for v in np.quantile(counts, [0.1, 0.5, 1.0]).round()} - {0})
        handles = [ax.scatter([], [], s=r / counts.max() * max_area, c="tab:red", alpha=0.6, edgecolors="none") for r in refs]
        ax.legend(handles, [f"{r} samples" for r in refs], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False, labelspacing=1.8, borderpad=1.0)
    ax.set_xlabel("Client ID")
    ax.set_ylabel("Class label")
    ax.set_xlim(-0.7, num_clients - 0.3)
    ax.set_ylim(-0.7, num_classes - 0.3)
    if num_clients <= 30:
        ax.set_xticks(range(num_clients))
    if num_classes <= 20:
        ax.set_yticks(range(num_classes))
    ax.grid(True, linestyle=":", alpha=0.5)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=120, bbox_inches="tight")
