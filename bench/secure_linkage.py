"""How much provenance does secure recombination hide from the server? The linkage attack.

    python bench/secure_linkage.py                 # K = 10 clients, the embedded default
    python bench/secure_linkage.py --clients 5 --quick

An honest-but-curious server sees what it dispatched (it builds the K models), what comes back,
and the routing metadata of every relayed ciphertext (exchange, repetition, stage, sender,
receiver, size). Its best attack here, for every uploaded layer:

1. **Routing.** For each layer index j, the positions a layer can take through one exchange
   follow from the relayed edges that can carry index j (without padding a ciphertext's size
   names its index; with padding every edge carries a given index with probability 1/len(w)):
   in stage 1 the sender's own layer goes to the receiver; in stage 3 the receiver returns a
   uniformly random element of its buffer. The marginal matrices M_j[x, v] = P(the layer at x
   at the start of the exchange is at v at the end) compose over repetitions (a product of
   stochastic matrices: each repetition applies independent uniform bijections).
2. **Similarity.** A trained layer stays close to its starting point: the nearest dispatched
   layer of the same index (L2) names the slot it started from.
3. **Attribution.** ``after``: the trainer is the routing-feasible node (M[t, u] > 0) whose
   dispatched layer is nearest. ``before``: the uploader trained what it uploads. ``both``: the
   start s (nearest dispatched layer), then the trainer t = argmax M_before[s, t]·M_after[t, u].
   Plain FedMR: the uploader.

The ground truth comes from the clients (which trained layer is where, compared byte for byte).
The clients are the real ClientApp handlers (real local training on the embedded data) behind an
in-process grid; the server is the real strategy. Before the measured round, ``--warmup`` plain
FedMR rounds make the K dispatched models differ (at round 1 they are identical and the
similarity step has nothing to match). Every configuration runs the same measured round from the
same server state.

Bytes per round are the relayed ciphertext bytes on the wire (each crosses two links:
client → server → client), against the paper's Eq. 26-27 estimate on a star topology,
2·K·(n_l + n_u)·size(w)/len(w) per repetition. Seconds per round are in-process (training,
sealing, state), against plain FedMR's round on the same grid; the Flower round trips come on
top (see docs/secure_recombination.md). Writes bench/results/secure_linkage.json and prints a
markdown table.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedmm.observers import RunObserver  # noqa: E402
from fedmm.secure import RETURN, SEND  # noqa: E402


# ============================================================================ the attack
def routing_matrices(trace: list[Any], exchange: str, nodes: list[int], sizes: list[int]) -> list[np.ndarray]:
    """M_j (one K×K row-stochastic matrix per layer index j) of the completed attempt of
    ``exchange``: row x = where the layer at node x at the start of the exchange can be at its
    end, with probabilities (identity when the exchange did not run)."""
    num_layers, k = len(sizes), len(nodes)
    position = {node: i for i, node in enumerate(nodes)}
    relays = [r for r in trace if r.exchange == exchange]
    if not relays:
        return [np.eye(k) for _ in range(num_layers)]
    attempt = max(r.attempt for r in relays)  # earlier attempts were rolled back
    relays = [r for r in relays if r.attempt == attempt and r.src in position and r.dst in position]
    by_size: dict[int, list[int]] = {}
    for j, size in enumerate(sizes):
        by_size.setdefault(size, []).append(j)
    matrices = []
    for j in range(num_layers):
        total = np.eye(k)
        for repetition in sorted({r.repetition for r in relays}):
            sent = [r for r in relays if r.repetition == repetition and r.stage == SEND]
            edges = [(position[r.src], position[r.dst], _carries(r.nbytes, j, by_size)) for r in sent]
            total = total @ _repetition_matrix(edges, k)
        matrices.append(total)
    return matrices


def _carries(nbytes: int, j: int, by_size: dict[int, list[int]]) -> float:
    candidates = by_size.get(nbytes, [])
    return 1.0 / len(candidates) if j in candidates else 0.0


def _repetition_matrix(edges: list[tuple[int, int, float]], k: int) -> np.ndarray:
    """T[x, v]: the layer of index j at x before the repetition is at v after it. ``edges``:
    stage-1 (sender, receiver, P(the edge carries index j)); stage 3 returns along them."""
    sent = np.zeros(k)
    for a, _, q in edges:
        sent[a] += q
    sent = np.minimum(sent, 1.0)
    # slots[b]: where the elements of b's buffer go (uniformly, in proportion to the slots' mass):
    # b's own final slot (if it kept its layer) and one return to each sender
    slots = np.zeros((k, k))
    for b in range(k):
        slots[b, b] += 1.0 - sent[b]
    for a, b, q in edges:
        slots[b, a] += q
    mass = slots.sum(axis=1, keepdims=True)
    slots = np.divide(slots, mass, out=np.zeros_like(slots), where=mass > 0)
    out = np.zeros((k, k))
    for x in range(k):
        out[x] += (1.0 - sent[x]) * slots[x]
    for a, b, q in edges:
        out[a] += q * slots[b]
    return out


def attribute(
    mode: str | None, uploads: dict[int, dict[str, np.ndarray]], dispatched: dict[int, dict[str, np.ndarray]],
    trace: list[Any], units: list[list[str]], sizes: list[int],
) -> dict[tuple[int, int], int]:
    """The server's guess of the trainer of every uploaded layer: (uploader, index) -> node."""
    nodes = sorted(uploads)
    everyone = sorted(dispatched)
    guess: dict[tuple[int, int], int] = {}
    before = routing_matrices(trace, "before", everyone, sizes) if mode in ("before", "both") else None
    after = routing_matrices(trace, "after", everyone, sizes) if mode in ("after", "both") else None
    col = {node: i for i, node in enumerate(everyone)}
    for u in nodes:
        for j, unit in enumerate(units):
            distance = {s: sum(float(np.sum((uploads[u][k].astype(np.float64) - dispatched[s][k].astype(np.float64)) ** 2)) for k in unit) for s in everyone}
            if mode in (None, "before"):
                guess[(u, j)] = u
            elif mode == "after":
                feasible = [t for t in everyone if after[j][col[t], col[u]] > 0] or everyone
                guess[(u, j)] = min(feasible, key=lambda t: distance[t])
            else:
                reach = before[j] @ after[j]
                feasible = [s for s in everyone if reach[col[s], col[u]] > 0] or everyone
                start = min(feasible, key=lambda s: distance[s])
                score = {t: before[j][col[start], col[t]] * after[j][col[t], col[u]] for t in everyone}
                guess[(u, j)] = max(everyone, key=lambda t: (score[t], -col[t]))
    return guess


