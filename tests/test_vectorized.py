"""K clients trained as one computation (client_app/vectorized.py) against the sequential loop
(client_app/training.py): for every vectorized (model, objective) pair, each client's final
parameters and buffers, its mean training loss and its objective's reply records equal the
loop's within 1e-5 relative on the CPU, with ragged clients (a short last batch, a client with
fewer rows than a batch, clients that finish early), momentum, weight decay, the round's lr decay,
gradient clipping, BatchNorm statistics and dropout.

`lenet` is compared in float32, the others in float64 (model and inputs): in float32 BatchNorm
layers amplify the rounding of the convolution's algorithm (the sequential loop against itself
with oneDNN's convolution switched off moves resnet20's first convolution by 7e-5 after one step
of 16 rows), and the `cnn`'s 1.66 M parameters, trained 6 steps with momentum and FedDyn's linear
term, drift by float32 rounding alone to 4e-5 relative on a few weights near zero (the stacked
batches sum in another order); float32 cannot tell a wrong computation from another order of
summation there, and in float64 the rounding is far below 1e-5."""

from __future__ import annotations

import copy
import functools
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from client_app.training import train_epochs
from client_app.vectorized import train_stacked
from fedmm.data import TensorData
from fedmm.data.spec import InputSpec
from fedmm.data.tensors import Identity
from fedmm.models import build_model
from fedmm.training import TrainingSettings
from objectives.base import build_local_update
from tests.conftest import composed

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
#: vgg16 (33.6 M parameters, float64): a short batch and clients that finish at different steps.
VGG_SIZES = [5, 2]

MNIST = InputSpec(kind="image", num_classes=10, shape=(1, 28, 28))
CIFAR = InputSpec(kind="image", num_classes=10, shape=(3, 32, 32))
SPECS = {"lenet": MNIST, "cnn": MNIST, "resnet20": CIFAR, "vgg16": CIFAR}
#: Compared in float64 (see the module's docstring).
IN_FLOAT64 = {"cnn", "resnet20", "vgg16"}
TRAINING = TrainingSettings().replace(local_epochs=2, batch_size=16, lr=0.05, momentum=0.5, weight_decay=1e-3,
                                      lr_round_decay=0.99, clip_grad_norm=2.0)
VGG_TRAINING = TRAINING.replace(local_epochs=1, batch_size=4)

def vectorizable_objectives() -> list[str]:
    """Every objective found by discovery whose clients can train as one computation (derived
    from what it defines: ``LocalUpdate.vectorizable``): a new one is compared with no list edited."""
    from fedmm.settings import discover

    return sorted(name for name, settings in discover("objective").items() if not settings.objective_class.vectorizable())


OBJECTIVES = vectorizable_objectives()
#: Settings that make some objectives' own terms larger than their defaults (the comparison runs
#: every objective of :data:`OBJECTIVES`; these only make it stricter where a default term is small).
LARGER_TERMS = {"fedprox": ("objective.mu=0.5",), "fedrl": ("objective.mu=1.0",),
                "scaffold": ("objective.momentum=0.3", "objective.clip_norm=1.0")}
ROUND = 3


def run_of(objective: str) -> tuple[str, ...]:
    """The overrides of a run with ``objective``: the method it pairs with (its declaration's
    ``server``), and any larger terms."""
    from fedmm.settings import discover

    server = discover("objective")[objective].server
    return (f"objective={objective}", *((f"strategy={server}",) if server else ()), *LARGER_TERMS.get(objective, ()))


def in_float64(model_name: str, device: torch.device) -> bool:
    """Compared in float64: the models of :data:`IN_FLOAT64`, and every model on CUDA (cuDNN
    chooses among convolution algorithms, FFT and Winograd among them, whose float32 error alone
    exceeds the comparison's 1e-5; in float64 TF32 does not apply either)."""
    return model_name in IN_FLOAT64 or device.type == "cuda"


def datas_for(model_name: str, sizes: list[int], device: torch.device = CPU) -> list[TensorData]:
    spec = SPECS[model_name]
    datas = [client_data(n, 10 + i, spec.shape) for i, n in enumerate(sizes)]
    if in_float64(model_name, device):  # the same rows, normalized once, as float64 model inputs
        datas = [TensorData(x=d.transform.prepare(CPU)(d.x).double(), y=d.y, transform=Identity()) for d in datas]
    return datas


