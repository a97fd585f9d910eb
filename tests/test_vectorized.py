"""K clients trained as one computation (client_app/vectorized.py) against the sequential loop
(client_app/training.py): each client's final parameters and buffers, and its mean training loss,
equal the loop's within 1e-5 relative on the CPU, for every model and with ragged clients (a
short last batch, a client with fewer rows than a batch, clients that finish early), momentum,
weight decay, the round's lr decay and gradient clipping.

`resnet20` is compared in float64: in float32 its BatchNorm layers amplify the rounding of the
convolution's algorithm (the sequential loop against itself with oneDNN's convolution switched off
moves the first convolution's weights by 7e-5 after one step of 16 rows), so float32 cannot tell
a wrong computation from another order of summation; in float64 the rounding is far below 1e-5."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from client_app.training import train_epochs
from client_app.vectorized import train_stacked
from fedmm.data.spec import InputSpec
from fedmm.models import build_model
from fedmm.training import TrainingSettings
from objectives.base import build_local_update

CPU = torch.device("cpu")


# The clients' data and starting weights are the bench's (bench/vectorized_throughput.py).
_spec = importlib.util.spec_from_file_location("vectorized_throughput",
                                               Path(__file__).resolve().parents[1] / "bench" / "vectorized_throughput.py")
_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bench)
client_data, starting_states = _bench.client_data, _bench.starting_states

#: Rows of each client: two full batches and a short one; fewer rows than a batch; one batch
#: exactly; three full batches (clients finish at different steps).
SIZES = [37, 9, 16, 48]


def sequential(model_name: str, states, datas, training: TrainingSettings, server_round: int, seeds: list[int]):
    """Each client trained alone by the ClientApp's loop, with the plain objective."""
    from fedmm.config import compose

    out = []
    for state, data, seed in zip(states, datas, seeds):
        client = make_model(model_name)
        client.load_state_dict(state)
        loss, _ = train_epochs(client, data, build_local_update(compose([])), training, server_round,
                               torch.Generator().manual_seed(seed), CPU)
        out.append(({n: v.detach().clone() for n, v in client.state_dict().items()}, loss))
    return out


MNIST = InputSpec(kind="image", num_classes=10, shape=(1, 28, 28))
CIFAR = InputSpec(kind="image", num_classes=10, shape=(3, 32, 32))
MODELS_ARGS = {"lenet": ("lenet", MNIST), "cnn": ("cnn", MNIST), "resnet20": ("resnet20", CIFAR)}
TRAINING = TrainingSettings().replace(local_epochs=2, batch_size=16, lr=0.05, momentum=0.5, weight_decay=1e-3,
                                      lr_round_decay=0.99, clip_grad_norm=2.0)


class Float64(torch.nn.Module):
    """A model computing in float64 (its input cast), for both paths alike."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.double())


def make_model(model_name: str) -> torch.nn.Module:
    model = build_model(*MODELS_ARGS[model_name])
    return Float64(model) if model_name in IN_FLOAT64 else model


#: Compared in float64 (see the module's docstring).
IN_FLOAT64 = {"resnet20"}


def assert_same(model_name: str, training: TrainingSettings, seeds: list[int], vector_seeds: list[int] | None = None) -> None:
    spec = MODELS_ARGS[model_name][1]
    torch.manual_seed(0)
    model = make_model(model_name)
    states = starting_states(model, len(SIZES))
    datas = [client_data(n, 10 + i, spec.shape) for i, n in enumerate(SIZES)]
    want = sequential(model_name, states, datas, training, 3, seeds)
    got, _ = train_stacked(model, states, datas, training, 3,
                           [torch.Generator().manual_seed(s) for s in (vector_seeds or seeds)], CPU)
    for client, ((state, loss), result) in enumerate(zip(want, got)):
        assert set(result.state) == set(state)
        for key, value in state.items():
            torch.testing.assert_close(result.state[key], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"client {client} ({SIZES[client]} rows), {key}: {m}")
        assert result.train_loss == pytest.approx(loss, rel=1e-5), client


@pytest.mark.parametrize("model_name", ["lenet", "cnn", "resnet20"])
def test_each_client_ends_where_the_sequential_loop_ends(model_name: str) -> None:
    assert_same(model_name, TRAINING, [1, 2, 3, 4])


def test_plain_sgd_and_local_steps() -> None:
    assert_same("lenet", TrainingSettings().replace(local_epochs=1, local_steps=3, batch_size=16, momentum=0.0), [5, 6, 7, 8])


def test_a_wrong_data_order_is_caught() -> None:
    """The comparison can fail: the clients' generators swapped (each draws another's order)."""
    with pytest.raises(AssertionError):
        assert_same("lenet", TRAINING, [1, 2, 3, 4], vector_seeds=[2, 1, 3, 4])


def test_a_state_that_does_not_fit_the_model_is_refused() -> None:
    model = build_model("lenet", MNIST)
    state = dict(model.state_dict())
    state.pop(next(iter(state)))
    with pytest.raises(ValueError, match="client 0's state does not fit the model: missing"):
        train_stacked(model, [state], [client_data(8, 0, (1, 28, 28))], TRAINING, 1, [torch.Generator()], CPU)
