"""``fedmm-search``: hyperparameter search with Optuna's own study API (Optuna 4 and 5).

    fedmm-search conf/search/fedcross_alpha.yaml --trials 12                  # a search space file
    fedmm-search --param 'training.lr=float(0.001, 0.3, log)' --param 'strategy.alpha=choice(0.9, 0.99)' \\
        --trials 20 strategy=fedcross strategy.fraction_evaluate=1.0 partition.local_test_fraction=0.2
    fedmm-search conf/search/fedcross_alpha.yaml --trials 6                   # the same study: 6 more trials

Each trial is a normal ``fedmm`` run (a run directory with its ``summary.json``, under
``<results_root>/search/<study>/trial_<n>``) of the base config (the space file's ``overrides``,
then the command line's hydra overrides) with the trial's values. The figure maximised is the
run's validation accuracy (:mod:`launch.objective`: the clients' held-out rows, the mean of the last
rounds, never the test split); a run without one is a failed trial and the search goes on.

- **The study** lives in ``--storage`` (default: a SQLite file, ``<results_root>/search/optuna.db``),
  under ``--study`` (default: the space file's name): running the command again adds ``--trials``
  trials to it, and ``optuna-dashboard <storage>`` shows it.
- **Sampler and pruner**: any of Optuna's, by class name (``--sampler TPESampler``, ``RandomSampler``,
  ``CmaEsSampler``, ``GPSampler``, ...; ``--pruner MedianPruner``, ``HyperbandPruner``,
  ``NopPruner``, ...), with keyword arguments as JSON (``--sampler-args '{"n_startup_trials": 5}'``).
  The pruner sees each evaluated round's validation accuracy; a pruned trial's run ends at the end of
  the round it judged, with ``status: pruned`` in its ``summary.json`` (that round completed, as in
  ``metrics.jsonl``) and that one round's figure in its reason.
- **A finite space** (every dimension a choice or whole numbers) runs each value set once: a value
  set with a completed trial in the study (on the same base config) is not run again (the trial
  ends as pruned, ``duplicate_of`` set, and the next one takes a value set not run yet); when
  every value set has completed, the search says so and ends.
- **The space**: ``float(low, high[, log])``, ``int(low, high[, log])``, ``choice(a, b, ...)`` per
  key, in the file's ``params`` or ``--param key=...``. Before the first trial every value the space
  can take is checked as a setting (each bound, each choice), the base config must record a
  validation figure (``strategy.fraction_evaluate`` and ``partition.local_test_fraction`` > 0), and
  no key that decides the held-out rows may be tuned: a bad space is refused with the key and value
  named, before anything trains.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import math
import random
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedmm.errors import ConfigError
from fedmm.observers import RunObserver, StopRun
from launch.objective import VALIDATION_FILE, VALIDATION_METRIC, NoValidation, check_search_space, check_validation


@dataclass(frozen=True)
class Dimension:
    """One tuned setting: ``kind`` float, int or choice; ``low``/``high``/``log`` or ``choices``."""

    key: str
    kind: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    choices: tuple[Any, ...] = ()

    def suggest(self, trial: Any) -> Any:
        if self.kind == "float":
            return trial.suggest_float(self.key, self.low, self.high, log=self.log)
        if self.kind == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), log=self.log)
        return trial.suggest_categorical(self.key, list(self.choices))

    def values(self) -> list[Any]:
        """The values a check composes: the bounds, or every choice."""
        return list(self.choices) if self.kind == "choice" else [self.low, self.high]

    def describe(self) -> str:
        if self.kind == "choice":
            return f"choice({', '.join(map(str, self.choices))})"
        return f"{self.kind}({self.low}, {self.high}{', log' if self.log else ''})"


_SPEC = re.compile(r"^\s*(float|int|choice)\s*\((.*)\)\s*$", re.S)


def parse_dimension(key: str, spec: Any) -> Dimension:
    """``spec``: ``float(low, high[, log])``, ``int(low, high[, log])`` or ``choice(a, ...)`` (a
    string), or the mapping form of a space file (``{float: [low, high], log: true}``,
    ``{choice: [a, b]}``)."""
    if isinstance(spec, Mapping):
        kinds = [k for k in ("float", "int", "choice") if k in spec]
        if len(kinds) != 1 or set(spec) - {kinds[0], "log"}:
            raise ConfigError(f"search.{key}", dict(spec), "one of {float: [low, high]}, {int: [low, high]} (each with "
                              "an optional log: true) or {choice: [a, b, ...]}")
        kind, args, log = kinds[0], list(spec[kinds[0]]), bool(spec.get("log", False))
    else:
        match = _SPEC.match(str(spec))
        if not match:
            raise ConfigError(f"search.{key}", spec, "float(low, high[, log]), int(low, high[, log]) or choice(a, b, ...)")
        kind, inner = match.group(1), match.group(2)
        args = [a.strip() for a in inner.split(",") if a.strip()]
        log = bool(args) and args[-1] == "log" and kind != "choice"
        args = [_literal(a) for a in (args[:-1] if log else args)]
    if kind == "choice":
        if not args:
            raise ConfigError(f"search.{key}", spec, "choice(...) with at least one value")
        return Dimension(key, "choice", choices=tuple(args))
    if len(args) != 2 or not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args) or args[0] >= args[1]:
        raise ConfigError(f"search.{key}", spec, f"{kind}(low, high) with numbers low < high")
    if log and args[0] <= 0:
        raise ConfigError(f"search.{key}", spec, f"{kind}(low, high, log) with low > 0")
    if kind == "int" and not all(float(a).is_integer() for a in args):
        raise ConfigError(f"search.{key}", spec, "int(low, high) with whole numbers")
    return Dimension(key, kind, float(args[0]), float(args[1]), log)


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word: a string choice (an option's name)


def load_space(path: Path | None, params: Sequence[str]) -> tuple[list[str], dict[str, Dimension]]:
    """(base overrides, the dimensions) from a space file and ``--param key=spec`` strings."""
    overrides: list[str] = []
    space: dict[str, Dimension] = {}
    if path is not None:
        import yaml

        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        unknown = set(data) - {"overrides", "params"}
        if unknown:
            raise ConfigError(f"search file {path}", sorted(unknown), "the keys overrides (a list of hydra overrides) "
                              "and params (key: space)")
        overrides = [str(o) for o in data.get("overrides", [])]
        space.update({key: parse_dimension(key, spec) for key, spec in (data.get("params") or {}).items()})
    for item in params:
        key, sep, spec = item.partition("=")
        if not sep:
            raise ConfigError("--param", item, "key=float(low, high[, log]) | key=int(low, high) | key=choice(a, ...)")
        space[key.strip()] = parse_dimension(key.strip(), spec)
    if not space:
        raise ConfigError("search space", "empty", "at least one tuned key (a space file's params or --param)")
    return overrides, space


def trial_overrides(base: Sequence[str], values: Mapping[str, Any]) -> list[str]:
    return [*base, *(f"{key}={json.dumps(value) if isinstance(value, str) and ' ' in value else value}"
                     for key, value in values.items())]


def finite_size(space: Mapping[str, Dimension]) -> int | None:
    """How many value sets ``space`` holds (choices and whole numbers); None when a dimension is
    continuous (``float``)."""
    size = 1
    for dim in space.values():
        if dim.kind == "float":
            return None
        size *= len(dim.choices) if dim.kind == "choice" else int(dim.high) - int(dim.low) + 1
    return size


def completed_values(trials: Sequence[Any], keys: Sequence[str], base: Sequence[str]) -> dict[tuple[Any, ...], Any]:
    """The value sets of ``keys`` that a COMPLETE trial of ``trials`` ran on the base config
    ``base`` (its recorded overrides; a trial that recorded none counts) -> that trial (the first)."""
    import optuna

    done: dict[tuple[Any, ...], Any] = {}
    for t in trials:
        if t.state == optuna.trial.TrialState.COMPLETE and all(k in t.params for k in keys) \
                and list(t.user_attrs.get("base", base)) == list(base):
            done.setdefault(tuple(t.params[k] for k in keys), t)
    return done


def untried_values(space: Mapping[str, Dimension], done: Mapping[tuple[Any, ...], Any], rng: Any) -> dict[str, Any] | None:
    """A value set of the finite ``space`` that no completed trial ran (drawn with ``rng``, else
    the first in order); None when every one has."""
    import itertools

    axes = [list(dim.choices) if dim.kind == "choice" else range(int(dim.low), int(dim.high) + 1) for dim in space.values()]
    for _ in range(1000):
        point = tuple(rng.choice(axis) for axis in axes)
        if point not in done:
            return dict(zip(space, point))
    point = next((p for p in itertools.product(*axes) if p not in done), None)
    return None if point is None else dict(zip(space, point))


def rounds_text(rounds: Sequence[int]) -> str:
    """What a validation figure is: ``round 3 alone``, ``the mean of rounds 1-3``, ``... rounds 2, 4, 6``."""
    rounds = list(rounds)
    if len(rounds) == 1:
        return f"round {rounds[0]} alone"
    consecutive = rounds == list(range(rounds[0], rounds[-1] + 1))
    return f"the mean of rounds {rounds[0]}-{rounds[-1]}" if consecutive else f"the mean of rounds {', '.join(map(str, rounds))}"


def check_space(base: Sequence[str], space: Mapping[str, Dimension]) -> Any:
    """Before the first trial: the base config validates and records a validation figure, no
    held-out key is tuned, and every value the space can take is a valid setting. Returns the
    base settings."""
    from fedmm.config import compose

    check_search_space({key: dim.describe() for key, dim in space.items()})
    settings = compose(list(base))
    check_validation(settings)
    for dim in space.values():
        for value in dim.values():
            try:
                compose(trial_overrides(base, {dim.key: int(value) if dim.kind == "int" else value}))
            except ConfigError as err:
                raise ConfigError(f"search.{dim.key}", dim.describe(), f"values that are valid settings: {value!r} "
                                  f"is not ({err})") from err
    return settings


class Pruning(RunObserver):
    """Reports each evaluated round's validation accuracy to the trial and, when the pruner says
    so, ends the run at that round's end (:class:`fedmm.observers.StopRun`: the run's status is
    ``pruned``; the round is recorded and checkpointed first, so ``summary.json`` counts it as
    ``metrics.jsonl`` does)."""

    def __init__(self, trial: Any, pruner: str) -> None:
        self.trial, self.pruner = trial, pruner
        self.stop: StopRun | None = None

    def on_metrics(self, row: Mapping[str, Any]) -> None:
        value = row.get(VALIDATION_METRIC)
        if value is None or not math.isfinite(float(value)) or int(row.get("round", 0)) < 1:
            return
        self.trial.report(float(value), int(row["round"]))
        if self.trial.should_prune():
            self.stop = StopRun("pruned", f"pruned by {self.pruner} after round {row['round']} (the validation accuracy "
                                          f"of round {row['round']} alone: {float(value):.4f})")

    def on_round_end(self, server_round: int) -> None:
        if self.stop is not None:
            raise self.stop


def optuna_object(module: str, name: str, args: str | None, what: str) -> Any:
    """``optuna.<module>.<name>(**json(args))``, the error naming ``what``."""
    optuna = importlib.import_module("optuna")
    cls = getattr(getattr(optuna, module), name, None)
    if cls is None or not isinstance(cls, type):
        known = sorted(n for n in dir(getattr(optuna, module)) if n.endswith(("Sampler", "Pruner")) and not n.startswith("Base"))
        raise ConfigError(what, name, f"a class of optuna.{module}: {', '.join(known)}")
    try:
        return cls(**(json.loads(args) if args else {}))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{what}-args", args, f"keyword arguments of optuna.{module}.{name} as JSON ({err})") from err


def run_search(argv: Sequence[str] | None = None) -> Any:
    """Parse the command line, check the space, run the trials; returns the study."""
    import optuna

    from fedmm.config import compose, to_container
    from launch.cli import JobFailed, check_names, run_job
    from launch.objective import record_validation

    args = build_parser().parse_intermixed_args(argv)
    if args.space is not None and "=" in str(args.space):  # no space file: the first override was taken for one
        args.overrides, args.space = [str(args.space), *args.overrides], None
    base, space = load_space(args.space, args.param)
    base = [*base, *args.overrides]
    check_names(base)  # an unknown option or key: the nearest, as fedmm names it
    settings = check_space(base, space)
    sampler = optuna_object("samplers", args.sampler, args.sampler_args, "--sampler")
    pruner = optuna_object("pruners", args.pruner, args.pruner_args, "--pruner")
    study_name = args.study or (args.space.stem if args.space is not None else "fedmm")
    root = Path(str(settings.results_root)).expanduser().resolve() / "search"
    root.mkdir(parents=True, exist_ok=True)
    storage = args.storage or f"sqlite:///{root / 'optuna.db'}"
    study = optuna.create_study(study_name=study_name, storage=storage, sampler=sampler, pruner=pruner,
                                direction="maximize", load_if_exists=True)
    print(f"fedmm-search: study {study_name!r} in {storage} (shown live by: optuna-dashboard {storage})", flush=True)
    size, keys = finite_size(space), list(space)
    ran = [0]  # trials whose run started (a value set drawn again is not run, and does not count)

    def objective(trial: Any) -> float:
        values = {key: dim.suggest(trial) for key, dim in space.items()}
        if size is not None:  # a finite space: a value set that completed is not run again
            done = completed_values(study.get_trials(deepcopy=False), keys, base)
            twin = done.get(tuple(values[k] for k in keys))
            if twin is not None:
                untried = untried_values(space, done, random.Random(trial.number))
                if untried is not None:  # the next trial runs a value set not run yet
                    study.enqueue_trial(untried)
                trial.set_user_attr("duplicate_of", twin.number)
                print(f"fedmm-search: trial {trial.number} drew {values}, which trial {twin.number} completed (validation "
                      f"accuracy {twin.value:.4f}): not run again", flush=True)
                raise optuna.TrialPruned(f"a value set trial {twin.number} completed: not run again")
        ran[0] += 1
        trial.set_user_attr("base", list(base))
        out = root / study_name / f"trial_{trial.number:04d}"
        cfg = to_container(compose([*trial_overrides(base, values), f"output_dir={out}"]))
        trial.set_user_attr("run_dir", str(out))
        run = run_job(cfg, observers=[Pruning(trial, args.pruner)])
        summary = json.loads((run / "summary.json").read_text())
        if summary["status"] == "pruned":
            raise optuna.TrialPruned(summary.get("reason", "pruned"))
        value = record_validation(compose(list(base)), run)
        trial.set_user_attr("validation_rounds", json.loads((run / VALIDATION_FILE).read_text())["rounds"])
        return value

    def enough(study: Any, trial: Any) -> None:
        exhausted = size is not None and len(completed_values(study.get_trials(deepcopy=False), keys, base)) >= size
        if ran[0] >= args.trials or exhausted:
            study.stop()

    exhausted = size is not None and len(completed_values(study.get_trials(deepcopy=False), keys, base)) >= size
    if not exhausted:
        # a finite space may draw value sets that completed: each such trial is followed by one
        # enqueued with a value set not run yet, so 2 x --trials trials always run --trials
        study.optimize(objective, n_trials=args.trials if size is None else 2 * args.trials, timeout=args.timeout,
                       catch=(JobFailed, NoValidation), callbacks=[enough])
    if size is not None and len(completed_values(study.get_trials(deepcopy=False), keys, base)) >= size:
        print(f"fedmm-search: each of the {size} value sets of this space has a completed trial in study {study_name!r}: "
              f"none is left to run (a finite space runs each once on the same base config; another --study starts afresh)",
              flush=True)
    return study


def build_parser() -> argparse.ArgumentParser:
    """``fedmm-search``'s command line (its options are public API: docs/api.md)."""
    parser = argparse.ArgumentParser(prog="fedmm-search", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("space", nargs="?", type=Path, default=None, help="a search space file (yaml: overrides, params)")
    parser.add_argument("overrides", nargs="*", help="hydra overrides of the base config (after the space file's)")
    parser.add_argument("--param", action="append", default=[], help="key=float(low, high[, log]) | int(...) | choice(...)")
    parser.add_argument("--trials", type=int, default=10, help="trials to add to the study (default 10)")
    parser.add_argument("--study", default=None, help="the study's name (default: the space file's name, else 'fedmm')")
    parser.add_argument("--storage", default=None, help="Optuna storage URL (default: sqlite:///<results_root>/search/optuna.db)")
    parser.add_argument("--sampler", default="TPESampler")
    parser.add_argument("--sampler-args", default=None, help="JSON keyword arguments of the sampler")
    parser.add_argument("--pruner", default="MedianPruner")
    parser.add_argument("--pruner-args", default=None, help="JSON keyword arguments of the pruner")
    parser.add_argument("--timeout", type=float, default=None, help="seconds after which no new trial starts")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        study = run_search(argv)
    except ConfigError as err:
        print(f"fedmm-search: {err}", file=sys.stderr)
        return 2
    import optuna

    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    skipped = sum(1 for t in trials if "duplicate_of" in t.user_attrs)
    states = {s.name.lower(): sum(t.state == s and "duplicate_of" not in t.user_attrs for t in trials)
              for s in optuna.trial.TrialState}
    counts = [f"{n} {k}" for k, n in states.items() if n] + ([f"{skipped} not run (value sets already completed)"] if skipped else [])
    print(f"fedmm-search: study {study.study_name!r}: " + ", ".join(counts))
    if complete:
        best = study.best_trial
        rounds = best.user_attrs.get("validation_rounds")
        what = f" ({rounds_text(rounds)})" if rounds else ""
        print(f"best: trial {best.number}, validation accuracy {best.value:.4f}{what}, {best.params} "
              f"({best.user_attrs.get('run_dir')})")
    return 0 if complete else 1


if __name__ == "__main__":
    raise SystemExit(main())
