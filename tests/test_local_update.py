"""Local-update plugins: μ = 0 equals plain CE, FedProx gradient, FedRL review depth and review term."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from objectives.base import LocalUpdate, ObjectiveSettings, build_local_update, resolve_mu
from objectives.fedprox import FedProx
from objectives.fedrl import FedRL
from client_app.training import train
from fedmm.config import RunSettings, compose, to_container
from fedmm.data import ImageNormalize, TensorData, input_spec
from fedmm.models import build_model


def tiny_data(n: int = 64, seed: int = 0) -> TensorData:
    g = torch.Generator().manual_seed(seed)
    return TensorData(x=torch.randint(0, 256, (n, 1, 28, 28), dtype=torch.uint8, generator=g),
                      y=torch.randint(0, 10, (n,), generator=g), ids=None,
                      transform=ImageNormalize((0.1307,), (0.3081,)))


def mnist_model(name: str = "cnn"):
    return build_model(name, input_spec(to_container(compose([]))["dataset"]))


def cfg_with(*overrides: str) -> RunSettings:
    return compose(["training.local_epochs=1", "training.batch_size=16", *overrides])


def trained_weights(cfg: RunSettings) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = mnist_model()
    train(model, tiny_data(), build_local_update(cfg), cfg.training, 1, torch.Generator().manual_seed(1), torch.device("cpu"))
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("objective", ["fedprox", "fedrl"])
def test_mu_zero_trains_exactly_like_cross_entropy(objective: str) -> None:
    plain = trained_weights(cfg_with())
    other = trained_weights(cfg_with(f"objective={objective}", "objective.mu=0"))
    for key in plain:
        assert torch.equal(plain[key], other[key]), key
    # and a non-zero mu does change the result
    changed = trained_weights(cfg_with(f"objective={objective}", "objective.mu=1.0"))
    assert any(not torch.equal(plain[k], changed[k]) for k in plain)


def test_fedprox_term_gradient_is_mu_times_distance() -> None:
    mu = 0.3
    cfg = cfg_with("objective=fedprox", f"objective.mu={mu}")
    torch.manual_seed(0)
    model = mnist_model("lenet")
    objective = FedProx(cfg)
    objective.begin(model, 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    x, y = torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 3])
    loss, logits = objective.loss(model, x, y)
    ce = torch.nn.functional.cross_entropy(logits, y)
    grads = torch.autograd.grad(loss - ce, list(model.parameters()))
    for g, p, p0 in zip(grads, model.parameters(), objective.global_params):
        torch.testing.assert_close(g, mu * (p.detach() - p0), rtol=1e-5, atol=1e-7)


def test_review_depth_cycles_one_to_m_per_batch_and_per_round() -> None:
    model = mnist_model()  # 4 layers
    x, y = torch.randn(2, 1, 28, 28), torch.tensor([0, 1])
    objective = FedRL(cfg_with("objective=fedrl"))
    objective.begin(model, server_round=7)
    depths = []
    for _ in range(10):
        depths.append(objective.review_depth())
        objective.loss(model, x, y)
    assert depths == [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    objective.begin(model, server_round=8)
    assert objective.review_depth() == 1  # Algorithm 1: m restarts every round
    per_round = FedRL(cfg_with("objective=fedrl", "objective.advance=round"))
    seen = []
    for rnd in range(1, 10):
        per_round.begin(model, rnd)
        seen.append(per_round.review_depth())
        per_round.loss(model, x, y)
        assert per_round.review_depth() == seen[-1]  # fixed within the round
    assert seen == [1, 2, 3, 4, 1, 2, 3, 4, 1]


def test_review_term_is_zero_when_models_are_equal_and_reference_never_moves() -> None:
    torch.manual_seed(0)
    model = mnist_model().eval()  # no dropout in cnn; eval to match the frozen copy
    objective = FedRL(cfg_with("objective=fedrl", "objective.mu=10.0"))
    objective.begin(model, 1)
    x, y = torch.randn(3, 1, 28, 28), torch.tensor([1, 2, 3])
    for _ in range(4):  # every depth
        loss, logits = objective.loss(model, x, y)
        assert loss.item() == pytest.approx(torch.nn.functional.cross_entropy(logits, y).item(), abs=1e-6)
    before = {k: v.clone() for k, v in objective.reference.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        optimizer.zero_grad()
        loss, _ = objective.loss(model, x, y)
        loss.backward()
        optimizer.step()
    for key, value in objective.reference.state_dict().items():
        assert torch.equal(value, before[key])
    assert all(p.grad is None and not p.requires_grad for p in objective.reference.parameters())
    # the local model has moved, so the review term is now positive at some depth
    terms = []
    for _ in range(4):
        loss, logits = objective.loss(model, x, y)
        terms.append(loss.item() - torch.nn.functional.cross_entropy(logits, y).item())
    assert max(terms) > 0


def test_mu_resolution_follows_the_paper_table() -> None:
    params = compose(["objective=fedrl"]).objective
    assert resolve_mu(params, "fashion_mnist") == 0.004
    assert resolve_mu(params, "cifar100") == 0.0001
    assert resolve_mu(params.replace(mu=0.2), "cifar100") == 0.2
    prox = compose(["objective=fedprox"]).objective
    assert resolve_mu(prox, "femnist") == 0.1 and resolve_mu(prox, "cifar10") == 0.01
    assert type(build_local_update({"objective": {"name": "ce"}})) is LocalUpdate


def test_lr_schedule_divides_at_decay_rounds() -> None:
    from fedmm.training import TrainingSettings, round_lr

    training = TrainingSettings(lr=0.01, lr_decay_rounds=[40, 80], lr_decay_factor=0.1)
    assert [round_lr(training, r) for r in (1, 39, 40, 79, 80, 120)] == pytest.approx([0.01, 0.01, 0.001, 0.001, 0.0001, 0.0001])
    assert np.isclose(round_lr(training.replace(lr_decay_rounds=[]), 100), 0.01)


@dataclass
class CountingSettings(ObjectiveSettings):
    """A test objective without settings (declared by the fixture below, for its test only)."""


class CountingUpdate(LocalUpdate):
    """An objective that uses every hook: reads an extra record, keeps state across rounds, takes
    the batches' gradients itself, is told the steps, adds a reply record."""

    Settings = CountingSettings

    def begin(self, model, server_round):
        self.offset = float(self.content["extra"]["offset"])  # an extra record of the train message
        self.gradients = self.steps = 0

    def gradient(self, model, x, y):
        self.gradients += 1
        return super().gradient(model, x, y)

    def finish_steps(self, steps, lr):
        assert steps == self.gradients  # the loop took a step for every gradient
        self.steps = steps

    def end(self, model):
        from flwr.app import Array, ArrayRecord, ConfigRecord

        rounds = int(self.state["counting"]["rounds"]) + 1 if "counting" in self.state else 1
        self.state["counting"] = ConfigRecord({"rounds": rounds})  # Context.state: kept by the node
        return {"steps": ArrayRecord({"n": Array(np.array([self.steps, rounds, self.offset]))})}


