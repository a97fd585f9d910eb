"""Several clients' local training as one computation: stacked parameters, ``torch.func``.

The K clients of a round that share an architecture train together: their parameters and
buffers are stacked along a new first dimension, and each SGD step is one ``vmap`` over the
clients of ``grad`` of the batch loss through ``functional_call``. Every client keeps what the
sequential loop (:func:`client_app.training.train_epochs`) gives it:

- its objective's loss and gradient correction, the objective's own code
  (:meth:`objectives.base.LocalUpdate.batch_loss`, :meth:`~objectives.base.LocalUpdate.correct_gradient`)
  with its own tensors (:meth:`~objectives.base.LocalUpdate.tensors`: FedProx's anchor, SCAFFOLD's
  correction, FedDyn's linear term, FedRL's reference model) stacked;
- its batches, in the order the sequential loop draws them (:func:`client_app.training.local_batches`
  with the client's own generator);
- its SGD state: momentum buffer, weight decay, the round's learning rate, gradient clipping by
  its own norm (``torch.nn.utils.clip_grad_norm_``'s arithmetic), the objective's clipping first;
- its BatchNorm running statistics (buffers stacked like the parameters) and its dropout masks:
  drawn, client by client, by ``F.dropout`` from the device's default generator set to the
  client's own state, seeded as the sequential loop seeds it, in the order the forward pass uses
  them (the sequential loop's masks, on the CPU and on CUDA).

Ragged clients are exact. A client that has run out of batches is in no step. For a model
whose rows do not meet in the forward pass (no BatchNorm, no dropout: ``lenet``, ``cnn``), each
step is one computation over every active client, a short batch padded to the longest with rows
of weight 0 that the objective's loss leaves out (``rows``; their gradient is exactly 0). For a
model with BatchNorm or dropout, the clients whose next batch has the same size train as one
group (gathered from the stack and written back), so a client's short batch trains in a group of
its own size. No padded row ever reaches a loss or a BatchNorm statistic.

:func:`train_stacked` imports no Flower; :func:`train_messages` is the in-process engine's
batch handler (fedmm/local_engine.py): the round's train messages in, their replies out.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import grad_and_value, vmap
from torch.nn import functional as F

from client_app.training import local_batches
from fedmm.data import TensorData
from fedmm.training import TrainingSettings, round_lr, weighted_sum
from objectives.base import LocalUpdate

#: The optimizer arguments the stacked SGD step implements (an objective asking for more, e.g.
#: Nesterov momentum, trains one client at a time).
SGD_ARGUMENTS = frozenset({"lr", "momentum", "weight_decay"})


@dataclass
class ClientResult:
    """One client's outcome, as the sequential loop returns it."""

    state: dict[str, torch.Tensor]
    train_loss: float
    steps: int


