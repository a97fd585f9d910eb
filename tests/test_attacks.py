"""bench/faults.py's attacks: which nodes are hostile and what their data becomes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import faults  # noqa: E402

from fedmm.config import as_run, compose  # noqa: E402
from fedmm.data.tensors import TensorData  # noqa: E402


def test_an_experiment_name_says_the_attack_the_hostile_nodes_and_the_defence() -> None:
    assert faults.experiment("scale-2+defence") == ("scale", 2, True)
    assert faults.experiment("backdoor-1") == ("backdoor", 1, False)
    assert faults.experiment("scale") == ("scale", 1, False)  # tests/test_engines.py's hostile node


def test_label_flipping_and_the_backdoor_poison_only_the_hostile_nodes_training_rows() -> None:
    x = torch.zeros((6, 1, 8, 8), dtype=torch.uint8)
    clean = TensorData(x=x, y=torch.tensor([0, 1, 2, 3, 4, 9]))

    def data(fault: str, partition: int) -> TensorData:
        run = as_run(compose(["dataset=mnist", f"output_dir=/tmp/runs/{fault}"]))
        return faults.hostile_data(run, SimpleNamespace(node_config={"partition-id": partition}), clean)

    assert data("labelflip-2", 1).y.tolist() == [9, 8, 7, 6, 5, 0]  # C − 1 − y, C = 10
    assert data("labelflip-2", 2) is clean
    poisoned = data("backdoor-1", 0)
    assert poisoned.y.tolist() == [0, 1, 0, 3, 0, 9]  # every other row relabelled to the target
    assert (poisoned.x[0, :, -4:, -4:] == 255).all() and (poisoned.x[1] == 0).all() and (poisoned.x[0, :, :4, :4] == 0).all()
    assert data("scale-1", 0) is clean  # a model attack leaves the data alone


def test_the_table_puts_defence_off_beside_on_with_the_backdoors_success() -> None:
    rows = [{"strategy": "fedavg", "fault": f, "status": "completed", "final_accuracy": a, "backdoor_success": b}
            for f, a, b in [("clean", 0.9, 0.1), ("clean+defence", 0.89, 0.1), ("backdoor-1", 0.88, 0.7),
                            ("backdoor-1+defence", 0.87, 0.2)]]
    table = faults.attack_table(rows, ("backdoor",), [1]).splitlines()
    assert table[2] == "| fedavg | off | 0.900 | 0.880 [0.70] |" and table[3] == "| fedavg | on | 0.890 | 0.870 [0.20] |"


def test_the_default_defence_rejects_and_refills_for_the_methods_whose_models_persist() -> None:
    for strategy in ("fedmr", "fedcross", "fedcross_async", "indep"):
        assert faults.default_defence(strategy) == ("strategy.defence.sign_screen=0.5", "strategy.defence.adaptive_clip=2.0",
                                                    "strategy.defence.adaptive_clip_to=median", *faults.PER_MODEL)
    for strategy in ("fedavg", "fedexp", "scaffold", "fedmut"):
        assert faults.default_defence(strategy) == faults.DEFENCE
    # every method it names accepts the settings it adds
    for option in faults.PER_MODEL_METHODS:  # (the asynchronous presets are their method on another driver)
        assert compose([f"strategy={option}", *faults.default_defence(option)]).strategy.option == option.split("_")[0]


def test_the_seeds_table_pairs_each_attack_with_the_clean_run_of_its_own_seed(tmp_path: Path) -> None:
    default, other = list(faults.DEFENCE), ["strategy.defence.screen=0.0"]

    def write(name: str, seed: int, defence: list[str], accuracies: dict[str, float], rounds: int = 8) -> str:
        rows = [{"strategy": "fedavg", "fault": f, "final_accuracy": a} for f, a in accuracies.items()]
        path = tmp_path / name
        path.write_text(json.dumps({"defence": defence, "rounds": rounds, "set": ["training.local_epochs=1", f"seed={seed}"],
                                    "rows": rows}))
        return str(path)

    # seed 0: clean 0.80 (off), attacked 0.79; seed 1: clean 0.60 (only defended: 0.61), attacked 0.55
    files = [write("a.json", 0, default, {"clean": 0.80, "clean+defence": 0.81, "scale-1+defence": 0.79}),
             write("b.json", 1, default, {"clean+defence": 0.61, "scale-1+defence": 0.55}),
             write("c.json", 1, other, {"scale-1+defence": 0.10})]  # not the default defence: left out
    text, gaps = faults.seeds_table(files)
    assert [round(g, 6) for g in gaps["fedavg"]["scale-1"]] == [-1.0, -6.0]  # 0.79 − 0.80, 0.55 − 0.61
    assert "| fedavg | -3.5 (-6.0 to -1.0) n=2 |" in text.splitlines()
    # against the run without the hostile node's update (its defended free rider), seed by seed
    files.append(write("e.json", 0, default, {"freerider-1+defence": 0.78, "labelflip-1+defence": 0.74}))
    files.append(write("f.json", 1, default, {"freerider-1+defence": 0.50, "labelflip-1+defence": 0.53,
                                              "absent-1+defence": 0.51}))  # a reference run, never an attack column
    text, gaps = faults.seeds_table(files, "absent")
    assert {k: [round(g, 6) for g in v] for k, v in gaps["fedavg"].items()} == {"scale-1": [1.0, 5.0], "labelflip-1": [-4.0, 3.0]}
    assert text.splitlines()[0] == "| strategy | scale-1 | labelflip-1 |"  # the reference itself is no column
    with pytest.raises(SystemExit, match="rounds"):
        faults.seeds_table([*files, write("d.json", 2, default, {"clean": 0.7}, rounds=20)])


def test_the_screen_table_says_where_hostile_updates_scored_worse_than_every_honest_one() -> None:
    def scores(cosines: list[float]) -> list[dict]:
        return [{"partition": p, "rejected": False, "cosine": c, "norm_ratio": 1.0 + p} for p, c in enumerate(cosines)]

    # partition 0 hostile: below every honest cosine in round 1 (0.1 < 0.2), not in round 2 (0.25 > 0.2)
    rows = [{"strategy": "fedavg", "fault": "labelflip-1+defence", "screen_stats": [scores([0.1, 0.3, 0.2]), scores([0.25, 0.3, 0.2])]}]
    table = faults.screen_table(rows).splitlines()
    assert table[2] == "| fedavg | labelflip-1+defence | cosine | 0.200, 0.250 | 0.100 to 0.250 | 1 of 2 |"
    assert table[3] == "| fedavg | labelflip-1+defence | norm_ratio | 3.000, 2.500 | 1.000 to 1.000 | 0 of 2 |"  # high is suspect
    clean = faults.screen_table([{**rows[0], "fault": "clean+defence"}]).splitlines()
    assert clean[2] == "| fedavg | clean+defence | cosine | 0.100, 0.225 | – | – |"  # every node honest
    rows[0]["screen_stats"] = [[{**u, "held_out_loss_change": u["norm_ratio"], "class_agreement": u["cosine"] if u["partition"] != 1
                                 else float("nan")} for u in r] for r in rows[0]["screen_stats"]]
    table = faults.screen_table(rows).splitlines()
    assert table[5] == "| fedavg | labelflip-1+defence | held_out_loss_change | 3.000, 2.500 | 1.000 to 1.000 | 0 of 2 |"  # high is suspect
    # partition 1's class agreement not scored (NaN): left out, so the honest worst and median are partition 2's 0.2
    assert table[4] == "| fedavg | labelflip-1+defence | class_agreement | 0.200, 0.200 | 0.100 to 0.250 | 1 of 2 |"


def test_the_screen_recorder_names_each_updates_partition() -> None:
    from fedmm.protocol import ClientUpdate
    from strategies.defence import Defence, DefenceSettings

    sent = {"w": np.zeros(3, np.float32)}
    steps = [[1.0, 1.0, 0.5], [1.0, 0.8, 0.6], [-9.0, -9.0, -9.0], [0.9, 1.1, 0.4]]
    updates = [ClientUpdate(100 + i, i, {"w": np.array(w, np.float32)}, 10.0, {}, sent=sent) for i, w in enumerate(steps)]
    stage = Defence(DefenceSettings(screen=0.0, norm_screen=3.0))
    fedavg, fedmr = {"output_dir": "/runs/fedavg/flip-1+defence"}, {"output_dir": "/runs/fedmr/flip-1+defence"}
    recorder = faults.ScreenRecorder()  # an observer of the run: the round's end hands it the stage's verdict
    recorder.partitions.update({100: 3, 101: 1, 102: 0, 103: 2})
    recorder.begin(fedavg)
    recorder.on_stage(1, updates, stage.screen_and_bound(updates, [sent] * 4))
    recorder.begin(fedmr)  # the same experiment of another strategy: its rounds apart
    recorder.on_stage(1, updates[:3], stage.screen_and_bound(updates[:3], [sent] * 3))
    assert [len(r) for r in recorder.of(fedavg)] == [4] and [len(r) for r in recorder.of(fedmr)] == [3]
    (round_,) = recorder.of(fedavg)
    assert [u["partition"] for u in round_] == [3, 1, 0, 2] and [u["rejected"] for u in round_] == [False, False, True, False]
    assert round_[2]["cosine"] < 0 < round_[0]["cosine"] and round_[2]["norm_ratio"] > 3
    assert "output_cosine" not in round_[0]  # a vector, no output layer (its own test below)


def test_the_held_out_loss_is_built_once_per_dataset_and_model(monkeypatch: pytest.MonkeyPatch) -> None:
    built = []
    monkeypatch.setattr(faults, "held_out_loss", lambda cfg: built.append(cfg["model"]["name"]) or (lambda m: 0.0))
    recorder = faults.ScreenRecorder(held_out=True)
    for model, run in (("cnn", "a"), ("cnn", "b"), ("lenet", "c"), ("cnn", "d")):
        recorder.begin({"output_dir": f"/runs/{run}", "dataset": {"name": "mnist5k"}, "model": {"name": model}})
    assert built == ["cnn", "lenet"]
    assert faults.ScreenRecorder().loss is None  # without --held-out nothing is built


def test_the_output_cosine_is_each_class_rows_agreement_weighted_by_the_rows_norm() -> None:
    from fedmm.protocol import ClientUpdate

    sent = {"conv": np.zeros((2, 1, 2, 2), np.float32), "out.weight": np.zeros((2, 2), np.float32),
            "out.bias": np.zeros(2, np.float32), "steps": np.zeros((2, 2), np.int64)}
    rows = [[[1, 0], [0, 1]], [[1, 0], [0, 1]], [[0, 2], [1, 1]]]  # the third: row 0 along feature 1, row 1 half-way
    updates = [ClientUpdate(i, i, {**sent, "out.weight": np.array(r, np.float32)}, 10.0, {}) for i, r in enumerate(rows)]
    # the median rows are [1, 0] and [0, 1]: the third's row cosines 0 (norm 2) and 1/sqrt(2) (norm sqrt(2))
    expected = [1.0, 1.0, (np.sqrt(2) / np.sqrt(2)) / (2 + np.sqrt(2))]
    assert faults.output_cosines(updates, [sent] * 3) == pytest.approx(expected)  # not the whole layer's 0.2887


def test_the_sent_alignment_scores_each_raised_class_against_the_sent_models_own_row() -> None:
    from fedmm.protocol import ClientUpdate

    sent = {"out.weight": np.eye(2, dtype=np.float32), "out.bias": np.zeros(2, np.float32)}
    # the sent rows less their mean: [0.5, -0.5] (class 0) and [-0.5, 0.5] (class 1)
    moves = [([[1, 0], [0, 0]], [1, 0]),    # raises class 0 along its own row: cos 1/sqrt(2)
             ([[0, 1], [0, 0]], [1, 0]),    # raises class 0 along class 1's row (a flip): -1/sqrt(2)
             ([[1, 0], [1, 0]], [1, 3]),    # raises both, class 1 three times as much: (1 - 3)/4 / sqrt(2)
             ([[1, 0], [0, 1]], [-1, -1])]  # raises no class: not scored
    updates = [ClientUpdate(i, i, {"out.weight": np.eye(2, dtype=np.float32) + np.array(r, np.float32),
                                   "out.bias": np.array(b, np.float32)}, 10.0, {}) for i, (r, b) in enumerate(moves)]
    scores = faults.sent_alignment(updates, [sent] * 4)
    assert scores[:3] == pytest.approx([1 / np.sqrt(2), -1 / np.sqrt(2), -0.5 / np.sqrt(2)])
    assert np.isnan(scores[3])
    conv = {"conv": np.zeros((2, 1, 2, 2), np.float32)}
    assert faults.sent_alignment([ClientUpdate(0, 0, conv, 10.0, {})], [conv]) is None  # no output layer


def test_the_held_out_loss_is_taken_on_a_balanced_set_of_test_rows() -> None:
    """With every weight 0 the logits are the output bias b whatever the image, so the loss is
    logsumexp(b) − the mean of b over the rows' labels: with b = t on class 0 alone,
    log(9 + e^t) − t × (class 0's share of the rows), 0.1 on a balanced set."""
    import torch

    from fedmm.data import input_spec
    from fedmm.models import build_model, model_options

    cfg = compose([])
    run = as_run(cfg)
    net = build_model(run.model.name, input_spec(run.dataset), run.model.projection_dim, model_options(run.model))
    model = {k: np.zeros_like(v.numpy()) for k, v in net.state_dict().items()}
    bias = [k for k, v in model.items() if v.ndim == 1][-1]
    model[bias] = np.array([3.0] + [0.0] * 9, np.float32)
    loss = faults.held_out_loss(cfg)
    assert loss(model) == pytest.approx(np.log(9 + np.exp(3.0)) - 3.0 * 0.1, abs=1e-5)
    model[bias] = np.zeros(10, np.float32)
    assert loss(model) == pytest.approx(float(torch.log(torch.tensor(10.0))), abs=1e-6)


def test_absent_nodes_never_answer_and_the_others_train(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--attacks absent``: the hostile partitions' ClientApps raise in every round (the engine
    makes that an error reply, so the server aggregates the others); every other node trains."""
    from flwr.app import Context, RecordDict

    from client_app import client_app as real
    from fedmm import protocol

    trained = []
    monkeypatch.setattr(real, "train", lambda msg, context: trained.append(context.node_config["partition-id"]) or "reply")
    app = faults.faulty_client_app()

    def call(fault: str, partition: int):  # noqa: ANN202
        msg = protocol.server_message(protocol.TRAIN, 1, {protocol.RUN_CONFIG: json.dumps({"output_dir": f"/tmp/runs/{fault}"})})
        context = Context(run_id=1, node_id=1, node_config={"partition-id": partition}, state=RecordDict(), run_config={})
        return app(msg, context)

    for partition in (0, 1):
        with pytest.raises(RuntimeError, match=f"partition {partition} is absent"):
            call("absent-2+defence", partition)
    assert call("absent-2", 2) == "reply" and call("absent-1", 1) == "reply" and call("clean", 0) == "reply"
    assert trained == [2, 1, 0]
    assert faults.ABSENT not in faults.ATTACKS  # run only when named


def test_colluding_nodes_send_the_attack_on_the_honest_updates_of_their_own_round() -> None:
    """CollusionGrid holds a round's train replies until all are in, then each marked (hostile)
    reply becomes its sent model plus ALIE of that round's honest updates; the next round's
    hostile update is computed from the next round's (a vector from the wrong round fails here)."""
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

    from fedmm import protocol
    from tests.fakes import FakeGrid

    def node(msg: Message, key: str) -> RecordDict:
        w = protocol.record_to_model(msg.content[protocol.ARRAYS], copy=True)["w"]
        r, i = int(msg.content[protocol.CONFIG][protocol.SERVER_ROUND]), int(key[-1])
        metrics = MetricRecord({protocol.NUM_EXAMPLES: 10.0})
        if i == 0:
            metrics[faults.COLLUDING_MARK] = 1.0
        step = np.array([i, -i, r * i, 1.0], np.float32) * r
        return RecordDict({protocol.ARRAYS: protocol.model_to_record({"w": w + step, "n": np.array(r)}),
                           protocol.METRICS: metrics})

    class Once(FakeGrid):
        """A reply is pulled once, as from Flower's grids (asked again, they answer with an error)."""

        given: set = set()

        def pull_messages(self, message_ids):  # noqa: ANN001, ANN202
            again = self.given & set(message_ids)
            assert not again, f"asked again for {again}"
            out = super().pull_messages(message_ids)
            self.given |= {m.metadata.reply_to_message_id for m in out}
            return out

    inner = Once(node, num_nodes=4)
    grid = faults.CollusionGrid(inner, faults.colluding_attack("alie", 1))
    nodes = grid.get_node_ids()
    made = []
    for r, sent in ((1, np.zeros(4, np.float32)), (2, np.full(4, 3.0, np.float32))):
        msgs = [protocol.server_message(protocol.TRAIN, n, {protocol.SERVER_ROUND: r},
                                        protocol.model_to_record({"w": sent, "n": np.array(0)})) for n in nodes]
        ids = grid.push_messages(msgs)
        replies = grid.pull_messages(ids[:2])
        assert replies == []  # held: the round is not in yet
        replies = grid.pull_messages(ids)  # the strategy asks for every reply it has not seen
        assert len(replies) == 4
        honest = np.stack([np.array([i, -i, r * i, 1.0]) * r for i in (1, 2, 3)])
        expected = honest.mean(axis=0) + 1.5 * honest.std(axis=0, ddof=1)
        by_key = {inner.keys[m.metadata.src_node_id]: m for m in replies}
        hostile = protocol.record_to_model(by_key["partition:000000000"].content[protocol.ARRAYS])
        np.testing.assert_allclose(hostile["w"], sent + expected, rtol=1e-6)
        assert hostile["n"] == 0  # integer entries stay as sent
        assert all(faults.COLLUDING_MARK not in m.content[protocol.METRICS] for m in replies)
        made.append(expected)
    assert not np.allclose(made[0], made[1])


def test_the_optimized_attacks_search_against_the_runs_aggregator() -> None:
    import byzfl

    attack = faults.colluding_attack("optalie", 2, {"aggregator": "trmean", "pre_aggregators": ["nnm"], "f": 1})
    assert isinstance(attack.agg, byzfl.TrMean) and attack.agg.f == 2 and isinstance(attack.pre_agg_list[0], byzfl.NNM)
    plain = faults.colluding_attack("optipm", 1, {"aggregator": "mean"})
    assert isinstance(plain.agg, byzfl.Average) and plain.pre_agg_list == []


#: The per-model preset (conf/strategy/defence/per_model.yaml) as a run's strategy.defence.
PER_MODEL_PRESET = {"sign_screen": 0.5, "adaptive_clip": 2.0, "adaptive_clip_to": "median", "norm_screen": 3.0,
                    "refill": "median"}


def honest_round(n: int = 8, d: int = 200) -> np.ndarray:
    """Honest updates that agree in direction (+1 on every coordinate) with noise of varied scale."""
    rng = np.random.default_rng(0)
    return 1.0 + rng.normal(0.0, 1.0, (n, d)) * rng.uniform(0.5, 2.0, d)


def test_the_tuned_attacks_search_against_the_screens() -> None:
    """Against the per-model preset, ALIE searched against the plain mean (``optalie``: what the
    stage keeps of the mean) picks a factor whose update the norm screen rejects, and its slots
    take the round's median; the tuned one searches through the round's own defence
    (:class:`faults.DefendedAggregate`), stays under the norm screen and moves the round's step
    several times as far from the honest mean."""
    from fedmm.protocol import ClientUpdate
    from strategies.defence import Defence, DefenceSettings

    honest = honest_round()
    judge = faults.DefendedAggregate(PER_MODEL_PRESET, 2, per_node=True)

    def harm(vector: np.ndarray) -> float:
        return float(np.linalg.norm(judge(np.concatenate([honest, [vector, vector]])) - honest.mean(axis=0)))

    tuned = faults.colluding_attack("tunedalie", 2, PER_MODEL_PRESET, per_node=True)
    untuned = faults.colluding_attack("optalie", 2, PER_MODEL_PRESET, per_node=True)
    t, u = tuned(honest.copy()), untuned(honest.copy())
    assert harm(t) > 3 * harm(u), (harm(t), harm(u))
    # the tuned update passes the screens; the untuned one does not
    zero = {"w": np.zeros(honest.shape[1])}
    verdict = Defence(DefenceSettings.from_dict({**DefenceSettings().to_dict(), **PER_MODEL_PRESET})).screen_and_bound(
        [ClientUpdate(i, i, {"w": v}, 1.0, {}) for i, v in enumerate([*honest, t, t, u])], [zero] * 11)
    assert sorted(u.node_id for u, _ in verdict.rejected) == [10]


def test_the_tuned_mimic_copies_the_update_that_moves_the_defended_step_farthest() -> None:
    """An honest node far out (node 3, five times the others' norm) is the copy that moves a
    plain mean farthest; the norm screen rejects its copies, so the tuned Mimic copies another."""
    honest = honest_round()
    honest[3] *= 5
    judge = faults.DefendedAggregate(PER_MODEL_PRESET, 1, per_node=True)
    harms = [np.linalg.norm(judge(np.concatenate([honest, h[None]])) - honest.mean(axis=0)) for h in honest]
    copied = faults.colluding_attack("tunedmimic", 1, PER_MODEL_PRESET, per_node=True)(honest.copy())
    np.testing.assert_array_equal(copied, honest[int(np.argmax(harms))])
    assert int(np.argmax(harms)) not in (0, 3)  # byzfl's Mimic copies the first; the plain mean's choice is node 3


def test_the_tuned_search_judges_a_share_of_a_large_entry_and_answers_on_every_coordinate() -> None:
    """An entry above SEARCH_WHOLE values is judged on a share of them, the output layer whole; the
    hostile update is ALIE at the chosen factor on every coordinate of the honest updates."""
    import byzfl

    layout = [("body.weight", (300, 100)), ("head.weight", (10, 30)), ("head.bias", (10,))]
    honest = honest_round(d=30_310)
    attack = faults.colluding_attack("tunedalie", 2, PER_MODEL_PRESET, per_node=True)
    attack.agg.see(layout)
    assert attack.agg.layout == [("body.weight", (faults.SEARCH_WHOLE,)), ("head.weight", (10, 30)), ("head.bias", (10,))]
    assert len(attack.agg.index) == faults.SEARCH_WHOLE + 310 and attack.agg.index[-310:].tolist() == list(range(30_000, 30_310))
    vector = attack(honest.copy())
    np.testing.assert_allclose(vector, byzfl.ALittleIsEnough(tau=attack.tau)(honest.copy()))
