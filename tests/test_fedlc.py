"""FedLC (objectives/fedlc.py, one file): its calibrated loss by hand on a client with an absent
class, from the data summary the loop gives every objective before training, and its two
training paths equal (tests/test_vectorized.py compares every vectorizable objective, this one
with a class the client has no row of)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedmm.data import TensorData
from objectives.base import build_local_update
from objectives.fedlc import FedLC, calibration
from tests.conftest import composed


def client(labels: list[int]) -> TensorData:
    """A client of 4-feature rows whose labels are ``labels`` (10 classes in the dataset)."""
    torch.manual_seed(0)
    return TensorData(x=torch.randn(len(labels), 4), y=torch.tensor(labels))


def test_the_calibrated_loss_by_hand_on_a_client_with_an_absent_class() -> None:
    """Rows of classes 0 (×3) and 1 (×1), none of the other classes: the loss of a batch is the
    cross-entropy of z_c − τ·n_c^(−1/4), the absent classes out of the softmax, by hand."""
    update = build_local_update(composed("objective=fedlc", "objective.tau=0.5"))
    assert isinstance(update, FedLC) and not FedLC.vectorizable()
    data = client([0, 0, 0, 1])
    model = nn.Linear(4, 10)
    update.start(model, data, 1)
    counts = update.label_counts()
    assert counts.tolist() == [3, 1] + [0] * 8
    offset = calibration(counts, 0.5)
    assert offset[0] == pytest.approx(0.5 * 3 ** -0.25) and offset[1] == pytest.approx(0.5) and math.isinf(offset[5])
    loss, logits = update.loss(model, data.x, data.y)
    z = model(data.x).detach()
    by_hand = 0.0
    for row, label in zip(z, data.y.tolist()):
        kept = {c: float(row[c]) - float(offset[c]) for c in (0, 1)}  # the absent classes add e^{−∞} = 0
        by_hand += -(kept[label] - math.log(sum(math.exp(v) for v in kept.values())))
    assert float(loss) == pytest.approx(by_hand / len(data.y), rel=1e-6)
    assert torch.equal(logits, model(data.x))  # the logits returned are the model's own
    loss.backward()
    assert torch.isfinite(model.weight.grad).all() and model.bias.grad[2:].abs().max() == 0  # no pull on absent classes


def test_the_data_summary_is_known_from_start_and_follows_the_rows() -> None:
    update = build_local_update(composed("objective=fedlc"))
    with pytest.raises(RuntimeError, match="from start"):
        update.label_counts()
    update.start(nn.Linear(4, 10), client([2, 2, 9]), 3)
    assert update.label_counts().tolist() == [0, 0, 2] + [0] * 6 + [1]


def test_a_whole_run_gives_the_same_numbers_on_both_training_paths(tmp_path, stacked_calls) -> None:  # noqa: ANN001
    """objective=fedlc in a real run: the data summary reaches the objective on both paths (one
    client at a time, a round's clients as one computation), with the same numbers."""
    from tests.test_same_results import assert_same_results
    from tests.test_vectorized_rounds import ON, run

    one_at_a_time = run(tmp_path, "off", "objective=fedlc", "partition.alpha=0.1", "simulation.vectorize=off")
    together = run(tmp_path, "on", "objective=fedlc", "partition.alpha=0.1", ON)
    assert stacked_calls == [3, 3]
    assert_same_results(together, one_at_a_time)
