"""What the run config costs each train message: the ``fedmm-config`` JSON against the same
settings as named Flower config values, and against the model the message carries.

    .venv/bin/python bench/run_config_blob.py [--repeat 200] [--out bench/results/run_config_blob.json]

For a few presets (the default job, the FedMR and FedCross table presets, a text task): the
JSON's bytes; the train message on Flower's wire (its protobuf, ``message_to_proto``) with the
blob, with the same settings as one named config value each (``training.lr``: what a reader of
the message would see instead), and without either; the model's share; the server's time to
write the JSON once (it is written once per run and shared by every message); and a ClientApp's
time to read it into its typed settings from a cold cache (``fedmm.config.client_run``: what a
deployed SuperNode's fresh ClientApp process pays once per message).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord
from flwr.common.serde import message_to_proto

from fedmm import protocol
from fedmm.config import client_run, compose
from fedmm.data import input_spec
from fedmm.models import model_for

#: name -> hydra overrides of the presets measured.
PRESETS = {
    "default (FedAvg, CNN, mnist5k)": [],
    "kdd_table1_dirichlet (FedMR, ResNet-20, CIFAR-10)": ["+experiment=kdd_table1_dirichlet", "strategy=fedmr"],
    "fedcross_table2_vgg16_iid (FedCross, VGG-16)": ["+experiment=fedcross_table2_vgg16_iid", "strategy=fedcross"],
    "fedcross_sent140 (FedCross, LSTM)": ["+experiment=fedcross_sent140", "strategy=fedcross"],
}


def flattened(cfg: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The settings as named config values (``training.lr``); lists and None as JSON strings
    (a ConfigRecord holds scalars, strings, bytes and lists of one type)."""
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        if isinstance(value, dict):
            out.update(flattened(value, f"{prefix}{key}."))
        elif value is None or isinstance(value, list):
            out[f"{prefix}{key}"] = json.dumps(value)
        else:
            out[f"{prefix}{key}"] = value
    return out


def wire_bytes(model_record: Any, config: dict[str, Any]) -> int:
    """Bytes of a train message with ``config`` on Flower's wire (its protobuf)."""
    msg = protocol.server_message(protocol.TRAIN, 1, {protocol.SERVER_ROUND: 1, protocol.MODEL_INDEX: 0, **config},
                                  model_record)
    msg.metadata.__dict__["_message_id"] = "0" * 64  # as a pushed message carries one
    return message_to_proto(msg).ByteSize()


def median_seconds(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(name: str, overrides: list[str], repeat: int) -> dict[str, Any]:
    run = compose(overrides)
    cfg = run.to_dict()
    model = model_for(cfg, input_spec(cfg["dataset"]))
    record = protocol.model_to_record({k: v.detach().numpy() for k, v in model.state_dict().items()})
    blob = protocol.run_config_record(cfg)
    named = flattened(cfg)
    ConfigRecord(named)  # every value is one a ConfigRecord holds

    def read_cold() -> None:
        client_run.cache_clear()
        client_run(blob)

    bare = wire_bytes(record, {})
    return {
        "preset": name,
        "json_bytes": len(blob.encode()),
        "named_values": len(named),
        "message_bytes_blob": wire_bytes(record, {protocol.RUN_CONFIG: blob}),
        "message_bytes_named": wire_bytes(record, named),
        "message_bytes_without": bare,
        "model_bytes": sum(len(a.data) for a in record.values()),
        "write_json_s": median_seconds(lambda: protocol.run_config_record(cfg), repeat),
        "client_read_cold_s": median_seconds(read_cold, repeat),
    }


def main() -> None:
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # as inside a ServerApp
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--out", default="bench/results/run_config_blob.json")
    args = parser.parse_args()
    rows = [measure(name, overrides, args.repeat) for name, overrides in PRESETS.items()]
    print(f"{'preset':52s} {'JSON B':>7s} {'keys':>5s} {'msg+blob B':>11s} {'msg+named B':>12s} {'msg w/o B':>10s} "
          f"{'blob %':>7s} {'write us':>9s} {'read ms':>8s}")
    for r in rows:
        extra = r["message_bytes_blob"] - r["message_bytes_without"]
        print(f"{r['preset']:52s} {r['json_bytes']:7d} {r['named_values']:5d} {r['message_bytes_blob']:11d} "
              f"{r['message_bytes_named']:12d} {r['message_bytes_without']:10d} {100 * extra / r['message_bytes_blob']:6.2f}% "
              f"{r['write_json_s'] * 1e6:9.0f} {r['client_read_cold_s'] * 1e3:8.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"host": platform.node(), "python": platform.python_version(), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
