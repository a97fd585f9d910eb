"""The public API (docs/api.md, written by analysis/public_api.py from the code): a name or
argument that leaves without a deprecation fails here, naming it; a renamed one with its
deprecation does not; the committed page is the code's."""

from __future__ import annotations

from analysis import public_api


def test_the_committed_page_is_what_the_code_offers() -> None:
    committed = public_api.PAGE.read_text(encoding="utf-8")
    assert committed == public_api.render(), f"docs/api.md is stale: run {public_api.COMMAND}"
    parts = public_api.read(committed)
    assert "FedMR(clients_per_round, seed, fraction_evaluate, selector, secure, **)" in parts["strategies"]
    assert "build_app(mods)" in parts["client_app.client_app"] and "strategy.fedmr.first_stage_rounds" in parts["settings"]
    assert {"fedmm", "fedmm-search"} <= set(parts["commands"]) and "--storage" in parts["fedmm-search"]
    assert {"metrics.jsonl", "summary.json", "config.yaml", "checkpoint.pt"} <= set(parts["run directory"])


def replaced(surface: dict[str, list[str]], part: str, old: str, new: str | None) -> dict[str, list[str]]:
    names = [n for n in surface[part] if n != old] + ([new] if new else [])
    return {**surface, part: names}


def test_a_public_argument_or_name_removed_without_a_deprecation_fails() -> None:
    """Planted: FedMR without its ``secure`` argument, FedCross gone, a setting gone, a command
    gone; each is named. With their deprecations in place (a renamed argument, a retired setting)
    nothing is."""
    now = public_api.surface()
    committed = public_api.read(public_api.PAGE.read_text(encoding="utf-8"))
    assert public_api.removed(committed, now) == []
    fedmr = next(n for n in now["strategies"] if n.startswith("FedMR("))
    planted = replaced(now, "strategies", fedmr, fedmr.replace(" secure,", ""))
    planted = replaced(planted, "strategies", next(n for n in now["strategies"] if n.startswith("FedCross(")), None)
    planted = replaced(planted, "settings", "strategy.fedmr.granularity", None)
    planted = replaced(planted, "commands", "fedmm-search", None)
    assert public_api.removed(committed, planted) == [
        "strategies: FedCross(clients_per_round, seed, fraction_evaluate, selector, **)", "strategies: FedMR(secure)",
        "settings: strategy.fedmr.granularity", "commands: fedmm-search"]


def test_a_name_with_its_deprecation_may_leave() -> None:
    """``num_models`` (renamed to ``clients_per_round``), ``FedMRAsync`` (a deprecated class),
    ``strategy.fedbuff.buffer_size`` (retired into ``strategy.asynchronous``) and
    ``strategy.fedmr_async.*`` (an option renamed) are not reported as gone."""
    now = public_api.surface()
    fedmr = next(n for n in now["strategies"] if n.startswith("FedMR("))
    before = {**now, "strategies": [*now["strategies"], "FedMRAsync(clients_per_round, seed)",
                                    fedmr.replace("(clients_per_round,", "(num_models, clients_per_round,")],
              "settings": [*now["settings"], "strategy.fedbuff.buffer_size", "strategy.fedmr_async.first_stage_rounds"]}
    assert public_api.removed(before, now) == []