def true_trainers(uploads: dict[int, dict[str, np.ndarray]], trained: dict[int, dict[str, np.ndarray]], units: list[list[str]]) -> dict[tuple[int, int], int]:
    """(uploader, index) -> the node whose trained layer it is (bytes equal). Layers that several
    clients hold byte for byte (e.g. an integer counter every client advanced alike) have no
    single trainer and are left out."""
    truth = {}
    for u, model in uploads.items():
        for j, unit in enumerate(units):
            raw = b"".join(np.ascontiguousarray(model[k]).tobytes() for k in unit)
            owners = [t for t, m in trained.items() if b"".join(np.ascontiguousarray(m[k]).tobytes() for k in unit) == raw]
            if not owners:
                raise RuntimeError(f"uploaded layer {j} of node {u} matches no trained layer: a layer was lost or changed")
            if len(owners) == 1:
                truth[(u, j)] = owners[0]
    return truth


# ============================================================================ the harness
class Harness:
    """K real ClientApps (handlers of client_app.client_app) behind an in-process grid."""

    def __init__(self, cfg: dict[str, Any], num_nodes: int, seed: int) -> None:
        from flwr.app import Context, RecordDict

        from client_app import client_app as real
        from client_app import secure as client_secure
        from tests.fakes import FakeGrid

        self.real, self.client_secure = real, client_secure
        self.grid = FakeGrid(self, num_nodes=num_nodes, seed=seed)
        self.contexts = {
            key: Context(run_id=1, node_id=node, node_config={"partition-id": int(key.split(":")[1]), "num-partitions": num_nodes},
                         state=RecordDict(), run_config={})
            for node, key in self.grid.keys.items()
        }
        self.node_of = {key: node for node, key in self.grid.keys.items()}
        self.trained: dict[int, dict[str, np.ndarray]] = {}

    def _train(self, cfg, context, server_round, model):  # noqa: ANN001, ANN202
        out, metrics = self.real.secure_train(cfg, context, server_round, model)
        self.trained[int(context.node_id)] = out
        return out, metrics

    def __call__(self, msg, key: str):  # noqa: ANN001, ANN204
        context = self.contexts[key]
        if msg.metadata.message_type == "train":
            return self.real.train(msg, context).content
        return self.client_secure.handle(msg, context, self._train).content