@functools.lru_cache(maxsize=2)
def _built(model_name: str, double: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(model_name, SPECS[model_name])
    return model.double() if double else model


def make_model(model_name: str, device: torch.device = CPU) -> torch.nn.Module:
    """The model, initialised once per test file (vgg16's 33.6 M parameters take a while); a copy each call."""
    return copy.deepcopy(_built(model_name, in_float64(model_name, device)))


def node_records(objective: str, model: torch.nn.Module, client: int) -> tuple[dict, dict]:
    """The train message's extra records and the node's state records of one client (SCAFFOLD's
    c and c_i, FedDyn's g_k: seeded, non-zero, float32)."""
    from flwr.app import MetricRecord

    from fedmm import protocol
    from objectives import feddyn, scaffold

    content: dict = {}
    state: dict = {}
    gen = torch.Generator().manual_seed(100 + client)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}

    def noise(scale: float) -> dict[str, np.ndarray]:
        return {n: (scale * torch.randn(shape, generator=gen)).numpy() for n, shape in shapes.items()}

    if objective == "scaffold":
        content[scaffold.CONTROL] = protocol.model_to_record(noise(0.05))
        state[scaffold.CONTROL_STATE] = protocol.model_to_record(noise(0.05))
        state[scaffold.CONTROL_AGE_STATE] = MetricRecord({"rounds": 2})
    if objective == "feddyn":
        state[feddyn.GRADIENT_STATE] = protocol.model_to_record(noise(0.01))
    return content, state


def objectives_for(objective: str, model_name: str, states, records: list[tuple[dict, dict]], datas: list[TensorData],
                   device: torch.device = CPU) -> list:
    """Each client's objective, started on its received model and its rows (as the training loops
    start it), with its records (``node_records``; records are only read, so both paths share them)."""
    from flwr.app import RecordDict

    run = composed(*run_of(objective))
    held = make_model(model_name, device)
    updates = []
    for start, (content, kept), data in zip(states, records, datas):
        held.load_state_dict(start)
        state = RecordDict()
        update = build_local_update(run, state, RecordDict(dict(content)))
        update.own_state()  # the node's state belongs to this run
        for key, record in kept.items():
            state[key] = record
        update.start(held, data, ROUND)
        updates.append(update)
    return updates


def reply_records(update, model: torch.nn.Module) -> dict[str, np.ndarray]:
    from fedmm import protocol

    out = {}
    for name, record in update.end(model).items():
        out.update({f"{name}/{k}": np.array(v) for k, v in protocol.record_to_model(record).items()})
    out.update({f"metric/{k}": np.array(v) for k, v in update.metrics().items()})
    return out


def assert_pair(model_name: str, objective: str, training: TrainingSettings = TRAINING, sizes: list[int] = SIZES,
                vector_seeds: list[int] | None = None, device: torch.device = CPU) -> None:
    """Both paths on ``device`` (on CUDA: in float64, :func:`in_float64`), each client's results
    compared within 1e-5 relative."""
    seeds = [1 + i for i in range(len(sizes))]
    model = make_model(model_name, device)
    states = starting_states(model, len(sizes))
    datas = datas_for(model_name, sizes, device)
    records = [node_records(objective, model, client) for client in range(len(sizes))]
    # the sequential loop, one client after another (the ClientApp's path)
    want = []
    for update, state, data, seed in zip(objectives_for(objective, model_name, states, records, datas, device), states, datas, seeds):
        client = make_model(model_name, device)
        client.load_state_dict(state)
        torch.manual_seed(seed)  # dropout draws from the global generator (and CUDA's)
        loss, _ = train_epochs(client, data, update, training, ROUND, torch.Generator().manual_seed(seed), device)
        want.append(({n: v.detach().clone() for n, v in client.state_dict().items()}, loss, reply_records(update, client)))
    # all clients as one computation
    updates = objectives_for(objective, model_name, states, records, datas, device)
    vector_seeds = vector_seeds or seeds
    got, _ = train_stacked(model, states, datas, training, ROUND, [torch.Generator().manual_seed(s) for s in vector_seeds],
                           device, updates, dropout_seeds=vector_seeds)
    held = make_model(model_name, device)
    for client, ((state, loss, records), result, update) in enumerate(zip(want, got, updates)):
        assert set(result.state) == set(state)
        for key, value in state.items():
            torch.testing.assert_close(result.state[key], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"client {client} ({sizes[client]} rows), {key}: {m}")
        assert result.train_loss == pytest.approx(loss, rel=1e-5), client
        held.load_state_dict(result.state)
        mine = reply_records(update, held)
        assert set(mine) == set(records)
        for key, value in records.items():
            np.testing.assert_allclose(mine[key], value, rtol=1e-5, atol=1e-6, err_msg=f"client {client}, {key}")


