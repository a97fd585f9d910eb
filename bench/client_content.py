"""What a client objective finds in its train message besides the model, for the benches that
train clients without a server (``objective_cost.py``, ``e2e_overhead.py``'s plain loop)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def content_for(cfg: Mapping[str, Any], model: torch.nn.Module):  # noqa: ANN201
    """The records of a train message from round 2 on: SCAFFOLD a control variate (zeros: the work
    per step is the same whatever its values), FedGen a freshly initialised generator (the server's
    generator training is not the client's work). Other objectives need nothing."""
    from flwr.app import RecordDict

    from fedmm import protocol
    from fedmm.models.generator import Generator
    from objectives import fedgen, scaffold

    records = {}
    objective = cfg["objective"]["name"]
    if objective.startswith("scaffold"):
        records[scaffold.CONTROL] = protocol.model_to_record(
            {n: np.zeros(tuple(p.shape), np.float32) for n, p in model.named_parameters()})
    elif objective.startswith("fedgen"):
        s = cfg["strategy"]
        gen = Generator(s["noise_dim"], int(cfg["dataset"]["num_classes"]), model.latent_dim, s["hidden_dim"])
        records[fedgen.GENERATOR] = protocol.model_to_record({k: v.numpy() for k, v in gen.state_dict().items()})
    return RecordDict(records)
