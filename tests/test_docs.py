"""The docs a user copies from: every command in README.md, CHANGELOG.md, docs/ and bench/README.md is checked
(a ``fedmm`` command composed and validated exactly as ``fedmm`` would, without training; a search
space loaded and every value checked; a ``flwr run`` config composed as the ServerApp would; a
module, script, file or flag named in a command present), and every link and anchor resolves."""

from __future__ import annotations

import importlib.util
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: The pages whose commands and links are checked (docs/settings.md is generated, its links too).
PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md"]
#: A placeholder a reader fills in (``<run dir>``, ``<head-ip>``): the argument is not checked.
PLACEHOLDER = re.compile(r"<[^<>]+>|\.\.\.")
FENCE = re.compile(r"^\s*```(\w*)\s*$")


@dataclass(frozen=True)
class Command:
    page: Path
    line: int
    text: str

    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}: {self.text}"


def commands(page: Path) -> Iterator[Command]:
    """The commands of ``page``'s bash blocks (continued lines joined, comments dropped)."""
    inside, lang, pending, start = False, "", "", 0
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        fence = FENCE.match(line)
        if fence:
            inside, lang = (not inside), fence.group(1)
            continue
        if not inside or lang not in ("bash", "sh"):
            continue
        if not pending:
            start = number
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text = substituted((pending + stripped).strip())
        pending = ""
        try:
            words = shlex.split(text, comments=True)
        except ValueError:
            words = text.split()
        if words:
            yield Command(page, start, " ".join(shlex.quote(w) for w in words))


#: Command substitutions whose output a command's check needs (a value), run here: module -> its name.
SUBSTITUTIONS = {"analysis.privacy_budget": "-m analysis.privacy_budget"}


def substituted(text: str) -> str:
    """``text`` with each ``$(python -m <module> ...)`` of :data:`SUBSTITUTIONS` replaced by its
    output, as the shell would (run in this process); any other substitution is left as it is."""
    import contextlib
    import io

    def run(match: re.Match) -> str:
        inner = match.group(1).strip()
        module = next((m for m, marker in SUBSTITUTIONS.items() if marker in inner), None)
        if module is None:
            return match.group(0)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = importlib.import_module(module).main(shlex.split(inner.split(SUBSTITUTIONS[module], 1)[1]))
        assert code == 0, f"$({inner}) failed"
        return out.getvalue().strip()

    return re.sub(r"\$\(([^()]*)\)", run, text)


def all_commands() -> list[Command]:
    return [c for page in PAGES for c in commands(page)]


def words_of(command: Command) -> list[str]:
    words = shlex.split(command.text)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # VAR=value before the program
        words = words[1:]
    return words


# ------------------------------------------------------------------------------ the checks
def split_sweep(value: str) -> list[str]:
    """A ``fedmm -m`` sweep value's items (commas outside brackets); one item when none."""
    items, depth, current = [], 0, ""
    for ch in value:
        depth += ch in "[({"
        depth -= ch in "])}"
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    return [*items, current]


def filled(override: str) -> str:
    """An override as checked: a placeholder filled in (``<head-ip>`` -> ``x``), a folder of the
    reader's own (an absolute path not on this machine: their data) set to null."""
    key, _, value = override.partition("=")
    value = PLACEHOLDER.sub("x", value)
    if value.startswith("/") and not Path(value).exists():
        value = "null"
    return f"{key}={value}"


def check_resume(run_dir: str, overrides: list[str]) -> None:
    """A resume names a run folder of the reader's: the changes it makes must be ones a resume
    allows (or, with a real folder, validate)."""
    from fedmm.config import RESUME_CHANGEABLE, resume_config, validate

    if Path(run_dir).is_dir():
        validate(resume_config(run_dir, overrides))
        return
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+")
        assert key.split(".")[0] in RESUME_CHANGEABLE, f"resume cannot change {key} ({', '.join(RESUME_CHANGEABLE)})"


def check_fedmm(args: list[str]) -> None:
    """Compose and validate every configuration the ``fedmm`` arguments name (each value of a
    ``-m`` sweep), as ``fedmm`` would, without training."""
    from fedmm.config import compose

    multirun = "-m" in args or "--multirun" in args
    overrides = [filled(a) for a in args if "=" in a and not a.startswith(("hydra.", "hydra/", "-"))]
    resume = next((o.split("=", 1)[1] for o in overrides if o.startswith("resume=")), None)
    overrides = [o for o in overrides if not o.startswith("resume=")]
    if resume is not None:
        check_resume(resume, overrides)
        return
    swept = {}
    fixed = []
    for o in overrides:
        key, value = o.split("=", 1)
        if re.match(r"^(choice|range|interval|tag|glob)\(", value):
            continue  # a hydra sweeper's search function
        items = split_sweep(value) if multirun else [value]
        if len(items) > 1:
            swept[key] = items
        else:
            fixed.append(o)
    # each value of each swept key, with the first value of every other one (a sweep composes whole
    # jobs: a fixed key may need a swept one, as strategy.<a key of its own> needs strategy=...)
    first = [f"{key}={items[0]}" for key, items in swept.items()]
    compose([*fixed, *first])
    for index, (key, items) in enumerate(swept.items()):
        for item in items[1:]:
            compose([*fixed, *first[:index], f"{key}={item}", *first[index + 1:]])