#: Each (model, objective) pair compared: every objective on lenet and cnn; on resnet20 (BatchNorm)
#: CE, FedRL (its review pass runs each client's received model in eval mode: BatchNorm's running
#: statistics, beside the local pass's batch statistics) and SCAFFOLD (control variates on every
#: parameter, BatchNorm's included). FedProx's and FedDyn's terms on the parameters are the same
#: code on every model: lenet and cnn check them.
PAIRS = [(m, o) for m in ("lenet", "cnn") for o in OBJECTIVES] + [("resnet20", o) for o in ("ce", "fedrl", "scaffold")]


@pytest.mark.parametrize(("model_name", "objective"), PAIRS, ids=[f"{m}-{o}" for m, o in PAIRS])
def test_each_client_ends_where_the_sequential_loop_ends(model_name: str, objective: str) -> None:
    assert_pair(model_name, objective)


#: vgg16 (dropout, 33.6 M parameters): plain CE (the replayed dropout masks), and FedRL, the one
#: objective with a forward pass of its own (each client's received model, frozen, in eval mode:
#: no dropout there, beside the local pass that has it). The others add terms on the parameters
#: only: lenet and cnn check each of them.
VGG_OBJECTIVES = ["ce", "fedrl"]


@pytest.mark.parametrize("objective", VGG_OBJECTIVES)
def test_vgg16_with_dropout_ends_where_the_sequential_loop_ends(objective: str) -> None:
    assert_pair("vgg16", objective, VGG_TRAINING, VGG_SIZES)


def test_plain_sgd_and_local_steps() -> None:
    assert_pair("lenet", "ce", TrainingSettings().replace(local_epochs=1, local_steps=3, batch_size=16, momentum=0.0))


def test_a_wrong_data_order_is_caught() -> None:
    """The comparison can fail: the clients' generators swapped (each draws another's order)."""
    with pytest.raises(AssertionError):
        assert_pair("lenet", "ce", vector_seeds=[2, 1, 3, 4])


def test_wrong_dropout_masks_are_caught() -> None:
    """vgg16's dropout masks drawn with the wrong clients' seeds: the comparison fails."""
    with pytest.raises(AssertionError):
        assert_pair("vgg16", "ce", VGG_TRAINING, VGG_SIZES, vector_seeds=[2, 1])


def test_a_state_that_does_not_fit_the_model_is_refused() -> None:
    model = build_model("lenet", MNIST)
    state = dict(model.state_dict())
    state.pop(next(iter(state)))
    update = build_local_update(composed())
    with pytest.raises(ValueError, match="client 0's state does not fit the model: missing"):
        train_stacked(model, [state], [client_data(8, 0, (1, 28, 28))], TRAINING, 1, [torch.Generator()], CPU, [update])


def test_an_objective_with_its_own_step_is_refused() -> None:
    model = build_model("lenet", MNIST)
    update = build_local_update(composed("objective=asam"))
    with pytest.raises(ValueError, match="clients of one vectorizable objective"):
        train_stacked(model, [model.state_dict()], [client_data(8, 0, (1, 28, 28))], TRAINING, 1, [torch.Generator()], CPU, [update])


