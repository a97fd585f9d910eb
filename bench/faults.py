"""Fault matrix: what the app does when clients fail, misbehave or straggle.

    python bench/faults.py                      # fedavg fedmr fedcross
    python bench/faults.py --strategies fedmr   # any strategy option (e.g. fedmut clusamp scaffold feddyn)

For each strategy, one simulation (``--engine``: the in-process engine by default, or Flower's on
Ray; 10 SuperNodes, K = 5 per round, 2 rounds of 1 local epoch on the embedded data) runs one
experiment per fault, one after the other. A
bench-only ClientApp wraps the real one and injects the fault named by the experiment's output
folder:

- ``fail30``: the clients of partitions 0-2 raise (30 % of the federation);
- ``nan`` / ``inf``: partition 0 returns a model with a NaN / Inf weight;
- ``shape`` / ``dtype``: partition 0 returns a tensor of the wrong shape / dtype;
- ``count``: partition 0 reports ``num-examples = 1e30``;
- ``straggler``: partition 0 answers after the round timeout (``round_timeout=6`` in this
  experiment only; the others wait up to 300 s, so that a slow worker start is not a fault).

Each row says what happened (accepted replies per round, the rejection reasons logged, the run's
status) and "models lost": server models that went missing or non-finite (must be 0).

    python bench/faults.py --attacks            # hostile clients, the defences off and on
    python bench/faults.py --attacks --strategies fedavg fedmr fedcross fedmut fedexp scaffold --hostile 1 2

``--attacks`` runs, per strategy, 10 SuperNodes all in every round (K = 10) for ``--rounds``
rounds of the default local training on the embedded data; the nodes of partitions 0 (and 1,
with ``--hostile 2``) are hostile:

- ``scale``: the update × 100; ``flip``: the update × −10 (sign flipped and boosted);
- ``freerider``: the model it got, returned untrained (with its honest example count);
- ``labelflip``: trains on its data with every label y replaced by C − 1 − y;
- ``backdoor``: trains on its data with half of its rows stamped with a 4×4 white square in
  the bottom-right corner and labelled 0; the row's ``backdoor_success`` is the share of the
  test images of other labels that the final model puts in class 0 once stamped.

The field's attacks (byzfl's; not run unless named): ``alie`` (A Little Is Enough, Baruch et
al. 2019: the honest mean plus 1.5 coordinate-wise standard deviations), ``ipm`` (Inner Product
Manipulation, Xie et al. 2020: −2 × the honest mean), ``mimic`` (Karimireddy et al. 2022: a copy
of one honest update), ``optalie`` and ``optipm`` (their factor searched against the run's
aggregator chain). The hostile nodes collude and are omniscient, as the papers define them: each
one's update is computed from the honest updates of the same round (:class:`CollusionGrid` holds
the round's replies until all are in, then replaces the hostile ones), all hostile nodes send the
same update, and only their model is attacked (SCAFFOLD's control-variate delta stays theirs).

Not an attack, and not run unless named (``--attacks absent``): ``absent``, the hostile nodes'
ClientApps raise in every round, so the server gets no reply from them: the federation without
those nodes, measured, with no update to reject (and, defended, what the stage does to the rest).

Each attack once with the defences off and once on (``--defence``, by default the per-update
stage ``screen=0``, ``sign_screen=0.5``, ``adaptive_clip=2`` with ``adaptive_clip_to=median``;
for FedMR and FedCross (and their asynchronous versions) ``norm_screen=3`` and ``refill=median``
instead of ``screen=0``;
``--defended-only``: only the defended runs), and a clean run of each (the defence's price). Its table is the final accuracy of each. Kill -9 +
resume, Ctrl-C + resume and a federation that never answers are covered by the test suite
(tests/test_same_results.py, tests/test_interrupt.py, tests/test_simulation.py). Writes
bench/results/faults.json and prints a markdown table.

    python bench/faults.py --attacks --set training.local_epochs=1 seed=1 ...   # the same table at another seed
    python bench/faults.py --summarize bench/results/attacks_*.json             # no runs: the gaps over the seeds

``--summarize`` pairs each defended attack (with the strategy's default defence) with the clean
run of its own seed and prints the gap in points, averaged over the seeds the files hold: one
8-round run moves by several points from seed to seed, the pairs by less. A second table takes
the defended free-rider run as the reference instead: the federation without the hostile nodes'
updates, which is where a defence that rejects them ends (the data they hold is lost with
them). ``--clean-only`` runs the clean experiment alone, the defence off and on (the reference
of a seed whose attack runs were defended only). ``--screen-stats`` records what the screens measured of each update (cosine
and sign agreement to the round's median update, norm ratio to the median norm), with the
partition that sent it, and prints per experiment the honest updates' worst and median score,
the hostile ones' range and the rounds in which every hostile update scored worse than every
honest one: whether a screen could tell them apart at all. Beside them scores no setting
screens on: the output layer's agreement, class by class, with the round's (``output_cosine``)
and with the model each update was sent (``sent_alignment``), and with ``--held-out`` the
change each update makes to the loss on 50 test rows of each class (``held_out_loss_change``:
what a server holding a small clean set, as in Zeno or FLTrust, would see).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedmm.observers import RunObserver  # noqa: E402

FAULTS = ("fail30", "nan", "inf", "shape", "dtype", "count", "straggler")
ATTACKS = ("scale", "flip", "freerider", "labelflip", "backdoor")
#: The field's attacks (byzfl's classes): colluding, omniscient hostile nodes whose update is
#: computed from the honest updates of the same round (:class:`CollusionGrid`).
COLLUDING = {"alie": "ALittleIsEnough", "ipm": "InnerProductManipulation", "mimic": "Mimic",
             "optalie": "Optimal_ALittleIsEnough", "optipm": "Optimal_InnerProductManipulation",
             "tunedalie": "Optimal_ALittleIsEnough", "tunedipm": "Optimal_InnerProductManipulation",
             "tunedmimic": "Mimic"}
#: The attacks tuned to the run's whole defence (:class:`DefendedAggregate`): the optimized ALIE
#: and IPM search their factor, Mimic whom to copy, against what the round does to the updates.
TUNED = ("tunedalie", "tunedipm", "tunedmimic")
#: The reply metric a hostile node of a colluding attack marks its reply with (taken off before
#: the server sees the reply).
COLLUDING_MARK = "bench-colluding"
#: ``--attacks absent``: the hostile nodes never answer (not among the attacks run by default).
ABSENT = "absent"
#: The defended rows' settings (--defence replaces them).
DEFENCE = ("strategy.defence.screen=0.0", "strategy.defence.sign_screen=0.5", "strategy.defence.adaptive_clip=2.0",
           "strategy.defence.adaptive_clip_to=median")
#: Added to DEFENCE for :data:`PER_MODEL_METHODS`: there an outlying update is rejected, not
#: scaled down (a scaled-down flip is still the next model of its slot), and its slot refilled
#: with the round's median update.
PER_MODEL = ("strategy.defence.norm_screen=3.0", "strategy.defence.refill=median")
#: Left out of DEFENCE for :data:`PER_MODEL_METHODS`: there ``sign_screen`` rejects free riders
#: and ``norm_screen`` boosted updates, and the cosine screen's only further rejections were
#: honest updates nearly orthogonal to the median under label skew (one in the last round of a
#: clean FedMR run cost it 11.5 points at seed 2: docs/defences.md, "What the bench turns on").
NOT_PER_MODEL = ("strategy.defence.screen=0.0",)
#: The methods whose K models persist from round to round (each slot's trained model, recombined
#: or fused, is a model of the next round). FedMut draws its K models afresh around one global
#: model every round, so an outlier is one summand of a mean, as in FedAvg: it keeps DEFENCE
#: alone (with two hostile nodes of ten PER_MODEL did worse there: docs/defences.md, "What the bench turns on").
PER_MODEL_METHODS = ("fedmr", "fedcross", "fedmr_async", "fedcross_async")
#: The backdoor's target class and trigger (a white square in the bottom-right corner).
TARGET, TRIGGER = 0, 4


def default_defence(strategy: str) -> tuple[str, ...]:
    """:data:`DEFENCE`; for :data:`PER_MODEL_METHODS` (by the method the preset selects: ``indep``
    is FedMR's) without :data:`NOT_PER_MODEL` and with :data:`PER_MODEL`."""
    from fedmm.config import compose

    if compose([f"strategy={strategy}"]).strategy.option not in PER_MODEL_METHODS:
        return DEFENCE
    return (*(d for d in DEFENCE if d not in NOT_PER_MODEL), *PER_MODEL)


def stamp(x):  # noqa: ANN001, ANN201 - uint8 images [N, C, H, W]
    """Images with the backdoor trigger."""
    x = x.clone()
    x[..., -TRIGGER:, -TRIGGER:] = 255
    return x


def experiment(fault: str) -> tuple[str, int, bool]:
    """(attack, hostile nodes, defended) of an experiment's folder name, e.g. ``scale-2+defence``
    (no count: partition 0 alone is hostile)."""
    name, defended = fault.removesuffix("+defence"), fault.endswith("+defence")
    attack, _, count = name.partition("-")
    return attack, int(count or 1), defended


def hostile_data(run, context, data):  # noqa: ANN001, ANN201
    """A node's training rows with the data attack of the experiment (its output folder's name)
    applied when the node is hostile (its partition among the experiment's first), else as they are."""
    import dataclasses

    from fedmm.data import input_spec

    attack, hostile, _ = experiment(Path(run.output_dir).name)
    if int(context.node_config.get("partition-id", -1)) >= hostile:
        return data
    if attack == "labelflip":
        return dataclasses.replace(data, y=input_spec(run.dataset).num_classes - 1 - data.y)
    if attack == "backdoor":
        poisoned = np.arange(len(data.y)) % 2 == 0
        x, y = data.x.clone(), data.y.clone()
        x[poisoned] = stamp(x[poisoned])
        y[poisoned] = TARGET
        return dataclasses.replace(data, x=x, y=y)
    return data


def faulty_client_app(partitions: dict[int, int] | None = None):  # noqa: ANN201
    """The real ClientApp, with the fault of the experiment (its output folder's name) injected
    (data attacks: the node's rows altered, :func:`hostile_data`, trained by the app's own
    ``train_reply``); ``partitions`` (when given) learns each node id's partition."""
    from flwr.app import Array, Context, Message
    from flwr.clientapp import ClientApp

    from client_app import client_app as real
    from client_app import work
    from fedmm import protocol
    from fedmm.config import client_run

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        cfg = protocol.read_run_config(msg)
        fault = Path(cfg["output_dir"]).name
        pid = int(context.node_config["partition-id"])
        if partitions is not None:
            partitions[context.node_id] = pid
        if fault == "fail30" and pid < 3:
            raise RuntimeError(f"injected failure on partition {pid}")
        if fault == "straggler" and pid == 0:
            time.sleep(float(cfg["round_timeout"]) + 4)
        attack, hostile, _ = experiment(fault)
        if attack == ABSENT and pid < hostile:
            raise RuntimeError(f"partition {pid} is absent from this experiment")
        if attack in COLLUDING and pid < hostile:  # its update is the colluders' (CollusionGrid): marked here
            reply = real.train(msg, context)
            reply.content[protocol.METRICS][COLLUDING_MARK] = 1.0
            return reply
        received = protocol.record_to_model(msg.content[protocol.ARRAYS], copy=True) if attack in ("scale", "flip", "freerider") else None
        if attack in ("labelflip", "backdoor") and pid < hostile:
            run = client_run(protocol.run_config_text(msg))
            return work.train_reply(msg, context, data=hostile_data(run, context, work.local_data(run, context)))
        reply = real.train(msg, context)
        if received is not None and pid < hostile:  # a hostile client: its update scaled (× 100), flipped (× −10) or none
            factor = {"scale": 100.0, "flip": -10.0, "freerider": 0.0}[attack]
            trained = protocol.record_to_model(reply.content[protocol.ARRAYS], copy=True)
            poisoned = {k: (received[k] + factor * (v - received[k])).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in trained.items()}
            reply.content[protocol.ARRAYS] = protocol.model_to_record(poisoned)
            return reply
        if pid != 0 or attack in ATTACKS or attack == "clean":
            return reply
        arrays = reply.content[protocol.ARRAYS]
        key = next(k for k in arrays if arrays[k].numpy().dtype.kind == "f")
        value = arrays[key].numpy().copy()
        if fault in ("nan", "inf"):
            value.flat[0] = np.nan if fault == "nan" else np.inf
            arrays[key] = Array(value)
        elif fault == "shape":
            arrays[key] = Array(value.reshape(-1)[:-1].copy())
        elif fault == "dtype":
            arrays[key] = Array(value.astype(np.float64))
        elif fault == "count":
            reply.content[protocol.METRICS][protocol.NUM_EXAMPLES] = 1e30
        return reply

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return real.query(msg, context)

    return app


class DefendedAggregate:
    """What the round does to a set of updates, as the tuned attacks see it: the run's defence
    stage (screens, bounds, refill: the round's own :class:`strategies.defence.Defence`), the trust
    stage (:mod:`strategies.trust`) against the attacker's estimate of the server's reference (the
    mean of the honest updates: the colluders do not hold the root set), then the run's mean
    (:class:`strategies.aggregators.Mean`: the robust chain, else the plain mean). Called on a
    candidate set (n, d), the honest updates first and the ``hostile`` last, as byzfl's optimized
    attacks build it; returns the step the round takes (d,). ``per_node``: a method with a model
    per node (FedMR, FedCross), whose step is the mean of the n slots' moves (a rejected slot,
    not refilled, stays where it was sent); else the mean of the kept updates. ``layout``
    (:meth:`see`): the model's floating entries and shapes, so that the class screen finds the
    output layer."""

    def __init__(self, defence: dict | None, hostile: int, per_node: bool = False) -> None:
        from strategies.defence import DefenceSettings

        self.settings = DefenceSettings.from_dict({**DefenceSettings().to_dict(), **(defence or {})})
        self.hostile, self.per_node = hostile, per_node
        self.layout: list[tuple[str, tuple[int, ...]]] = []
        #: The coordinates the search judges candidates on (None: all; :meth:`see`).
        self.index: np.ndarray | None = None

    def see(self, layout: list[tuple[str, tuple[int, ...]]]) -> None:
        """The model's floating entries and shapes. An entry of more than :data:`SEARCH_WHOLE`
        values is judged on a fixed random :data:`SEARCH_SHARE` of them (as a flat entry), the
        others whole (the output layer, which the class screen reads, among them): one candidate
        set of ten updates of the CNN's 1.66 M weights took 4 s through the defence, its 5 %
        0.2 s. ALIE, IPM and Mimic act coordinate by coordinate, so a candidate's coordinates
        are the same there whichever others are left out."""
        rng = np.random.default_rng(0)
        index, self.layout, start = [], [], 0
        for key, shape in layout:
            size = int(np.prod(shape))
            if size > SEARCH_WHOLE:
                keep = np.sort(rng.choice(size, max(SEARCH_WHOLE, int(SEARCH_SHARE * size)), replace=False))
                index.append(start + keep)
                self.layout.append((key, (len(keep),)))
            else:
                index.append(start + np.arange(size))
                self.layout.append((key, tuple(shape)))
            start += size
        self.index = np.concatenate(index)

    def view(self, vectors: np.ndarray) -> np.ndarray:
        """``vectors`` (n, d) on the coordinates the search judges (:meth:`see`)."""
        return vectors if self.index is None else vectors[:, self.index]

    def _model(self, vector: np.ndarray) -> dict[str, np.ndarray]:
        layout = self.layout or [("w", (vector.size,))]
        out, start = {}, 0
        for key, shape in layout:
            size = int(np.prod(shape))
            out[key] = vector[start:start + size].reshape(shape)
            start += size
        return out

    def __call__(self, vectors) -> np.ndarray:  # noqa: ANN001 - (n, d) numpy
        from fedmm.protocol import ClientUpdate
        from strategies.aggregators import Mean
        from strategies.defence import Defence
        from strategies.trust import equal_mean_form, rescaled, trust_scores

        vectors = np.asarray(vectors, np.float64)
        n = len(vectors)
        zero = self._model(np.zeros(vectors.shape[1]))
        updates = [ClientUpdate(i, i, self._model(v), 1.0, {}) for i, v in enumerate(vectors)]
        verdict = Defence(self.settings).screen_and_bound(updates, [zero] * n)
        kept = [np.concatenate([np.ravel(u.model[k]) for k, _ in (self.layout or [("w", 0)])])
                for u in [*verdict.kept, *verdict.stand_ins]]
        if self.settings.trust_root is not None and kept:
            honest = vectors[: n - self.hostile].mean(axis=0)
            scores = trust_scores(kept, [honest] * len(kept))
            kept = equal_mean_form(scores, rescaled(kept, [honest] * len(kept))) if scores.sum() > 0 else []
        if not kept:
            return np.zeros(vectors.shape[1])
        if self.per_node:
            return np.sum(kept, axis=0) / n
        mean = Mean.of(self.settings)
        if mean.robust:
            return mean.robust_mean([{"w": v} for v in kept], None)["w"]
        return np.mean(kept, axis=0)


class TunedFactor:
    """ALIE (μ + τσ) or IPM (−τμ) with τ searched against the defended round
    (:class:`DefendedAggregate`): the step farthest from the honest mean, over a log grid of τ
    (:data:`TAUS`), then a finer one between the best one's neighbours. byzfl's optimized attacks
    search by a line search from τ = 0 in steps of 10, which a screen's cliff defeats: past the
    norm screen's bound every τ is rejected alike, and the search never looks below it."""

    def __init__(self, name: str, agg: DefendedAggregate, hostile: int) -> None:
        import byzfl

        self.make = {"alie": lambda tau: byzfl.ALittleIsEnough(tau=tau),
                     "ipm": lambda tau: byzfl.InnerProductManipulation(tau=tau)}[name]
        self.agg, self.hostile = agg, hostile
        #: The factor chosen in the last call (for tests and logs).
        self.tau = 0.0

    def __call__(self, honest: np.ndarray) -> np.ndarray:
        full = np.asarray(honest, np.float64)
        seen = self.agg.view(full)
        mean = seen.mean(axis=0)

        def harm(tau: float) -> float:
            vector = np.asarray(self.make(float(tau))(seen.copy()), np.float64)
            step = self.agg(np.concatenate([seen, np.repeat(vector[None], self.hostile, axis=0)]))
            return float(np.linalg.norm(step - mean))

        taus = list(TAUS)
        scores = [harm(t) for t in taus]
        best = int(np.argmax(scores))
        low, high = taus[max(best - 1, 0)], taus[min(best + 1, len(taus) - 1)]
        fine = list(np.linspace(low, high, 9))
        fine_scores = [harm(t) for t in fine]
        self.tau = float(fine[int(np.argmax(fine_scores))]) if max(fine_scores) > scores[best] else float(taus[best])
        return np.asarray(self.make(self.tau)(full.copy()), np.float64)


#: The factors a tuned attack tries first (then a finer grid around the best).
TAUS = tuple(np.geomspace(0.05, 500.0, 25))
#: A tuned attack judges an entry of more values than this on a share of them (DefendedAggregate.see).
SEARCH_WHOLE, SEARCH_SHARE = 10_000, 0.05


class TunedMimic:
    """Mimic (Karimireddy et al. 2022) that copies the honest update whose copies move the
    defended round's step (:class:`DefendedAggregate`) farthest from the honest mean."""

    def __init__(self, agg: DefendedAggregate, hostile: int) -> None:
        self.agg, self.hostile = agg, hostile

    def __call__(self, honest: np.ndarray) -> np.ndarray:
        full = np.asarray(honest, np.float64)
        seen = self.agg.view(full)
        mean = seen.mean(axis=0)
        harm = [np.linalg.norm(self.agg(np.concatenate([seen, np.repeat(h[None], self.hostile, axis=0)])) - mean)
                for h in seen]
        return full[int(np.argmax(harm))]


def colluding_attack(name: str, hostile: int, defence: dict | None = None, per_node: bool = False):  # noqa: ANN201
    """byzfl's attack ``name`` (:data:`COLLUDING`) as a function of the honest updates (n, d) →
    the hostile update (d,). The optimized ones search their factor against the run's aggregator
    chain (``defence``: the run's ``strategy.defence``; the plain average when it has none), with
    ``f`` the hostile nodes; the tuned ones (:data:`TUNED`) against the whole defence the round
    applies (:class:`DefendedAggregate`; ``per_node``: a method with a model per node)."""
    import byzfl

    cls = getattr(byzfl, COLLUDING[name])
    if name in TUNED:
        agg = DefendedAggregate(defence, hostile, per_node)
        return TunedMimic(agg, hostile) if name == "tunedmimic" else TunedFactor(name.removeprefix("tuned"), agg, hostile)
    if not name.startswith("opt"):
        return cls()
    from strategies.aggregators import byzfl_chain

    if defence and defence.get("aggregator", "mean") != "mean":
        pre, agg = byzfl_chain(defence["aggregator"], defence.get("pre_aggregators", []), max(defence.get("f", 0), hostile),
                               defence.get("bucket_size", 2), defence.get("clip_threshold", 2.0))
    else:
        pre, agg = [], byzfl.Average()
    return cls(agg=agg, pre_agg_list=pre, f=hostile)


class CollusionGrid:
    """A Grid between the strategy and the nodes that hands every colluding hostile node the
    honest updates of its round: the train replies of a batch of pushed train messages are held
    until all are in; then each reply marked by a hostile node (:data:`COLLUDING_MARK`) becomes its
    sent model plus ``attack`` of the honest replies' updates (each reply's floating entries minus
    the model its message carried, flattened), and all are handed over. Everything else passes.
    The synchronous rounds only (a batch is what the round pushed): an asynchronous strategy's
    jobs never form one."""

    def __init__(self, grid, attack) -> None:  # noqa: ANN001 - a Flower Grid, a byzfl attack
        self._grid, self.attack = grid, attack
        self._sent: dict[str, object] = {}  # message id -> the ArrayRecord it carried
        self._held: dict[str, object] = {}  # message id -> its reply
        #: Every hostile update made: (round's honest updates, the attack vector), for tests.
        self.made: list[tuple[np.ndarray, np.ndarray]] = []

    def __getattr__(self, name: str):  # noqa: ANN204 - the rest of the Grid's interface
        return getattr(self._grid, name)

    def push_messages(self, messages):  # noqa: ANN001, ANN201
        messages = list(messages)
        ids = list(self._grid.push_messages(messages))
        from fedmm import protocol

        for msg, mid in zip(messages, ids):
            if mid and msg.metadata.message_type == "train" and protocol.ARRAYS in msg.content:
                self._sent[mid] = msg.content[protocol.ARRAYS]
        return ids

    def pull_messages(self, message_ids):  # noqa: ANN001, ANN201
        out = []
        asked = [i for i in message_ids if i not in self._held]  # a pulled reply is the grid's no more
        for reply in self._grid.pull_messages(asked):
            mid = reply.metadata.reply_to_message_id
            if mid in self._sent:
                self._held[mid] = reply
            else:
                out.append(reply)
        if self._sent and set(self._held) >= set(self._sent):
            out += self._release()
        return out

    def _release(self) -> list:
        from fedmm import protocol

        sent = {mid: protocol.record_to_model(record) for mid, record in self._sent.items()}
        replies = dict(self._held)
        self._sent, self._held = {}, {}

        def marked(reply) -> bool:  # noqa: ANN001
            return not reply.has_error() and COLLUDING_MARK in reply.content[protocol.METRICS]

        def keys(model) -> list[str]:  # noqa: ANN001
            return [k for k, v in model.items() if v.dtype.kind == "f"]

        honest = [np.concatenate([np.ravel(np.asarray(m[k], np.float64) - sent[mid][k]) for k in keys(m)])
                  for mid, reply in replies.items() if not reply.has_error() and not marked(reply)
                  for m in [protocol.record_to_model(reply.content[protocol.ARRAYS])]]
        hostile = [mid for mid, reply in replies.items() if marked(reply)]
        if hostile and honest:
            stack = np.stack(honest)
            tuned = getattr(self.attack, "agg", None)
            if isinstance(tuned, DefendedAggregate):  # the tuned attacks unflatten candidates into the model's entries
                base = next(iter(sent.values()))
                tuned.see([(k, base[k].shape) for k in keys(base)])
            vector = np.asarray(self.attack(stack.copy()), np.float64)
            self.made.append((stack, vector))
            for mid in hostile:
                reply, base = replies[mid], sent[mid]
                out, start = dict(base), 0
                for k in keys(base):
                    size = base[k].size
                    out[k] = (base[k] + vector[start:start + size].reshape(base[k].shape)).astype(base[k].dtype)
                    start += size
                reply.content[protocol.ARRAYS] = protocol.model_to_record(out)
        for mid in hostile:
            del replies[mid].content[protocol.METRICS][COLLUDING_MARK]
        return list(replies.values())


#: ``--screen-stats``: rows per class of the server-held balanced set whose loss each update moves.
HELD_OUT_PER_CLASS = 50


def output_updates(updates, sent) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:  # noqa: ANN001 - as below
    """The output layer (:func:`strategies.defence.output_layer`) of each update's change from the
    model it was sent, rows ``[update, class, feature]`` and bias ``[update, class]``, with the sent
    models' own rows; None for a model without an output layer."""
    from fedmm.errors import ConfigError
    from strategies.defence import output_layer

    keys = [k for k, v in sent[0].items() if np.asarray(v).dtype.kind == "f"]
    deltas = [{k: np.asarray(u.model[k], np.float64) - np.asarray(m[k], np.float64) for k in keys} for u, m in zip(updates, sent)]
    try:
        rows, bias = output_layer(deltas, keys)
    except ConfigError:
        return None
    own, _ = output_layer([{k: np.asarray(m[k], np.float64) for k in keys} for m in sent], keys)
    return rows, bias, own


def output_cosines(updates, sent) -> np.ndarray | None:  # noqa: ANN001 - ClientUpdates and their sent models
    """Each update's agreement, class by class, with the round's other updates on the output
    layer (:func:`strategies.defence.output_layer`: one row per class): the cosine of its row-k
    update to the round's coordinate-wise median row-k update, averaged over k weighted by its
    row's norm. None for a model without an output layer."""
    layer = output_updates(updates, sent)
    if layer is None:
        return None
    rows = layer[0]
    median = np.median(rows, axis=0)
    norms = np.linalg.norm(rows, axis=2)  # [update, class]
    scale = norms * np.linalg.norm(median, axis=1)[None]
    cosines = np.divide((rows * median[None]).sum(axis=2), scale, out=np.zeros_like(scale), where=scale > 0)
    total = norms.sum(axis=1)
    return np.divide((cosines * norms).sum(axis=1), total, out=np.zeros_like(total), where=total > 0)


def sent_alignment(updates, sent) -> np.ndarray | None:  # noqa: ANN001 - ClientUpdates and their sent models
    """Each update's agreement with the model it was sent, class by class: for each class k whose
    output bias it raises, the cosine of its row-k update to the sent model's row k less the sent
    rows' mean (the direction that raises class k's logit against the others), averaged over k
    weighted by the bias rise; NaN where it raises none. None for a model without an output
    layer. An honest row k moves toward the features of rows labelled k, which the sent model
    already scores as k; a flipped one toward another class's features."""
    layer = output_updates(updates, sent)
    if layer is None:
        return None
    rows, bias, own = layer
    centred = own - own.mean(axis=1, keepdims=True)  # [update, class, feature]
    scale = np.linalg.norm(rows, axis=2) * np.linalg.norm(centred, axis=2)
    cosines = np.divide((rows * centred).sum(axis=2), scale, out=np.zeros_like(scale), where=scale > 0)
    rise = np.clip(bias, 0, None)
    total = rise.sum(axis=1)
    return np.divide((cosines * rise).sum(axis=1), total, out=np.full(len(updates), np.nan), where=total > 0)


def held_out_loss(cfg: dict):  # noqa: ANN201
    """A function of a model: its cross-entropy on :data:`HELD_OUT_PER_CLASS` rows of each class
    of ``cfg``'s test split (seeded; the set a server could hold to score updates, as Zeno and
    FLTrust do; here it only measures, it decides nothing)."""
    import torch

    from fedmm.config import as_run
    from fedmm.data import input_spec, load_dataset
    from fedmm.models import build_model, model_options

    run = as_run(cfg)
    _, test = load_dataset(run.dataset)
    labels = test.y.numpy()
    rng = np.random.default_rng(0)
    rows = np.concatenate([rng.choice(np.flatnonzero(labels == c), min(HELD_OUT_PER_CLASS, int((labels == c).sum())), replace=False)
                           for c in np.unique(labels)])
    x, y = test.transform.prepare("cpu")(test.x[rows]), test.y[rows]
    net = build_model(run.model.name, input_spec(run.dataset), run.model.projection_dim, model_options(run.model)).eval()

    def loss(model) -> float:  # noqa: ANN001 - a ModelDict
        net.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in model.items()})
        with torch.no_grad():
            return float(torch.nn.functional.cross_entropy(net(x), y))

    return loss


