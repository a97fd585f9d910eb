"""Text tasks on LEAF-format folders the tests write: loading, natural partitions, vocabulary,
GloVe vectors, clear errors, the LSTMs, and every strategy for 2 rounds on both tasks in one real
simulation. Nothing touches the network."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedmm.config import compose, to_container
from fedmm.data import input_spec, load_dataset, load_partition, partition_indices
from fedmm.data.text import ALPHABET, PAD, UNK, build_vocabulary, encode_words, load_glove
from fedmm.errors import ConfigError
from fedmm.models import model_for

WORDS = ["good", "bad", "happy", "sad", "love", "hate", "day", "night", "great", "awful", "the", "a"]


def write_leaf(root: Path, users: dict[str, dict[str, dict]]) -> Path:
    """``users[split][user] = {"x": [...], "y": [...]}`` as LEAF JSON, two files per split."""
    for split, data in users.items():
        folder = root / split
        folder.mkdir(parents=True, exist_ok=True)
        names = sorted(data)
        for part, chunk in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
            content = {"users": chunk, "num_samples": [len(data[u]["y"]) for u in chunk], "user_data": {u: data[u] for u in chunk}}
            (folder / f"all_data_{part}.json").write_text(json.dumps(content))
    return root


def shakespeare_users(n_users: int = 4, per_user: int = 30, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    out: dict = {"train": {}, "test": {}}
    for u in range(n_users):
        # each speaker repeats its own phrase: learnable, and the users differ
        phrase = "".join(rng.choice(list(ALPHABET[14:80]), size=7)) + " "
        text = phrase * 60
        windows = [(text[i : i + 80], text[i + 80]) for i in range(per_user + 8)]
        name = f"PLAY_{u}_ROLE"
        out["train"][name] = {"x": [w for w, _ in windows[:per_user]], "y": [c for _, c in windows[:per_user]]}
        out["test"][name] = {"x": [w for w, _ in windows[per_user:]], "y": [c for _, c in windows[per_user:]]}
    return out


def sent140_users(n_users: int = 4, per_user: int = 30, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    out: dict = {"train": {}, "test": {}}
    for u in range(n_users):
        rows, labels = [], []
        for i in range(per_user + 6):
            label = int(rng.integers(0, 2))
            good = ["good", "happy", "love", "great"] if label else ["bad", "sad", "hate", "awful"]
            text = " ".join(rng.choice(good + ["the", "a", "day", "night"], size=int(rng.integers(3, 30))))
            rows.append([str(1000 * u + i), "Mon Apr 06 2009", "NO_QUERY", f"user{u}", text + "!"])
            labels.append(4 * label if i % 2 else label)  # 0 / 4 as Sentiment140, and 0 / 1 as LEAF
        out["train"][f"user{u}"] = {"x": rows[:per_user], "y": labels[:per_user]}
        out["test"][f"user{u}"] = {"x": rows[per_user:], "y": labels[per_user:]}
    return out


@pytest.fixture(scope="module")
def leaf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("leaf")
    return {"shakespeare": write_leaf(root / "shakespeare", shakespeare_users()),
            "sent140": write_leaf(root / "sent140", sent140_users())}


def text_cfg(task: str, path: Path, *overrides: str) -> dict:
    model = "char_lstm" if task == "shakespeare" else "sent_lstm"
    return to_container(compose([f"dataset={task}", f"dataset.path={path}", f"model={model}", "partition=natural",
                                 "num_clients=3", "clients_per_round=3", *overrides]))


def test_shakespeare_loads_windows_users_and_the_union_of_test_data(leaf: dict[str, Path]) -> None:
    cfg = text_cfg("shakespeare", leaf["shakespeare"])
    train, test = load_dataset(cfg["dataset"])
    assert train.x.shape == (120, 80) and train.x.dtype == torch.int64 and len(test) == 4 * 8
    assert set(np.unique(train.ids)) == set(np.unique(test.ids)) == {f"PLAY_{u}_ROLE" for u in range(4)}
    assert int(train.x.max()) < 80 and int(train.y.max()) < 80
    first = json.loads((leaf["shakespeare"] / "train" / "all_data_0.json").read_text())
    user = first["users"][0]
    row = int(np.flatnonzero(train.ids == user)[0])
    assert "".join(ALPHABET[i] for i in train.x[row]) == first["user_data"][user]["x"][0]
    assert ALPHABET[int(train.y[row])] == first["user_data"][user]["y"][0]
    # natural partition: one speaker per client, 3 of the 4 (seeded), all of its rows
    parts = partition_indices(train, cfg["partition"], 3, 0)
    assert [len(np.unique(train.ids[p])) for p in parts] == [1, 1, 1] and all(len(p) == 30 for p in parts)
    assert len(load_partition(cfg["dataset"], cfg["partition"], 0, 3, 0)) == 30
    spec = input_spec(cfg["dataset"])
    assert (spec.kind, spec.shape, spec.vocab_size) == ("tokens", (80,), 80)


def test_sent140_vocabulary_padding_labels_and_glove(leaf: dict[str, Path], tmp_path: Path) -> None:
    cfg = text_cfg("sent140", leaf["sent140"], "dataset.vocab_size=8")
    train, test = load_dataset(cfg["dataset"])
    assert train.x.shape == (120, 25) and set(train.y.tolist()) == {0, 1}  # 4 -> 1
    vocab = build_vocabulary(["b a a", "c b a!", "d"], vocab_size=3, min_count=1)
    assert vocab == {"a": 2, "b": 3, "!": 4}  # by frequency, ties alphabetical; 0 pad, 1 unknown
    assert encode_words(["a zz b", "a " * 40], vocab, 4).tolist() == [[2, UNK, 3, PAD], [2, 2, 2, 2]]
    assert build_vocabulary(["x x y"], 10, min_count=2) == {"x": 2}
    glove = tmp_path / "glove.txt"
    glove.write_text("good 1 2 3\nzzz 4 5 6\nbad 7 8 9\n")
    table, found = load_glove(glove, {"good": 2, "bad": 3}, 3)
    assert found == 2 and table[2].tolist() == [1, 2, 3] and table[3].tolist() == [7, 8, 9] and not table[:2].any()
    with pytest.raises(ConfigError, match="4 numbers after each word.*line 1 has 3"):
        load_glove(glove, {"good": 2}, 4)


def test_clear_errors_for_a_missing_folder_bad_json_and_an_empty_user(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="dataset.path"):
        compose(["dataset=shakespeare", f"dataset.path={tmp_path / 'missing'}", "model=char_lstm"])
    bad = write_leaf(tmp_path / "bad", shakespeare_users(2, 5))
    (bad / "train" / "all_data_1.json").write_text("{not json")
    with pytest.raises(ConfigError, match="all_data_1.json"):
        load_dataset(text_cfg("shakespeare", bad)["dataset"])
    empty = shakespeare_users(2, 5)
    empty["train"]["PLAY_1_ROLE"] = {"x": [], "y": []}
    root = write_leaf(tmp_path / "empty", empty)
    with pytest.raises(ConfigError, match="PLAY_1_ROLE"):
        load_dataset(text_cfg("shakespeare", root)["dataset"])
    ok = write_leaf(tmp_path / "ok", shakespeare_users(2, 5))
    cfg = text_cfg("shakespeare", ok, "model=cnn", "num_clients=2", "clients_per_round=2")
    with pytest.raises(ConfigError, match="model.name"):
        model_for(cfg, input_spec(cfg["dataset"]))


@pytest.mark.parametrize("task", ["shakespeare", "sent140"])
def test_lstms_expose_layers_latent_and_a_projection_head(leaf: dict[str, Path], task: str) -> None:
    cfg = text_cfg(task, leaf[task])
    spec = input_spec(cfg["dataset"])
    model = model_for(cfg, spec).eval()
    train, _ = load_dataset(cfg["dataset"])
    x = train.x[:5]
    assert model(x).shape == (5, spec.num_classes)
    if task == "shakespeare":  # LEAF's stacked LSTM: 640 + 272,384 + 526,336 + 20,560
        assert sum(p.numel() for p in model.parameters()) == 819_920
    assert torch.allclose(model.classify(model.latent(x)), model(x), atol=1e-6)
    assert model.forward_prefix(x, 2).shape[:2] == (5, spec.shape[0])  # after the LSTM: the whole sequence
    head = model_for(text_cfg(task, leaf[task], "strategy=moon"), spec)
    assert head.latent(x).shape == (5, 256) and head(x).shape == (5, spec.num_classes)


def test_the_client_builds_the_servers_architecture_with_its_options(leaf: dict[str, Path]) -> None:
    # sent_lstm's embedding_dim (e.g. 300 for 300-d GloVe) reaches the ClientApp's model, so the
    # server's arrays load into it
    from client_app.work import _model
    from fedmm.config import client_run, dumps

    cfg = text_cfg("sent140", leaf["sent140"], "model.embedding_dim=12")
    server = model_for(cfg, input_spec(cfg["dataset"])).state_dict()
    client = _model(client_run(dumps(cfg)))  # the settings as the ClientApp reads them from a message
    assert next(iter(client.state_dict().values())).shape[1] == 12  # the embedding table
    client.load_state_dict(server, strict=True)


def discovered_runs() -> dict[str, list[str]]:
    """A run of every option the app finds by discovery, each as it is selected: every method
    (with the objective its clients need), every other client objective under FedAvg, every
    client selector under FedAvg; 2 rounds for those whose round 2 differs in kind (a method
    that sends or needs more than the model, an objective that keeps state or reads its round's
    start), 1 for the others."""
    from fedmm.config import options
    from objectives.base import LocalUpdate
    from strategies.method import Method

    def kind(cls: type, base: type, hooks: tuple[str, ...]) -> bool:
        return any(getattr(cls, hook) is not getattr(base, hook) for hook in hooks)

    runs = {}
    for option, settings in options("strategy").items():
        rounds = 2 if kind(settings.strategy_class, Method, ("extra_records", "needs", "prepare_round")) else 1
        runs[option] = [f"strategy={option}", f"num_rounds={rounds}"]
    for option, settings in options("objective").items():
        if not settings.server and option != "ce":
            rounds = 2 if kind(settings.objective_class, LocalUpdate, ("begin", "end", "metrics")) else 1
            runs[f"objective={option}"] = [f"objective={option}", f"num_rounds={rounds}"]
    for option in options("selection"):
        if option != "uniform":
            runs[f"selection={option}"] = [f"selection={option}", "num_rounds=2"]
    return runs


def test_every_strategy_runs_on_both_text_tasks(tmp_path: Path) -> None:
    """Every option found by discovery (:func:`discovered_runs`) x {Shakespeare, Sent140}, 3
    clients (one per user, 10 samples each), one simulation: each trains, aggregates and evaluates."""
    from fedmm.local_engine import run_local_simulation

    from client_app.client_app import app as client_app
    from tests.sim_apps import recording_server_app

    small = {"shakespeare": write_leaf(tmp_path / "leaf-shakespeare", shakespeare_users(3, 10)),
             "sent140": write_leaf(tmp_path / "leaf-sent140", sent140_users(3, 10))}
    runs = discovered_runs()
    cfgs = []
    for task in ("shakespeare", "sent140"):
        for name, overrides in runs.items():
            extra = ["strategy.granularity=layer"] if name == "fedmr" else []
            cfgs.append(text_cfg(task, small[task], *overrides, "training.local_epochs=1", "strategy.fraction_evaluate=0",
                                 f"output_dir={tmp_path / task / name.replace('=', '-')}", *extra))
    log: list = []
    out: dict = {}
    run_local_simulation(server_app=recording_server_app(cfgs, log, out), client_app=client_app, num_supernodes=3)
    from fedmm.results import read_metrics

    assert len(out["dirs"]) == len(cfgs)
    for cfg, run in zip(cfgs, out["dirs"]):
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == "completed", (cfg["dataset"]["name"], cfg["strategy"]["name"], summary)
        rows = read_metrics(run)
        assert [r["round"] for r in rows] == list(range(cfg["num_rounds"] + 1))
        assert all(r["replies"] >= 1 for r in rows[1:]) and all(np.isfinite(r["loss"]) for r in rows)


def test_fedcross_paper_presets_compose() -> None:
    shakespeare = to_container(compose(["+experiment=fedcross_shakespeare", "strategy=fedcross"]))
    assert (shakespeare["dataset"]["name"], shakespeare["model"]["name"], shakespeare["partition"]["name"]) == \
        ("shakespeare", "char_lstm", "natural")
    assert (shakespeare["num_clients"], shakespeare["clients_per_round"], shakespeare["num_rounds"]) == (128, 12, 1000)
    sent = to_container(compose(["+experiment=fedcross_sent140", "strategy=fedcross"]))
    assert (sent["num_clients"], sent["clients_per_round"], sent["num_rounds"], sent["partition"]["min_samples"]) == (803, 80, 3000, 40)
    assert sent["training"]["local_epochs"] == 5 and sent["model"]["name"] == "sent_lstm"