@pytest.fixture
def counting_objective():
    """``objective=counting`` declared for one test only."""
    from fedmm import settings

    settings._DECLARED[("objective", "counting")] = CountingSettings
    CountingSettings.option = "counting"
    yield
    del settings._DECLARED[("objective", "counting")]
    CountingSettings.option = ""


def test_a_plugin_reads_extra_records_keeps_state_steps_and_adds_reply_records(counting_objective) -> None:
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

    from client_app import client_app
    from fedmm import protocol
    cfg = to_container(compose(["num_clients=4", "clients_per_round=2", "training.local_epochs=1"]))
    cfg["objective"] = {"name": "counting"}
    context = Context(run_id=1, node_id=7, node_config={"partition-id": 1, "num-partitions": 4}, state=RecordDict(), run_config={})
    torch.manual_seed(0)
    arrays = ArrayRecord(mnist_model().state_dict())
    for rnd in (1, 2):
        msg = Message(
            RecordDict({
                protocol.ARRAYS: arrays,
                protocol.CONFIG: ConfigRecord({protocol.SERVER_ROUND: rnd, protocol.RUN_CONFIG: protocol.run_config_record(cfg)}),
                "extra": ConfigRecord({"offset": 0.5}),
            }),
            message_type=protocol.TRAIN,
            dst_node_id=7,
        )
        reply = client_app.train(msg, context)
        steps, rounds, offset = reply.content["steps"]["n"].numpy()
        n = int(reply.content[protocol.METRICS][protocol.NUM_EXAMPLES])
        assert steps == -(-n // cfg["training"]["batch_size"])  # one step per batch
        assert rounds == rnd and offset == 0.5  # the state survived the first round
        assert set(reply.content.array_records) == {protocol.ARRAYS, "steps"}


def test_client_error_extracts_the_clients_own_exception() -> None:
    from fedmm.protocol import client_error

    assert client_error("<class 'client_app.node_data.NodeDataError'>:<'node x: folder does not exist'>") == (
        "NodeDataError: node x: folder does not exist"
    )
    # as the simulation engine reports it: Ray's traceback of Flower's wrapper around the client's error
    ray_trace = (
        "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'ray::ClientAppActor.run() (pid=1, ip=10.0.0.1)\n"
        "  File \"app.py\", line 3, in train\n    raise RuntimeError('injected failure on partition 0')\n"
        "RuntimeError: injected failure on partition 0\n\nThe above exception was the direct cause of the following"
        " exception:\n\nray::ClientAppActor.run()\nflwr.clientapp.client_app.ClientAppException: \nException "
        "ClientAppException occurred. Message: injected failure on partition 0'>"
    )
    assert client_error(ray_trace) == "RuntimeError: injected failure on partition 0"


@pytest.mark.parametrize(("engine", "advice"), [
    ("simulation.client_gpus=0.25", "simulation.client_gpus=0.25 (4 ClientApps per GPU)"),
    ("simulation.engine=local", "one ClientApp at a time, beside what its process holds on the device"),
])
def test_cuda_out_of_memory_becomes_advice_and_frees_the_cache(monkeypatch: pytest.MonkeyPatch, engine: str, advice: str) -> None:
    """A CUDA OOM inside a ClientApp's work is re-raised as ClientOutOfMemory naming the GPU share
    (Ray) or what shares the device (one ClientApp at a time) and the batch size (what the server
    log shows for that node), after emptying CUDA's cache so the next message starts clean."""
    from client_app import work

    if "client_gpus" in engine:
        run = cfg_with("simulation.engine=ray", engine, "training.batch_size=64")
    else:
        run = cfg_with(engine, "training.batch_size=64")
    emptied: list[bool] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (512 * 2**20, 8192 * 2**20))
    with pytest.raises(work.ClientOutOfMemory) as caught:
        with work.cuda_memory_advice(run, "local training"):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    text = str(caught.value)
    assert emptied == [True]
    assert "during local training (512 MiB free of 8192 MiB" in text
    assert advice in text and "training.batch_size=64" in text
    assert "Tried to allocate 2.00 GiB" in text
    with pytest.raises(ValueError):  # anything else passes through untouched
        with work.cuda_memory_advice(run, "evaluation"):
            raise ValueError("not memory")