def check_search(args: list[str]) -> None:
    from launch.search import check_space, load_space

    positional = [a for a in args if not a.startswith("-")]
    params, i = [], 0
    while i < len(args):
        if args[i] == "--param":
            params.append(args[i + 1])
            i += 1
        i += 1
    options_with_values = {"--trials", "--study", "--storage", "--sampler", "--sampler-args", "--pruner", "--pruner-args",
                           "--timeout", "--param"}
    values = {args[i + 1] for i in range(len(args) - 1) if args[i] in options_with_values}
    space = next((Path(REPO, a) for a in positional if a.endswith(".yaml")), None)
    overrides = [a for a in positional if "=" in a and a not in values]
    base, dims = load_space(space, params)
    check_space([*base, *overrides], dims)


def check_flwr_run(args: list[str]) -> None:
    if "-c" not in args and "--run-config" not in args:
        return
    config = args[args.index("-c" if "-c" in args else "--run-config") + 1]
    from flwr.common.config import parse_config_args as parse

    from fedmm.config import compose_from_run_config
    from server_app.server_app import on_flowers_engine

    run_config = {k: filled(f"{k}={v}").split("=", 1)[1] if isinstance(v, str) else v for k, v in parse([config]).items()}
    resume = run_config.pop("resume", "")
    if resume:
        check_resume(str(resume), [f"{k}={v}" for k, v in run_config.items() if k != "overrides"]
                     + str(run_config.get("overrides", "")).split())
        return
    deployment = any(a.startswith("deploy") or a == "fedmm-deploy" for a in args[2:3])
    compose_from_run_config(run_config if deployment else on_flowers_engine(run_config))


def check_python(args: list[str]) -> None:
    if args[:1] == ["-m"]:
        module = args[1]
        if module not in ("pytest", "venv", "pip"):
            assert importlib.util.find_spec(module) is not None, f"no module {module}"
        return
    script = next((a for a in args if a.endswith(".py")), None)
    if script is None or PLACEHOLDER.search(script):
        return
    path = REPO / script
    assert path.is_file(), f"no script {script}"
    source = path.read_text(encoding="utf-8")
    for flag in (a for a in args if a.startswith("--")):
        assert f'"{flag.split("=")[0]}"' in source, f"{script} has no option {flag}"


def check_command(command: Command) -> None:
    words = words_of(command)
    if not words:
        return
    program = Path(words[0]).name
    args = words[1:]
    if program == "fedmm":
        check_fedmm(args)
    elif program == "fedmm-search":
        check_search(args)
    elif program in ("fedmm-report", "fedmm-figures"):
        assert importlib.util.find_spec("analysis.report" if program == "fedmm-report" else "analysis.figures")
    elif program == "flwr" and args[:1] == ["run"]:
        check_flwr_run(args)
    elif program in ("python", "python3"):
        check_python(args)
    for word in words:  # a file of this repository named in the command exists
        generated = word.startswith(("bench/results/", "deploy/certs/"))  # a bench's output, generate_certs.sh's
        if re.fullmatch(r"(conf|deploy|bench|docs|tests|launch|analysis|fedmm|strategies|objectives)/[\w./-]+\.\w+", word) \
                and not PLACEHOLDER.search(word) and not generated and "*" not in word:
            assert (REPO / word).exists(), f"no file {word}"


@pytest.mark.parametrize("command", all_commands(), ids=lambda c: f"{c.page.name}:{c.line}")
def test_every_command_in_the_docs_composes_as_its_program_would(command: Command) -> None:
    try:
        check_command(command)
    except Exception as err:  # noqa: BLE001 - the command and why, in one line
        pytest.fail(f"{command.where()}\n  {type(err).__name__}: {err}")


def test_a_renamed_setting_in_a_doc_command_fails_the_check(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```bash\nfedmm strategy=fedmr strategy.first_stage_round=5   # a typo\n```\n")
    (command,) = list(commands(page))
    from fedmm.errors import ConfigError

    with pytest.raises(ConfigError, match="strategy.first_stage_round"):
        check_command(Command(REPO / "README.md", command.line, command.text))


# ------------------------------------------------------------------------------ links
def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[`*]", "", heading.strip().lower())  # underscores stay, as on GitHub
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    out, seen, inside = set(), {}, False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            inside = not inside
            continue
        match = re.match(r"^(#{1,6})\s+(.*)$", line)
        if match and not inside:
            base = slug(match.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> Iterator[tuple[int, str]]:
    inside = False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        if FENCE.match(line):
            inside = not inside
            continue
        if inside:
            continue
        line = re.sub(r"`[^`]*`", "", line)
        for match in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", line):
            yield number, match.group(1)


def broken_links(pages: list[Path]) -> list[str]:
    bad = []
    for page in pages:
        for number, target in links(page):
            if re.match(r"^[a-z]+:", target):  # http(s), mailto: not checked here (no network)
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(page.parents[1]) if page.parent != REPO else page.name}:{number}: {target}"
            if not resolved.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                bad.append(f"{where} (no heading #{anchor} in {resolved.name})")
    return bad


def test_every_link_and_anchor_in_the_docs_resolves() -> None:
    assert broken_links([*PAGES, REPO / "docs" / "settings.md"]) == []


def test_the_link_check_fails_with_one_anchor_broken(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "a.md"
    (tmp_path / "docs" / "b.md").write_text("# Title\n\n## Choosing C and z\n")
    page.write_text("See [b](b.md#choosing-c-and-z) and [missing](b.md#choosing-c), [gone](c.md).\n")
    bad = broken_links([page])
    assert len(bad) == 2 and "no heading #choosing-c in b.md" in bad[0] and "no such file" in bad[1]