class Uploads(RunObserver):
    """The models the method aggregates (each node's upload) and their slots, as an observer of
    the round (:mod:`fedmm.observers`)."""

    def __init__(self) -> None:
        self.models: dict[int, dict[str, np.ndarray]] = {}
        self.slots: dict[int, int] = {}

    def on_aggregate(self, server_round: int, updates: Any) -> None:
        for update in updates:
            self.models[update.node_id] = {k: np.array(v) for k, v in update.model.items()}
            self.slots[update.node_id] = update.slot


def build(cfg: dict[str, Any], secure: dict[str, Any] | None, observers: Any = ()) -> Any:
    from strategies import build_strategy
    from strategies.contract import model_index

    run_cfg = copy.deepcopy(cfg)
    if secure is not None:
        run_cfg["strategy"]["secure"] = {**run_cfg["strategy"]["secure"], **secure, "enabled": True}
    return build_strategy(run_cfg, observers)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from flwr.app import ConfigRecord

    from fedmm import protocol
    from fedmm.config import compose, to_container
    from fedmm.layers import layer_units
    from fedmm.secure import LayerCodec
    import torch
    from flwr.app import ArrayRecord

    from fedmm.data import input_spec
    from fedmm.models import model_for

    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # messages built outside a Flower run
    cfg = to_container(compose([
        "strategy=fedmr", f"num_clients={args.clients}", f"clients_per_round={args.clients}", f"seed={args.seed}",
        f"training.local_epochs={args.epochs}", f"partition.alpha={args.alpha}",
    ]))
    harness = Harness(cfg, args.clients, args.seed)
    config = ConfigRecord({protocol.RUN_CONFIG: protocol.run_config_record(cfg)})
    plain = build(cfg, None)
    torch.manual_seed(args.seed)
    arrays = ArrayRecord(model_for(cfg, input_spec(cfg["dataset"])).state_dict())
    for server_round in range(1, args.warmup + 1):
        plain.context.driver.run(server_round, harness.grid, arrays, config, timeout=600)
    harness.grid.sent.clear()
    state = copy.deepcopy(plain.context.state_dict())
    measured_round = args.warmup + 1
    spec = protocol.array_spec(plain.models[0])
    units = layer_units(list(spec), "tensor")
    codec = LayerCodec(spec, units, pad=False)
    sizes = [codec.wire_bytes(j) for j in range(len(units))]
    model_bytes = sum(codec.sizes)
    num_layers = len(units)

    def one_round(secure: dict[str, Any] | None) -> dict[str, Any]:
        seen = Uploads()
        strategy = build(cfg, secure, [seen])
        strategy.context.load_state_dict(copy.deepcopy(state))
        harness.trained = {}
        uploads, slots = seen.models, seen.slots
        dispatched_models = [dict(m) for m in strategy.models]
        start = time.perf_counter()
        strategy.context.driver.run(measured_round, harness.grid, arrays, config, timeout=600)
        seconds = time.perf_counter() - start
        harness.grid.sent.clear()  # the in-process grid keeps every message it delivered
        if secure is None:
            # plain FedMR: every node uploads what it trained, from the model of its slot
            trained, trace, mode = dict(uploads), [], None
            dispatched = {u: dispatched_models[model_index(strategy, slot)] for u, slot in slots.items()}
        else:
            trained, trace, mode = dict(harness.trained), list(strategy.context.driver.relay.trace), secure["mode"]
            dispatched = dict(strategy.context.driver.relay.dispatched)
        truth = true_trainers(uploads, trained, units)
        wire_sizes = [LayerCodec(spec, units, pad=bool(secure and secure.get("pad"))).wire_bytes(j) for j in range(num_layers)]
        guess = attribute(mode, uploads, dispatched, trace, units, wire_sizes)
        guess = {key: guess[key] for key in truth}
        params = [codec.sizes[j] for _, j in truth]
        right = [guess[key] == truth[key] for key in truth]
        log = strategy.round_log
        repetitions = (secure or {}).get("repetitions", 0)
        exchanges = {"before": 1, "after": 1, "both": 2}.get(mode or "", 0)
        low, high = strategy.context.driver.relay.layer_bounds(num_layers) if secure else (0, 0)
        estimate = exchanges * repetitions * 2 * args.clients * (low + high) * model_bytes / num_layers
        return {
            "mode": mode or "plain", "repetitions": repetitions, "max_layers": high if secure else 0, "pad": bool(secure and secure.get("pad")),
            "attributed": float(np.mean(right)), "attributed_by_params": float(np.dot(right, params) / sum(params)),
            "exchanged": log.get("secure_exchanged", 1.0),
            "wire_bytes": 2.0 * log.get("secure_relayed_bytes", 0.0), "eq27_bytes": float(estimate),
            "round_trips": log.get("secure_round_trips", 1.0), "seconds": seconds,
        }

    def trials(secure: dict[str, Any] | None) -> dict[str, Any]:
        # the same round again with fresh client randomness: mean of the numbers, range of the attack
        runs = [one_round(secure) for _ in range(1 if secure is None else args.trials)]
        row = dict(runs[0])
        for key in ("attributed", "attributed_by_params", "exchanged", "wire_bytes", "round_trips", "seconds"):
            row[key] = float(np.mean([r[key] for r in runs]))
        row["attributed_min"], row["attributed_max"] = min(r["attributed"] for r in runs), max(r["attributed"] for r in runs)
        row["trials"] = len(runs)
        return row

    rows = [trials(None)]
    high_options = sorted({1, max(1, num_layers // 4), max(1, num_layers // 2)})
    for mode, repetitions, high in itertools.product(("before", "after", "both"), args.repetitions, high_options):
        rows.append(trials({"mode": mode, "repetitions": repetitions, "min_layers": 1, "max_layers": high, "pad": False}))
    if not args.quick:
        for repetitions in args.repetitions:
            rows.append(trials({"mode": "both", "repetitions": repetitions, "min_layers": 1, "max_layers": max(1, num_layers // 2), "pad": True}))
    return {
        "clients": args.clients, "seed": args.seed, "warmup_rounds": args.warmup, "local_epochs": args.epochs, "alpha": args.alpha,
        "layers": num_layers, "model_bytes": model_bytes, "chance": 1.0 / args.clients, "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--repetitions", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--trials", type=int, default=3, help="runs of each configuration (fresh client randomness)")
    parser.add_argument("--quick", action="store_true", help="no padded rows")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "secure_linkage.json"))
    args = parser.parse_args()
    result = measure(args)
    print(f"K = {result['clients']} clients, {result['layers']} layers, model {result['model_bytes'] / 1e6:.2f} MB; chance = {result['chance']:.0%}")
    print(f"| mode | r_s | n_u | pad | layers attributed (range over {args.trials} trials) | parameters attributed | MB on the wire | Eq. 27 MB | round trips | s / round |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        spread = f" ({r['attributed_min']:.0%}-{r['attributed_max']:.0%})" if r["trials"] > 1 else ""
        print(f"| {r['mode']} | {r['repetitions'] or '-'} | {r['max_layers'] or '-'} | {'yes' if r['pad'] else 'no'} | {r['attributed']:.0%}{spread} | "
              f"{r['attributed_by_params']:.0%} | {r['wire_bytes'] / 1e6:.1f} | {r['eq27_bytes'] / 1e6:.1f} | {r['round_trips']:.0f} | {r['seconds']:.2f} |")
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
