"""The training group's schedule and budget options: the per-round lr decay, a local-steps budget,
drop_last and gradient clipping (the original codes of FedExP and SCAFFOLD's lab use them)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from client_app.training import local_batches, train
from fedmm.config import compose
from fedmm.data import ImageNormalize, TensorData
from fedmm.training import TrainingSettings, round_lr
from objectives.base import LocalUpdate


def rows(n: int) -> TensorData:
    g = torch.Generator().manual_seed(0)
    return TensorData(x=torch.randint(0, 256, (n, 1, 4, 4), dtype=torch.uint8, generator=g),
                      y=torch.arange(n) % 3, ids=None, transform=ImageNormalize((0.5,), (0.5,)))


def test_round_lr_decays_every_round_and_at_the_decay_rounds() -> None:
    t = TrainingSettings(lr=0.1, lr_round_decay=0.998)
    assert round_lr(t, 1) == pytest.approx(0.1)  # round 1 trains with lr itself
    assert round_lr(t, 2) == pytest.approx(0.0998)
    assert round_lr(t, 101) == pytest.approx(0.1 * 0.998**100)
    both = t.replace(lr_decay_rounds=[3], lr_decay_factor=0.5)
    assert [round_lr(both, r) for r in (2, 3)] == pytest.approx([0.0998, 0.05 * 0.998**2])
    assert round_lr(TrainingSettings(lr=0.1), 500) == 0.1  # the default: no decay


def sizes(training: TrainingSettings, n: int) -> list[int]:
    return [len(y) for _, y in local_batches(rows(n), training, torch.Generator().manual_seed(1), torch.device("cpu"))]


def test_local_steps_budget_and_drop_last() -> None:
    # 23 rows, batch 10: an epoch is 10, 10, 3 (or 10, 10 with drop_last)
    assert sizes(TrainingSettings(batch_size=10, local_epochs=2), 23) == [10, 10, 3, 10, 10, 3]
    assert sizes(TrainingSettings(batch_size=10, local_epochs=2, drop_last=True), 23) == [10, 10, 10, 10]
    # 20 steps whatever the epochs: 7 passes of 3 batches, the last cut after 2
    assert sizes(TrainingSettings(batch_size=10, local_epochs=5, local_steps=20), 23) == [10, 10, 3] * 6 + [10, 10]
    assert sizes(TrainingSettings(batch_size=10, local_steps=5, drop_last=True), 23) == [10] * 5
    # fewer rows than a batch: drop_last keeps the only batch (no client without a step)
    assert sizes(TrainingSettings(batch_size=10, local_steps=5, drop_last=True), 7) == [7] * 5
    assert sizes(TrainingSettings(batch_size=10, local_epochs=2, drop_last=True), 7) == [7, 7]
    assert sizes(TrainingSettings(batch_size=10, local_epochs=1), 0) == []  # no rows: no step, no endless loop
    assert sizes(TrainingSettings(batch_size=10, local_steps=3), 0) == []
    # every pass is a fresh permutation: each row once per pass
    data = rows(23)
    seen = [y for _, y in local_batches(data, TrainingSettings(batch_size=10, local_steps=6), torch.Generator().manual_seed(1), torch.device("cpu"))]
    assert sorted(torch.cat(seen[:3]).tolist()) == sorted(data.y.tolist())


class Steep(LocalUpdate):
    """A gradient far above the clipping norm (the loss times 1000)."""

    def gradient(self, model, x, y):
        loss, _ = self.loss(model, x, y)
        (loss * 1000).backward()
        return loss


def applied_norms(fn) -> list[float]:  # noqa: ANN001
    """The gradient norm every SGD step of ``fn()`` applies (read by a hook on torch's optimizers,
    just before each step)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    norms: list[float] = []

    def record(optimizer, args, kwargs):  # noqa: ANN001, ANN202
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norms.append(float(torch.sqrt(sum((g**2).sum() for g in grads))))

    handle = register_optimizer_step_pre_hook(record)
    try:
        fn()
    finally:
        handle.remove()
    return norms


def test_clip_grad_norm_bounds_every_step_of_any_objective() -> None:
    run = compose(["training.clip_grad_norm=10", "training.local_epochs=1", "training.batch_size=8"])
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3))
    norms = applied_norms(lambda: train(model, rows(24), Steep(run), run.training, 1, torch.Generator().manual_seed(0),
                                        torch.device("cpu")))
    assert len(norms) == 3 and max(norms) == pytest.approx(10.0, rel=1e-4)
    unclipped = applied_norms(lambda: train(model, rows(24), Steep(run), run.training.replace(clip_grad_norm=None), 1,
                                            torch.Generator().manual_seed(0), torch.device("cpu")))
    assert min(unclipped) > 10


def test_options_are_validated_and_old_runs_resume_without_them() -> None:
    from fedmm.errors import ConfigError

    for bad in ("training.local_steps=0", "training.clip_grad_norm=-1", "training.lr_round_decay=1.5"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            compose([bad])
    old = {k: v for k, v in TrainingSettings().to_dict().items() if k not in TrainingSettings.added}
    assert TrainingSettings.from_dict(old) == TrainingSettings()
    assert np.isclose(round_lr(TrainingSettings.from_dict(old), 50), TrainingSettings().lr)