#: The scores whose high end is the suspicious one.
SUSPECT_HIGH = ("norm_ratio", "held_out_loss_change")


class ScreenRecorder(RunObserver):
    """``--screen-stats``: what the defence stage's screens measured of each update, round by
    round, with the partition of the node that sent it (hostile: the experiment's first
    partitions), from the stage's verdict (an observer of the run: ``on_stage``); and the
    scores no screen uses, taken before the stage: :func:`output_cosines`, :func:`sent_alignment`
    and, with ``held_out`` (``begin`` builds it from the experiment's config), the change in
    :func:`held_out_loss` from the model each update was sent to the model it returned."""

    def __init__(self, held_out: bool = False) -> None:
        self.partitions: dict[int, int] = {}
        self.rounds: dict[str, list[list[dict]]] = {}  # by the experiment's output folder
        self.experiment = ""
        self.held_out = held_out
        self.loss = None
        self.losses: dict[str, object] = {}  # by the experiment's dataset and model

    def begin(self, cfg: dict) -> None:
        """The rounds that follow are the experiment of ``cfg``'s."""
        self.experiment = str(cfg["output_dir"])
        if self.held_out:  # built once per dataset and model (a strategy's preset may name its own model)
            key = json.dumps([cfg["dataset"], cfg["model"]], sort_keys=True, default=str)
            self.loss = self.losses.get(key) or self.losses.setdefault(key, held_out_loss(cfg))

    def of(self, cfg: dict) -> list[list[dict]]:
        """The rounds recorded for the experiment of ``cfg``."""
        return self.rounds.get(str(cfg["output_dir"]), [])

    def on_stage(self, server_round: int, updates, verdict) -> None:  # noqa: ANN001
        """The stage's verdict on a round's updates (each with its ``sent`` model), with the
        scores no screen uses, taken from the same updates and sent models."""
        if not verdict.scores:
            return
        sent = [u.sent for u in updates]
        cosines = output_cosines(updates, sent) if len(updates) >= 3 else None
        extra = {} if cosines is None else {"output_cosine": cosines, "sent_alignment": sent_alignment(updates, sent)}
        if extra and self.loss is not None:
            extra["held_out_loss_change"] = np.array([self.loss(u.model) - self.loss(m) for u, m in zip(updates, sent)])
        rejected = {id(u) for u, _ in verdict.rejected}
        self.rounds.setdefault(self.experiment, []).append([
            {"partition": self.partitions.get(u.node_id, -1), "rejected": id(u) in rejected,
             **{name: float(values[i]) for name, values in {**verdict.scores, **extra}.items()}}
            for i, u in enumerate(updates)])