def test_padded_rows_that_reach_the_loss_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """lenet has no BatchNorm or dropout: a short batch is padded with rows of weight 0. With the
    weights ignored (the padded rows in the loss's mean), the comparison fails."""
    import objectives.base as base

    assert_pair("lenet", "ce")  # padded, and right
    monkeypatch.setattr(base, "mean_over_rows", lambda per_row, rows: per_row.mean())
    with pytest.raises(AssertionError):
        assert_pair("lenet", "ce")


def assert_dropout_masks_replayed(device: torch.device, replay_seed: int = 7) -> None:
    """vgg16's dropout masks as the stacked step draws them (``_Dropouts``) against the ones its
    forward pass in training mode applied, step after step, after ``torch.manual_seed(7)`` as the
    ClientApp seeds: for every dropout call, the layer's output equals its input times the mask
    exactly (``replay_seed``: the seed the replay is given)."""
    from torch import nn

    from client_app.vectorized import _architecture, _Dropouts

    torch.manual_seed(0)
    model = build_model("vgg16", CIFAR).to(device).train()
    applied: list[tuple[torch.Tensor, torch.Tensor]] = []
    for module in model.modules():
        if type(module) is nn.Dropout:
            module.register_forward_hook(lambda m, inputs, output: applied.append((inputs[0], output)))
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randn(3, 3, 32, 32, generator=gen).to(device) for _ in range(3)]
    torch.manual_seed(7)
    with torch.no_grad():
        for x in batches:
            model(x)
    replay = _Dropouts(_architecture(model), [replay_seed], device)
    masks = [mask[0] for x in batches for mask in replay.masks([0], x.unsqueeze(0), device)]
    assert len(masks) == len(applied) == 3 * 2  # two dropout layers, three steps
    for call, ((inputs, output), mask) in enumerate(zip(applied, masks)):
        assert torch.equal(inputs * mask, output), f"dropout call {call}: the replayed mask is not the forward pass's"


def test_the_dropout_masks_are_the_forward_passes_own() -> None:
    """The replay is exact on the CPU (tests/test_cuda.py checks it on CUDA), and the check can
    fail: a replay from another seed is caught."""
    assert_dropout_masks_replayed(CPU)
    with pytest.raises(AssertionError, match="dropout call 0"):
        assert_dropout_masks_replayed(CPU, replay_seed=8)


def host_reads(fn) -> dict[str, int]:  # noqa: ANN001
    """How often ``fn()`` reads a tensor's value into Python (each a wait for the device on CUDA),
    by the method that read it."""
    import collections

    counts: collections.Counter = collections.Counter()
    held = {}
    for name in ("__float__", "__int__", "__bool__", "__index__", "item", "tolist", "cpu", "numpy"):
        real = held[name] = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):  # noqa: ANN001, ANN002, ANN003
            counts[_name] += 1
            return _real(self, *args, **kwargs)

        setattr(torch.Tensor, name, counted)
    try:
        fn()
    finally:
        for name, real in held.items():
            setattr(torch.Tensor, name, real)
    return dict(counts)


def assert_one_read_per_call(device: torch.device) -> None:
    """Both training paths, 2 epochs of 5 batches (3 clients stacked): the losses are read from
    the device once, after the last step (``.cpu()`` then ``.tolist()``), never per step."""
    model = build_model("lenet", MNIST)
    states = starting_states(model, 3)  # on the host, before the model moves to the device
    training = TrainingSettings().replace(local_epochs=2, batch_size=8)
    datas = [client_data(40, 1 + c, MNIST.shape) for c in range(3)]
    one = host_reads(lambda: train_epochs(model, datas[0], build_local_update(composed()), training, 1,
                                          torch.Generator().manual_seed(0), device))
    stacked = host_reads(lambda: train_stacked(model, states, datas, training, 1,
                                               [torch.Generator().manual_seed(c) for c in range(3)], device,
                                               [build_local_update(composed()) for _ in range(3)]))
    assert one == stacked == {"cpu": 1, "tolist": 1}, (one, stacked)


def test_the_training_loops_read_the_losses_once_per_call() -> None:
    """No host read per step where the loss is only reported (on CUDA each would make the GPU
    wait on the host; tests/test_cuda.py runs the same there)."""
    assert_one_read_per_call(CPU)
