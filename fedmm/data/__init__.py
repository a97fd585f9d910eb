"""Datasets, federated partitions and fast in-memory minibatches, split by job.

- :mod:`fedmm.data.spec`: validation of the ``dataset`` / ``partition`` config groups, and
  :class:`InputSpec` (what a model needs to know about its input);
- :mod:`fedmm.data.sources`: the embedded mnist5k subset, local folders, the Hugging Face hub;
- :mod:`fedmm.data.partition`: iid / Dirichlet / natural partitions (flwr-datasets);
- :mod:`fedmm.data.tensors`: :class:`TensorData` and :func:`batches`;
- :mod:`fedmm.data.stats`: label histograms.

Importing this package stays light: ``datasets``, ``flwr_datasets`` and ``matplotlib`` are
imported when first needed.
"""

from __future__ import annotations

from fedmm.data.partition import load_partition, local_split, local_test_fraction, partition_indices
from fedmm.data.sources import load_dataset
from fedmm.data.spec import (
    DATASET_NAMES,
    HOLDOUT_SEED,
    PARTITION_NAMES,
    InputSpec,
    check_dataset_config,
    check_partition_config,
    expected_num_classes,
    input_spec,
)
from fedmm.data.stats import label_histograms, plot_label_histograms
from fedmm.data.tensors import Identity, ImageNormalize, TensorData, batches

__all__ = [
    "DATASET_NAMES", "HOLDOUT_SEED", "PARTITION_NAMES", "Identity", "ImageNormalize", "InputSpec", "TensorData",
    "batches", "check_dataset_config", "check_partition_config", "expected_num_classes", "input_spec",
    "label_histograms", "load_dataset", "load_partition", "local_split", "local_test_fraction", "partition_indices",
    "plot_label_histograms",
]