def screen_table(rows: list[dict]) -> str:
    """Markdown: per experiment with ``screen_stats`` and per score, the honest updates' lowest
    and median value, the hostile ones' range, and the rounds in which every hostile update
    scored worse than every honest one (lower cosine, sign, class or output agreement, higher norm
    ratio or held-out loss change); a NaN score (not compared) is left out."""
    lines = ["| strategy | experiment | score | honest: worst, median | hostile: range | rounds apart |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        rounds = row.get("screen_stats") or []
        hostile = experiment(row["fault"])[1] if row["fault"].split("+")[0] != "clean" else 0
        for score in ("cosine", "sign_agreement", "norm_ratio", "class_agreement", "output_cosine", "sent_alignment",
                      "held_out_loss_change"):
            # NaN: not scored (class_agreement: no other update raised the update's classes)
            per_round = [([u[score] for u in r if u["partition"] >= hostile and u[score] == u[score]],
                          [u[score] for u in r if 0 <= u["partition"] < hostile and u[score] == u[score]])
                         for r in rounds if score in r[0]]
            per_round = [(h, b) for h, b in per_round if h]
            if not per_round:
                continue
            honest = [v for h, _ in per_round for v in h]
            bad = [v for _, b in per_round for v in b]
            high = score in SUSPECT_HIGH
            worst = max(honest) if high else min(honest)
            apart = sum(1 for h, b in per_round if b and (min(b) > max(h) if high else max(b) < min(h)))
            lines.append(f"| {row['strategy']} | {row['fault']} | {score} | {worst:.3f}, {float(np.median(honest)):.3f} | "
                         + (f"{min(bad):.3f} to {max(bad):.3f} | {apart} of {len(per_round)}" if bad else "– | –") + " |")
    return "\n".join(lines)


def run_strategy(strategy: str, root: Path, attacks: tuple[str, ...] = (), hostile: tuple[int, ...] = (1,),  # noqa: PLR0913
                 defence: tuple[str, ...] = DEFENCE, rounds: int = 20, engine: str = "local",
                 overrides: tuple[str, ...] = (), arms: tuple[str, ...] = ("", "+defence"),
                 recorder: ScreenRecorder | None = None, clean: bool = True) -> list[dict]:
    from flwr.serverapp import Grid, ServerApp

    from fedmm.config import compose, to_container
    from server_app.runner import run_experiment
    if attacks:
        faults = [f + d for f in [*(["clean"] if clean else []), *(f"{a}-{n}" for n in hostile for a in attacks if a)]
                  for d in arms]
        cfgs = [
            to_container(compose([
                f"strategy={strategy}", "num_clients=10", "clients_per_round=10", f"num_rounds={rounds}",
                f"eval_every={rounds}", "round_timeout=300", f"simulation.engine={engine}", "simulation.vectorize=off",
                f"output_dir={root / strategy / fault}", *overrides, *(defence if fault.endswith("+defence") else []),
            ]))
            for fault in faults
        ]
    else:
        faults = list(FAULTS)
        cfgs = [
            to_container(compose([
                f"strategy={strategy}", "num_clients=10", "clients_per_round=5", "num_rounds=2", "training.local_epochs=1",
                # a short timeout only where it is the fault: elsewhere a slow start (Ray's workers) is no failure
                f"round_timeout={6 if fault == 'straggler' else 300}", f"simulation.engine={engine}",
                f"output_dir={root / strategy / fault}",
            ]))
            for fault in faults
        ]
    app = ServerApp()
    per_node = compose([f"strategy={strategy}"]).strategy.strategy_class.holds == "a model per node"

    @app.main()
    def main(grid: Grid, context) -> None:  # noqa: ANN001
        for cfg in cfgs:
            if recorder is not None:
                recorder.begin(cfg)
            attack, hostile_nodes, _ = experiment(Path(cfg["output_dir"]).name)
            through = grid if attack not in COLLUDING else CollusionGrid(
                grid, colluding_attack(attack, hostile_nodes, cfg["strategy"].get("defence"), per_node))
            try:
                run_experiment(through, cfg, observers=[recorder] if recorder is not None else ())
            except Exception:  # noqa: BLE001 - the row records the status
                pass

    simulate(app, cfgs[0], engine, None if recorder is None else recorder.partitions)
    rows = []
    for fault, cfg in zip(faults, cfgs):
        rows.append({"strategy": strategy, "fault": fault, **outcome(cfg)})
        if recorder is not None:
            rows[-1]["screen_stats"] = recorder.of(cfg)
        if attacks and (Path(cfg["output_dir"]) / "final_model.pt").exists():
            rows[-1]["backdoor_success"] = backdoor_success(cfg)
    return rows


def simulate(app, cfg: dict, engine: str, partitions: dict[int, int] | None = None) -> None:  # noqa: ANN001
    """The experiments' ServerApp on the in-process engine or Flower's on Ray (``partitions``:
    filled in this process only, so on the in-process engine)."""
    if engine == "local":
        from fedmm.local_engine import run_local_simulation

        run_local_simulation(server_app=app, client_app=faulty_client_app(partitions), num_supernodes=cfg["num_clients"])
    else:
        from flwr.simulation import run_simulation

        from launch.cli import backend_config

        run_simulation(server_app=app, client_app=faulty_client_app(), num_supernodes=cfg["num_clients"],
                       backend_config=backend_config(cfg))


def outcome(cfg: dict) -> dict:
    """What an experiment's folder says: status, accepted replies, final accuracy, models lost."""
    import torch

    run = Path(cfg["output_dir"])
    summary = json.loads((run / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lost = 0
    if (run / "final_models.npz").exists():
        with np.load(run / "final_models.npz") as pool:
            indices = {name.split("/")[0] for name in pool.files}
            lost = cfg["clients_per_round"] - len(indices)
            lost += len({n.split("/")[0] for n in pool.files if pool[n].dtype.kind == "f" and not np.isfinite(pool[n]).all()})
    if (run / "final_model.pt").exists():  # a run that failed (e.g. every reply rejected) wrote none
        final = torch.load(run / "final_model.pt", weights_only=True)
        lost += sum(1 for v in final.values() if v.is_floating_point() and not torch.isfinite(v).all())
    return {
        "status": summary["status"], **({"reason": summary["reason"]} if "reason" in summary else {}),
        "replies": [m.get("replies") for m in metrics[1:]],
        "final_accuracy": metrics[-1]["accuracy"], "models_lost": lost,
        "largest_update_norm": max((m.get("largest_update_norm", 0.0) for m in metrics[1:]), default=0.0),
        "screened": sum(m.get("updates_screened", 0.0) for m in metrics[1:]),
    }


def backdoor_success(cfg: dict) -> float:
    """Share of the test images of other labels than the target that the final model puts in
    the target class once stamped with the trigger."""
    import torch

    from fedmm.config import as_run
    from fedmm.data import input_spec, load_dataset
    from fedmm.models import build_model, model_options

    run = as_run(cfg)
    _, test = load_dataset(run.dataset)
    model = build_model(run.model.name, input_spec(run.dataset), run.model.projection_dim, model_options(run.model))
    model.load_state_dict(torch.load(Path(cfg["output_dir"]) / "final_model.pt", weights_only=True))
    model.eval()
    others = test.y != TARGET
    with torch.no_grad():
        predicted = model(test.transform.prepare("cpu")(stamp(test.x[others]))).argmax(dim=1)
    return float((predicted == TARGET).float().mean())


def attack_table(rows: list[dict], attacks: tuple[str, ...], hostile: list[int]) -> str:
    """Markdown: final accuracy off / on per strategy and attack (backdoor: and its success rate)."""
    def cell(fault: str, strategy: str) -> str:
        row = next((r for r in rows if r["strategy"] == strategy and r["fault"] == fault), None)
        if row is None:
            return "–"
        text = f"{row['final_accuracy']:.3f}" + ("" if row["status"] == "completed" else f" ({row['status']})")
        return text + (f" [{row['backdoor_success']:.2f}]" if fault.startswith("backdoor") and "backdoor_success" in row else "")

    columns = ["clean", *(f"{a}-{n}" for n in hostile for a in attacks if a)]
    lines = ["| strategy | defence | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns)]
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        for suffix, label in (("", "off"), ("+defence", "on")):
            lines.append(f"| {strategy} | {label} | " + " | ".join(cell(c + suffix, strategy) for c in columns) + " |")
    return "\n".join(lines)


def seeds_table(files: list[str], against: str = "clean") -> tuple[str, dict]:
    """Markdown and numbers: each defended attack's gap in points to a reference run of its own
    seed, averaged over the seeds, from ``--attacks`` result files of the same length (rounds,
    every override but ``seed``). Only the rows run with the strategy's default defence
    (:func:`default_defence`) count. ``against="clean"``: the clean run with the defence off
    where a file has it for that seed, else the defended clean run (the note under the table
    says which). ``against="absent"``: the defended free-rider run with as many hostile nodes,
    the federation without their updates as the defence leaves it (the free rider's update is
    zero, rejected by the sign screen in every round): what a defence that rejected every
    hostile update would have reached."""
    length, cells = None, {}  # cells[(strategy, fault)][seed] = [accuracy, ...]
    for name in files:
        data = json.loads(Path(name).read_text())
        seed = next((int(s.partition("=")[2]) for s in data["set"] if s.startswith("seed=")), 0)
        this = (data["rounds"], sorted(s for s in data["set"] if not s.startswith("seed=")))
        if length not in (None, this):
            raise SystemExit(f"{name}: rounds/overrides {this} differ from the other files' {length}")
        length = this
        for row in data["rows"]:
            strategy, fault = row["strategy"], row["fault"]
            defence = data["defence"][strategy] if isinstance(data["defence"], dict) else data["defence"]
            if fault.endswith("+defence") and set(defence) != set(default_defence(strategy)):
                continue
            cells.setdefault((strategy, fault), {}).setdefault(seed, []).append(row["final_accuracy"])

    notes = set()

    def reference(strategy: str, column: str, seed: int) -> list[float] | None:
        if against == "absent":
            return cells.get((strategy, f"freerider-{experiment(column)[1]}+defence"), {}).get(seed)
        clean = cells.get((strategy, "clean"), {}).get(seed)
        notes.add("the clean run with the defence off" if clean else "the defended clean run")
        return clean or cells.get((strategy, "clean+defence"), {}).get(seed)

    strategies = list(dict.fromkeys(s for s, _ in cells))
    columns = [c for c in dict.fromkeys(f.removesuffix("+defence") for _, f in cells if f.endswith("+defence"))
               if c != "clean" and experiment(c)[0] != ABSENT and not (against == "absent" and c.startswith("freerider"))]
    summary = {strategy: {column: [100 * (float(np.mean(values)) - float(np.mean(ref)))
                                   for seed, values in sorted(cells.get((strategy, column + "+defence"), {}).items())
                                   if (ref := reference(strategy, column, seed))]
                          for column in columns} for strategy in strategies}

    def cell(gaps: list[float]) -> str:
        if not gaps:
            return "–"
        mark = "**" if round(float(np.mean(gaps)), 1) >= -2 else ""
        spread = f" ({min(gaps):+.1f} to {max(gaps):+.1f})" if len(gaps) > 1 else ""
        return f"{mark}{np.mean(gaps):+.1f}{mark}{spread} n={len(gaps)}"

    lines = ["| strategy | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    lines += [f"| {strategy} | " + " | ".join(cell(summary[strategy][c]) for c in columns) + " |" for strategy in strategies]
    what = "the defended free-rider run with as many hostile nodes" if against == "absent" else " or ".join(sorted(notes, reverse=True))
    return "\n".join(lines) + f"\n\nPoints from {what} (mean over seeds, paired; the seeds' range; bold: within 2 points).", summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", default=["fedavg", "fedmr", "fedcross"])
    parser.add_argument("--attacks", nargs="*", default=None, choices=(*ATTACKS, *COLLUDING, ABSENT),
                        help=f"hostile clients, the defences off and on (no value: all of {', '.join(ATTACKS)}; "
                             f"{', '.join(COLLUDING)}: byzfl's colluding attacks, computed from the round's honest "
                             f"updates; {ABSENT}: the hostile nodes never answer)")
    parser.add_argument("--hostile", nargs="+", type=int, default=[1], help="--attacks: hostile nodes of 10 (one run each)")
    parser.add_argument("--rounds", type=int, default=20, help="--attacks: rounds per run")
    parser.add_argument("--set", nargs="*", default=[], help="--attacks: overrides of every run (e.g. training.local_epochs=1)")
    parser.add_argument("--defence", nargs="+", default=None,
                        help="--attacks: the defended rows' overrides (default: DEFENCE; for PER_MODEL_METHODS "
                             "without NOT_PER_MODEL, with PER_MODEL)")
    parser.add_argument("--defended-only", action="store_true",
                        help="--attacks: only the defended runs (e.g. to compare defence settings)")
    parser.add_argument("--engine", choices=["local", "ray"], default="local",
                        help="the simulation engine (simulation.engine): in process, or Flower's on Ray")
    parser.add_argument("--out", default=None, help="default bench/results/faults.json (--attacks: attacks.json)")
    parser.add_argument("--clean-only", action="store_true", help="--attacks: only the clean runs, the defence off and on")
    parser.add_argument("--screen-stats", action="store_true",
                        help="--attacks: record what the screens measured of each update, honest and hostile")
    parser.add_argument("--held-out", action="store_true",
                        help="--screen-stats: and each update's change in loss on a balanced set of test rows")
    parser.add_argument("--summarize", nargs="+", metavar="FILE", default=None,
                        help="no runs: each defended attack's gap to the clean run over the seeds of these --attacks files")
    args = parser.parse_args()
    if args.held_out and not args.screen_stats:
        parser.error("--held-out adds a score to --screen-stats: give both")
    if args.summarize:
        print(seeds_table(args.summarize)[0], seeds_table(args.summarize, "absent")[0], sep="\n\n")
        return
    attacks = tuple(args.attacks or ATTACKS) if args.attacks is not None else ()
    from fedmm.config import compose

    if any(a in COLLUDING for a in attacks) and any(compose([f"strategy={s}"]).strategy.asynchronous.enabled
                                                     for s in args.strategies):
        parser.error(f"{', '.join(COLLUDING)} need synchronous rounds (the colluders see the round's honest updates)")
    if args.clean_only:
        attacks = ("",)  # the clean experiment alone (see run_strategy)
    args.out = args.out or str(Path(__file__).parent / "results" / ("attacks.json" if attacks else "faults.json"))
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    root = Path(tempfile.mkdtemp(prefix="fedmm-faults-"))
    defences = {strategy: tuple(args.defence) if args.defence else default_defence(strategy) for strategy in args.strategies}
    recorder = ScreenRecorder(held_out=args.held_out) if args.screen_stats else None
    rows = [row for strategy in args.strategies
            for row in run_strategy(strategy, root, attacks, tuple(args.hostile), defences[strategy], args.rounds,
                                    args.engine, tuple(args.set), ("+defence",) if args.defended_only else ("", "+defence"),
                                    recorder)]
    if attacks:
        print(attack_table(rows, attacks, args.hostile))
        if recorder is not None:
            print(screen_table(rows))
        Path(args.out).write_text(json.dumps({"defence": {k: list(v) for k, v in defences.items()}, "rounds": args.rounds,
                                              "set": args.set, "runs_in": str(root), "rows": rows}, indent=2))
        return
    print("| strategy | fault | status | accepted replies per round (of 5) | final accuracy | models lost |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['strategy']} | {r['fault']} | {r['status']} | {', '.join(map(str, r['replies']))} | "
              f"{r['final_accuracy']:.3f} | {r['models_lost']} |")
    Path(args.out).write_text(json.dumps({"runs_in": str(root), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
