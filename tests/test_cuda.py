"""On a CUDA device (marker ``cuda``; skipped where there is none, run by bench/gpu_session.py on a
lent GPU): the in-process engine trains and evaluates on the GPU, its numbers agree with the CPU's
within the arithmetic's difference, GPU memory does not grow from round to round (clients and
server share the process), a real out-of-memory error becomes the ClientApp's advice, and the
vectorized path trains each client as the one-at-a-time loop does on the same GPU: weights,
BatchNorm statistics and dropout masks.

Comparisons of one CUDA computation with another run with TF32 off (:func:`no_tf32`): by default
cuDNN may round float32 convolution inputs to TF32's 10-bit mantissa (``torch.backends.cudnn.
allow_tf32`` is true), an error of ~1e-3 relative per product that says nothing about whether two
paths compute the same thing. The client-by-client comparisons run in float64 besides
(tests/test_vectorized.py, ``in_float64``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedmm.results import read_metrics

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu_session.py)")]


@pytest.fixture
def no_tf32():  # noqa: ANN201
    """Float32 matrix products and convolutions in full float32 for the test (restored after)."""
    held = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = held


def run(tmp_path: Path, name: str, device: str, rounds: int = 2) -> list[dict]:
    from fedmm.config import compose, to_container
    from launch.cli import run_job

    cfg = to_container(compose([f"num_rounds={rounds}", "num_clients=4", "clients_per_round=2", "training.local_epochs=1",
                                f"training.device={device}", "simulation.engine=local", f"output_dir={tmp_path / name}"]))
    return read_metrics(run_job(cfg))


def test_the_in_process_engine_trains_on_the_gpu_and_agrees_with_the_cpu(tmp_path: Path) -> None:
    torch.cuda.reset_peak_memory_stats()
    gpu = run(tmp_path, "gpu", "cuda")
    assert torch.cuda.max_memory_allocated() > 0  # the clients and the evaluation ran on the device
    cpu = run(tmp_path, "cpu", "cpu")
    assert [r["replies"] for r in gpu[1:]] == [r["replies"] for r in cpu[1:]] == [2, 2]
    assert [r["bytes_sent"] for r in gpu] == [r["bytes_sent"] for r in cpu]
    for a, b in zip(gpu, cpu):  # cuDNN's kernels sum in another order: close, not equal
        assert abs(a["accuracy"] - b["accuracy"]) <= 0.03 and a["loss"] == pytest.approx(b["loss"], rel=0.02), (a, b)


def test_gpu_memory_does_not_grow_from_round_to_round(tmp_path: Path) -> None:
    from fedmm.config import compose, to_container
    from fedmm.observers import RunObserver
    from launch.cli import run_job

    allocated: list[int] = []

    class Measured(RunObserver):
        def on_round_end(self, server_round: int) -> None:
            torch.cuda.synchronize()
            allocated.append(torch.cuda.memory_allocated())

    run_job(to_container(compose(["num_rounds=5", "num_clients=4", "clients_per_round=2", "training.local_epochs=1",
                                  "training.device=cuda", f"output_dir={tmp_path / 'run'}"])), observers=[Measured()])
    assert len(allocated) == 5
    assert max(allocated[1:]) <= allocated[1] + 8 * 2**20, allocated  # flat after the first round


def test_a_real_out_of_memory_error_becomes_advice_and_frees_the_device() -> None:
    from client_app import work
    from fedmm.config import compose

    run_settings = compose(["training.batch_size=64"])
    before = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(work.ClientOutOfMemory) as caught:
        with work.cuda_memory_advice(run_settings, "local training"):
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    assert "one ClientApp at a time" in str(caught.value) and "training.batch_size=64" in str(caught.value)
    assert "MiB free of" in str(caught.value)
    assert torch.cuda.memory_allocated() == before


def test_vectorized_rounds_run_on_the_gpu_under_auto_with_the_sequential_numbers(tmp_path: Path, stacked_calls: list[int],
                                                                                 no_tf32: None) -> None:
    """``simulation.vectorize=auto`` trains each round's clients as one computation on CUDA; the
    numbers are those of one client at a time on the same GPU, within the same-results tolerance."""
    from fedmm.config import compose, to_container
    from launch.cli import run_job

    from tests.test_same_results import assert_same_results

    rows = {}
    for mode in ("off", "auto"):
        cfg = to_container(compose(["num_rounds=2", "num_clients=6", "clients_per_round=3", "training.local_epochs=1",
                                    "strategy=fedmr", "model=lenet", "training.device=cuda", f"simulation.vectorize={mode}",
                                    f"output_dir={tmp_path / mode}"]))
        rows[mode] = read_metrics(run_job(cfg))
    assert stacked_calls == [3, 3]
    assert_same_results(rows["auto"], rows["off"])


#: (model, objective): plain layers (lenet), BatchNorm's statistics (resnet20, with FedRL's review
#: pass in eval mode), dropout's masks (vgg16), SCAFFOLD's gradient correction and clipping (cnn).
CUDA_PAIRS = [("lenet", "ce"), ("resnet20", "ce"), ("resnet20", "fedrl"), ("vgg16", "ce"), ("cnn", "scaffold")]


@pytest.mark.parametrize(("model_name", "objective"), CUDA_PAIRS, ids=[f"{m}-{o}" for m, o in CUDA_PAIRS])
def test_the_vectorized_path_trains_each_client_as_the_loop_does_on_cuda(model_name: str, objective: str, no_tf32: None) -> None:
    """tests/test_vectorized.py's comparison on the GPU: every client's parameters and buffers
    (BatchNorm's running statistics among them), its loss and its reply records within 1e-5 of
    the one-at-a-time loop on the same device, ragged clients included."""
    from tests.test_vectorized import SIZES, TRAINING, VGG_SIZES, VGG_TRAINING, assert_pair

    vgg = model_name == "vgg16"
    assert_pair(model_name, objective, VGG_TRAINING if vgg else TRAINING, VGG_SIZES if vgg else SIZES,
                device=torch.device("cuda"))


def test_the_dropout_masks_are_the_forward_passes_own_on_cuda() -> None:
    """The fused CUDA dropout kernel's masks, replayed from each client's state of the device's
    generator, are the ones the forward pass applies (exactly); another seed's are not."""
    from tests.test_vectorized import assert_dropout_masks_replayed

    assert_dropout_masks_replayed(torch.device("cuda"))
    with pytest.raises(AssertionError, match="dropout call 0"):
        assert_dropout_masks_replayed(torch.device("cuda"), replay_seed=8)


def test_the_training_loops_read_the_device_once_per_call() -> None:
    """On the GPU: the loss stays on the device during the epochs and is read once at the end,
    on both paths (tests/test_vectorized.py checks the same on the CPU)."""
    from tests.test_vectorized import assert_one_read_per_call

    assert_one_read_per_call(torch.device("cuda"))