class ReplayDropout(nn.Module):
    """``nn.Dropout`` whose mask is given (one client's, under ``vmap``): ``x * mask``, the mask
    already holding the ``1 / (1 - p)`` scale (:class:`_Dropouts` draws it)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = float(p)
        self.mask: torch.Tensor | None = None
        self.traced: tuple[int, ...] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mask is None:  # tracing the shapes of a batch
            self.traced = tuple(x.shape)
            return x
        return x * self.mask


def unsupported_modules(model: nn.Module) -> list[str]:
    """Modules of ``model`` the stacked step cannot run exactly (random ones other than
    ``nn.Dropout``, recurrent ones)."""
    bad = []
    for name, module in model.named_modules():
        random_kind = isinstance(module, nn.modules.dropout._DropoutNd) and type(module) is not nn.Dropout
        if random_kind or isinstance(module, nn.RNNBase):
            bad.append(f"{name or 'model'} ({type(module).__name__})")
    return bad


class _Dropouts:
    """The clients' dropout masks, drawn as the sequential loop's forward pass draws them: by
    ``F.dropout`` itself, on a tensor of ones of the layer's input shape, dtype and device, from the
    device's default generator set to the client's own state (at first seeded as the loop seeds
    it, ``torch.manual_seed``; kept from step to step), layer after layer in forward order. On the
    CPU that is ``empty_like(x).bernoulli_(1 - p).div_(1 - p)`` from torch's global generator; on
    CUDA the fused dropout kernel, whose draws depend on the shape (the same shape here). The mask
    holds the ``1 / (1 - p)`` scale; ``ones * mask`` is the mask exactly, so ``x * mask`` is the
    loop's ``x * mask`` bit for bit."""

    def __init__(self, arch: nn.Module, seeds: Sequence[int] | None, device: torch.device) -> None:
        self.arch, self.device = arch, device
        self.layers = [m for m in arch.modules() if isinstance(m, ReplayDropout)]
        if self.layers and seeds is None:
            raise ValueError("the model has dropout: give each client's dropout seed (the seed of its round)")
        self.states = [torch.Generator(device=device).manual_seed(int(s)).get_state() for s in seeds] if self.layers else []
        self.shapes: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        self.order: list[ReplayDropout] = []

    def _generator_state(self, state: torch.Tensor | None = None) -> torch.Tensor | None:
        """The device's default generator's state (``state`` given: set to it)."""
        if self.device.type == "cuda":
            if state is None:
                return torch.cuda.get_rng_state(self.device)
            torch.cuda.set_rng_state(state, self.device)
        else:
            if state is None:
                return torch.get_rng_state()
            torch.set_rng_state(state)
        return None

    def masks(self, members: Sequence[int], x: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
        if not self.layers:
            return []
        key = tuple(x.shape[1:])
        if key not in self.shapes:  # one forward with no masks: each dropout layer's input shape, in call order
            for layer in self.layers:
                layer.traced = None
            calls: list[ReplayDropout] = []
            hooks = [layer.register_forward_pre_hook(lambda m, _: calls.append(m)) for layer in self.layers]
            was_training = self.arch.training
            try:
                with torch.no_grad():
                    self.arch.eval()(x[0])
            finally:
                self.arch.train(was_training)
                for hook in hooks:
                    hook.remove()
            self.order = calls
            self.shapes[key] = [layer.traced for layer in calls]
        per_layer: list[list[torch.Tensor]] = [[] for _ in self.order]
        held = self._generator_state()
        try:
            with torch.no_grad():
                for client in members:
                    self._generator_state(self.states[client])
                    for drawn, layer, shape in zip(per_layer, self.order, self.shapes[key]):
                        drawn.append(F.dropout(torch.ones(shape, dtype=x.dtype, device=device), layer.p, training=True))
                    self.states[client] = self._generator_state()
        finally:
            self._generator_state(held)  # the process's own stream goes on as if nothing was drawn
        return [torch.stack(drawn) for drawn in per_layer]

    def set(self, masks: Sequence[torch.Tensor] | None) -> None:
        for layer, mask in zip(self.order, masks or [None] * len(self.order)):
            layer.mask = mask


def rows_apart(model: nn.Module) -> bool:
    """Whether each row's output depends on that row only, and the forward pass draws nothing:
    no BatchNorm (or other statistics over the batch) and no dropout. Then a padded row can ride
    along with weight 0."""
    return not any(isinstance(m, (nn.modules.batchnorm._NormBase, nn.modules.dropout._DropoutNd)) for m in model.modules())


def _takes_rows(objective: LocalUpdate) -> bool:
    return "rows" in inspect.signature(objective.batch_loss).parameters


def _architecture(model: nn.Module) -> nn.Module:
    """``model``, or a copy whose ``nn.Dropout`` layers replay given masks."""
    if not any(type(m) is nn.Dropout for m in model.modules()):
        return model
    arch = copy.deepcopy(model)
    for module in list(arch.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Dropout:
                setattr(module, name, ReplayDropout(child.p))
    return arch


def _clip(grads: dict[str, torch.Tensor], max_norm: float) -> dict[str, torch.Tensor]:
    """``clip_grad_norm_`` per client: one norm over all of a client's gradients (stacked)."""
    norms = torch.stack([g.flatten(1).norm(2, dim=1) for g in grads.values()], dim=1).norm(2, dim=1)
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    return {n: g * coef.view(-1, *([1] * (g.dim() - 1))) for n, g in grads.items()}


def train_stacked(
    model: nn.Module,
    states: Sequence[dict[str, torch.Tensor]],
    datas: Sequence[TensorData],
    training: TrainingSettings,
    server_round: int,
    generators: Sequence[torch.Generator],
    device: torch.device,
    updates: Sequence[LocalUpdate],
    dropout_seeds: Sequence[int] | None = None,
) -> tuple[list[ClientResult], float]:
    """Train ``len(states)`` clients of one architecture together; return each one's result
    and the seconds it all took.

    ``model`` gives the architecture only (its own weights are not used or changed); client k
    starts from ``states[k]`` (a state dict of ``model``'s keys), trains on ``datas[k]`` with
    ``generators[k]`` drawing its batch order and ``updates[k]`` (its objective, after
    :meth:`~objectives.base.LocalUpdate.begin`) giving its loss, exactly as
    :func:`client_app.training.train_epochs` would with the same arguments and
    ``torch.manual_seed(dropout_seeds[k])`` (needed when the model has dropout).
    """
    start = time.perf_counter()
    k = len(states)
    if not (k == len(datas) == len(generators) == len(updates)) or k == 0:
        raise ValueError(f"one state, data split, generator and objective per client: {len(states)}, {len(datas)}, "
                         f"{len(generators)}, {len(updates)}")
    kinds = {type(u) for u in updates}
    if len(kinds) != 1 or updates[0].vectorizable():
        raise ValueError(f"clients of one vectorizable objective train together, got {sorted(c.__name__ for c in kinds)}"
                         + (f" ({updates[0].vectorizable()})" if len(kinds) == 1 else ""))
    bad = unsupported_modules(model)
    if bad:
        raise ValueError(f"the model has modules the stacked step cannot run: {', '.join(bad)}")
    objective = updates[0]
    training = objective.local_training(training)
    lr = round_lr(training, server_round)
    args = objective.optimizer_args(training, lr)
    if set(args) - SGD_ARGUMENTS:
        raise ValueError(f"{type(objective).__name__}'s optimizer arguments {sorted(set(args) - SGD_ARGUMENTS)} are "
                         f"not the stacked SGD step's ({', '.join(sorted(SGD_ARGUMENTS))})")
    lr, momentum, weight_decay = float(args["lr"]), float(args.get("momentum", 0.0)), float(args.get("weight_decay", 0.0))

    arch = _architecture(model.to(device)).train()
    trainable = [name for name, p in arch.named_parameters() if p.requires_grad]
    fixed = [name for name, p in arch.named_parameters() if not p.requires_grad] + [name for name, _ in arch.named_buffers()]
    for index, state in enumerate(states):
        if set(state) != set(trainable) | set(fixed):
            missing = sorted(set(trainable) | set(fixed) - set(state))
            extra = sorted(set(state) - set(trainable) - set(fixed))
            raise ValueError(f"client {index}'s state does not fit the model: missing {missing}, unexpected {extra}")
    params = {n: torch.stack([s[n] for s in states]).to(device) for n in trainable}
    buffers = {n: torch.stack([s[n] for s in states]).to(device) for n in fixed}
    own = [u.tensors() for u in updates]
    tensors = {n: torch.stack([t[n] for t in own]).to(device) for n in own[0]}
    momentum_buf = {n: torch.zeros_like(p) for n, p in params.items()}  # m * 0 + g = g: torch's first step, exactly
    dropouts = _Dropouts(arch, dropout_seeds, device)

    corrects = type(objective).correct_gradient is not LocalUpdate.correct_gradient
    objective_clip = objective.gradient_clip()
    max_norm = None if training.clip_grad_norm is None else float(training.clip_grad_norm)
    step_index = 0
    pad = rows_apart(arch) and _takes_rows(objective)

    def one(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], t: dict[str, torch.Tensor],
            masks: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        dropouts.set(masks)
        try:
            loss, _ = objective.batch_loss(arch, {**p, **b}, t, x, y, step_index)
        finally:
            dropouts.set(None)
        return loss

    def padded(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], t: dict[str, torch.Tensor],
               x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        loss, _ = objective.batch_loss(arch, {**p, **b}, t, x, y, step_index, rows)
        return loss

    step = vmap(grad_and_value(one), in_dims=(0, 0, 0, 0, 0, 0), randomness="error")
    step_padded = vmap(grad_and_value(padded), in_dims=(0, 0, 0, 0, 0, 0), randomness="error")
    correct = vmap(objective.correct_gradient, in_dims=(0, 0)) if corrects else None

    streams = [local_batches(data, training, gen, device) for data, gen in zip(datas, generators)]
    step_losses: list[torch.Tensor] = []  # each step's losses of its members, on the device
    step_members: list[list[int]] = []
    per_client: list[tuple[list[float], list[int]]] = [([], []) for _ in range(k)]  # (losses, rows) by step
    active = list(range(k))
    while active:
        batches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for client in active:
            batch = next(streams[client], None)
            if batch is not None:
                batches[client] = batch
        active = list(batches)
        groups: dict[tuple[int, ...], list[int]] = {}
        for client, (x, _) in batches.items():
            groups.setdefault(() if pad else tuple(x.shape), []).append(client)
        for members in groups.values():
            whole = len(members) == k
            index = None if whole else torch.tensor(members, device=device)

            def pick(stack: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
                return stack if whole else {n: t.index_select(0, index) for n, t in stack.items()}

            p, b, t = pick(params), pick(buffers), pick(tensors)
            sizes = [len(batches[c][1]) for c in members]
            if pad and min(sizes) != max(sizes):  # short batches padded with rows of weight 0
                first_x, first_y = batches[members[0]]
                x = first_x.new_zeros((len(members), max(sizes), *first_x.shape[1:]))
                y = first_y.new_zeros((len(members), max(sizes)))
                for row, client in enumerate(members):
                    x[row, :sizes[row]] = batches[client][0]
                    y[row, :sizes[row]] = batches[client][1]
            else:
                x = torch.stack([batches[c][0] for c in members])
                y = torch.stack([batches[c][1] for c in members])
            if pad:
                rows = (torch.arange(x.shape[1], device=device) < torch.tensor(sizes, device=device).view(-1, 1)).to(x.dtype)
                grads, losses = step_padded(p, b, t, x, y, rows)
            else:
                masks = dropouts.masks(members, x, device)
                grads, losses = step(p, b, t, masks, x, y)  # b's BatchNorm statistics are updated in place
            if correct is not None:
                grads = correct(grads, t)
            if objective_clip is not None:
                grads = _clip(grads, objective_clip)
            if max_norm is not None:
                grads = _clip(grads, max_norm)
            for n, g in grads.items():
                if weight_decay:
                    g = g.add(p[n], alpha=weight_decay)
                if momentum:
                    buf = momentum_buf[n] if whole else momentum_buf[n].index_select(0, index)
                    buf.mul_(momentum).add_(g)
                    g = buf
                    if not whole:
                        momentum_buf[n].index_copy_(0, index, buf)
                if whole:
                    p[n].sub_(g, alpha=lr)
                else:
                    params[n].index_copy_(0, index, p[n].sub_(g, alpha=lr))
            if not whole:
                for n, tensor in b.items():
                    buffers[n].index_copy_(0, index, tensor)
            step_losses.append(losses.detach())  # kept on the device: read once, after the last step
            for client, n_rows in zip(members, sizes):
                per_client[client][1].append(n_rows)
            step_members.append(members)
        step_index += 1
    # every step's losses in one read from the device, then each client's in its step order
    values = torch.cat(step_losses).cpu().tolist() if step_losses else []
    position = 0
    for members in step_members:
        for client in members:
            per_client[client][0].append(values[position])
            position += 1
    results = []
    for client, state in enumerate(states):
        out = {n: params[n][client] for n in trainable}
        out.update({n: buffers[n][client] for n in fixed})
        client_losses, client_sizes = per_client[client]
        updates[client].finish_steps(len(client_sizes), lr)
        results.append(ClientResult({key: out[key] for key in state}, weighted_sum(client_losses, client_sizes) / max(sum(client_sizes), 1),
                                    len(client_sizes)))
    return results, time.perf_counter() - start



# =============================================================================== the engine's batch handler
_log = logging.getLogger("flwr")
#: Why a run's clients train one at a time, logged once per reason.
_told: set[str] = set()
#: The number of clients that fitted the device in one computation after running out of memory, by run config.
_fitted: dict[str, int] = {}
#: The run configs whose clients have trained together (named once in the log).
_started: set[str] = set()


def _tell_once(reason: str) -> None:
    if reason not in _told:
        _told.add(reason)
        _log.info("Vectorized rounds: %s; these clients train one at a time", reason)


def train_messages(messages: Sequence[Any], contexts: Sequence[Any]) -> list[Any] | None:
    """The in-process engine's handler of a round's train messages (``simulation.vectorize``):
    the replies (or, per message, the exception its ClientApp call would have raised, or None
    for a message that trains alone: the only one of its round), in order, or None when these
    messages train one at a time (``vectorize: off``, one message,
    an objective or model that does not vectorize, or, under ``auto``, the CPU: measured slower
    there in the papers' shapes, docs/performance.md, 'Vectorized rounds'). ``contexts``: each
    message's node context (its ``state`` is written as the ClientApp would write it)."""
    from fedmm import protocol
    from fedmm.config import client_run, not_vectorized
    from fedmm.evaluation import resolve_device

    from client_app import work

    texts = {protocol.run_config_text(m) for m in messages}
    if len(texts) != 1 or len(messages) < 2:
        return None
    (text,) = texts
    run = client_run(text)
    mode = run.simulation.vectorize
    if mode == "off":
        return None
    problem = not_vectorized(run)
    model = work._model(run)
    bad = unsupported_modules(model)
    if problem is None and bad:
        problem = f"model.name={run.model.name!r} has modules the stacked step cannot run: {', '.join(bad)}"
    device = resolve_device(run.training.device)
    if problem is not None:
        if mode == "on":
            raise ValueError(f"simulation.vectorize=on: {problem}")
        _tell_once(problem)
        return None
    if mode == "auto" and device.type != "cuda":
        _tell_once(f"vectorize=auto on {device.type}: one client at a time is faster there for the papers' shapes "
                   f"(set simulation.vectorize=on to train them together anyway)")
        return None

    if text not in _started:
        _started.add(text)
        _log.info("Vectorized rounds: the clients of %s (objective %s) train as one computation on %s",
                  run.model.name, run.objective.name, device)
    out: list[Any] = [None] * len(messages)
    before: dict[int, dict[str, float]] = {}  # each client's measurements of the model it received
    ready: list[int] = []
    prepared: dict[int, tuple[LocalUpdate, TensorData, int, dict[str, torch.Tensor]]] = {}
    for i, (msg, context) in enumerate(zip(messages, contexts)):
        try:
            with work.cuda_memory_advice(run, "local training"):
                loaded = work.model_from_message(run, msg)
                loaded.to(device).train()
                repeat = int(msg.content[protocol.CONFIG].get(protocol.ROUND_REPEAT, 0))
                update = work.build_local_update(run, context.state, msg.content)
                update.node = int(context.node_config.get("partition-id", context.node_id % (2**31)))
                data = work.local_data(run, context)
                before[i] = work.measured(run, msg.content, loaded, data)
                loaded.train()
                seed = work.seed_for(run, protocol.server_round(msg), context, repeat)
                update.start(loaded, data, protocol.server_round(msg))
                start = {key: value.detach().clone() for key, value in loaded.state_dict().items()}
            prepared[i] = (update, data, seed, start)
            ready.append(i)
        except Exception as err:  # noqa: BLE001 - this client's failure, as its ClientApp call would raise it
            out[i] = err
    by_round: dict[int, list[int]] = {}  # one round per computation (the learning rate is the round's)
    for i in ready:
        by_round.setdefault(protocol.server_round(messages[i]), []).append(i)
    for server_round, same_round in by_round.items():
        if len(same_round) == 1:
            continue  # out[i] stays None: it trains alone, through the ClientApp
        _train_together(run, text, model, device, server_round, same_round, prepared, messages, out, before)
    return out


def _train_together(run: Any, text: str, model: nn.Module, device: torch.device, server_round: int, ready: list[int],
                    prepared: dict[int, tuple[LocalUpdate, TensorData, int, dict[str, torch.Tensor]]],
                    messages: Sequence[Any], out: list[Any], before: dict[int, dict[str, float]]) -> None:
    """Train the clients ``ready`` (indices into ``messages``) of one round, in chunks of at most
    ``simulation.vectorize_clients`` (halved on CUDA out of memory); each one's reply or
    exception into ``out``."""
    from client_app import work

    chunk = max(1, min(len(ready), run.simulation.vectorize_clients or len(ready), _fitted.get(text, len(ready))))
    position = 0
    while position < len(ready):
        members = ready[position:position + chunk]
        try:
            with work.cuda_memory_advice(run, "vectorized local training") if chunk == 1 else contextlib.nullcontext():
                results, seconds = train_stacked(
                    model, [prepared[i][3] for i in members], [prepared[i][1] for i in members], run.training, server_round,
                    [torch.Generator().manual_seed(prepared[i][2]) for i in members], device,
                    [prepared[i][0] for i in members], [prepared[i][2] for i in members])
        except torch.cuda.OutOfMemoryError:
            if device.type == "cuda":
                torch.cuda.empty_cache()
            chunk = max(1, chunk // 2)
            _fitted[text] = chunk
            _log.warning("Vectorized rounds: CUDA out of memory with %d clients in one computation; %d from now on",
                         len(members), chunk)
            continue
        except Exception as err:  # noqa: BLE001 - the computation's failure is each of its clients'
            for i in members:
                out[i] = err
            position += len(members)
            continue
        for i, result in zip(members, results):
            try:
                out[i] = _reply(run, messages[i], model, prepared[i][0], prepared[i][1], result, seconds / len(members),
                                before.get(i, {}))
            except Exception as err:  # noqa: BLE001 - e.g. an objective's end() refusing
                out[i] = err
        position += len(members)


def _reply(run: Any, msg: Any, model: nn.Module, update: LocalUpdate, data: TensorData, result: ClientResult, seconds: float,
           before: dict[str, float]) -> Any:
    """The train reply the ClientApp would send for ``result`` (``work.train_reply``'s records;
    ``before``: the measurements of the received model the message asked for)."""
    from flwr.app import MetricRecord

    from fedmm import protocol

    from client_app import work

    model.load_state_dict(result.state, strict=True)
    extra = update.end(model)
    metrics = {"train_loss": result.train_loss, protocol.NUM_EXAMPLES: float(len(data)), "train_time": seconds}
    metrics.update(update.metrics())
    metrics.update(before)
    records = {protocol.ARRAYS: work.model_record(model), protocol.METRICS: MetricRecord(metrics)}
    records.update(extra)
    return protocol.reply_message(msg, records)
