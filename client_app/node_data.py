"""A SuperNode's own dataset in deployment: the folder named by its ``data-path`` node config.

A SuperNode started with ``--node-config "data-path='/data/site-a'"`` trains and evaluates on
the dataset in that folder, in any format the local-folder loader of :mod:`fedmm.data` reads
(a ``datasets.save_to_disk`` output, or the CIFAR python batches). The run's ``dataset``
config still describes the data (columns, normalisation, ``num_classes``, ``in_channels``,
``image_size``): only its location comes from the node.

Any problem (missing or unreadable folder, no dataset there, data that does not fit the run's
model) raises :class:`NodeDataError`. Flower turns an exception raised in a ClientApp handler
into an error reply whose ``error.reason`` carries the message; the server logs it and carries
on with the other nodes. The message names the node and the problem, e.g.::

    node data-path='/data/site-a' (node 5206458722, host site-a): folder does not exist
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedmm import protocol
from fedmm.data import TensorData, load_dataset
from fedmm.errors import ConfigError

#: Node config key that points a SuperNode to its dataset folder.
DATA_PATH_KEY = protocol.DATA_PATH_KEY

#: Dataset keys that must agree between the run's model and the node's data.
_SHAPE_KEYS = ("dataset.num_classes", "dataset.in_channels", "dataset.image_size")


class NodeDataError(RuntimeError):
    """This node's dataset cannot be used for the run; the message says which node and why."""


def describe_node(data_path: object, node_id: int) -> str:
    """``node data-path='/x' (node 123, host h)``: how error messages name this node."""
    return f"node {DATA_PATH_KEY}={str(data_path)!r} (node {node_id}, host {socket.gethostname()})"


def _check_folder(path: Path) -> str | None:
    """Why ``path`` cannot hold a dataset, or None when it is a readable folder."""
    if not path.exists():
        return "folder does not exist"
    if not path.is_dir():
        return "not a folder (data-path must name the dataset's folder)"
    if not os.access(path, os.R_OK | os.X_OK):
        return f"folder is not readable by this process (user id {os.getuid()})"
    return None


def _explain(err: ConfigError) -> str:
    """Turn a loader's ConfigError into a sentence about this node's data."""
    if err.key == "dataset.path":
        return f"no dataset found there; expected {err.allowed}"
    if err.key in _SHAPE_KEYS:
        return (
            f"the dataset does not match the run's model: the run config has "
            f"{err.key}={err.value!r}, the data needs {err.allowed}"
        )
    return f"the dataset does not fit the run's dataset config: {err.key}={err.value!r}; allowed: {err.allowed}"


def load_node_data(dataset_cfg: Mapping[str, Any], data_path: object, node_id: int) -> TensorData:
    """The training split of the dataset in ``data_path``, checked against the run's ``dataset`` config.

    Parameters
    ----------
    dataset_cfg : Mapping
        The run's ``dataset`` config group (sent by the server in every message).
    data_path : str or os.PathLike
        The node's ``data-path`` node config value (``~`` is expanded).
    node_id : int
        This SuperNode's id, for the error message.

    Returns
    -------
    TensorData
        The training split. A single-split dataset gives up ``dataset.test_fraction`` of its
        rows to a held-out split that the ClientApp does not use, exactly as on the server.

    Raises
    ------
    NodeDataError
        Naming the node (data path, node id, host) and the problem.
    """
    where = describe_node(data_path, node_id)
    raw = str(data_path).strip()
    if not raw:
        raise NodeDataError(f"{where}: data-path is empty; start the SuperNode with --node-config \"data-path='/path/to/data'\"")
    path = Path(os.path.expanduser(raw))
    problem = _check_folder(path)
    if problem:
        raise NodeDataError(f"{where}: {problem}")
    cfg = dict(dataset_cfg, path=str(path), source="hf")
    try:
        train, _ = load_dataset(cfg)
    except ConfigError as err:
        raise NodeDataError(f"{where}: {_explain(err)}") from err
    except Exception as err:  # a corrupt or half-copied folder, permissions inside it, ...
        raise NodeDataError(f"{where}: could not read the dataset: {type(err).__name__}: {err}") from err
    if len(train) == 0:
        raise NodeDataError(f"{where}: the dataset has no training rows")
    return train
