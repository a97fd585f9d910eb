"""CHANGELOG.md is well formed and pyproject.toml's version has its entry, by the rules the file
states: Keep a Changelog's sections, releases newest first with their dates, and Semantic
Versioning (while 0.x a breaking change moves the minor version, from 1.0 the major)."""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the backport Flower installs
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
SECTIONS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")
RELEASE = re.compile(r"^## \[(\d+)\.(\d+)\.(\d+)\] - (\d{4}-\d{2}-\d{2})$")
#: A development or pre-release of X.Y.Z (PEP 440): what pyproject.toml holds between releases.
UPCOMING = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\.dev\d+|(?:a|b|rc)\d+(?:\.dev\d+)?)$")
NEXT = re.compile(r"^Next release: (\d+)\.(\d+)\.(\d+)\b")


@dataclass
class Release:
    name: str  # "Unreleased" or "X.Y.Z"
    version: tuple[int, int, int] | None = None
    date: dt.date | None = None
    next_version: tuple[int, int, int] | None = None
    sections: dict[str, list[str]] = field(default_factory=dict)

    @property
    def breaking(self) -> bool:
        return any("**Breaking" in entry for entries in self.sections.values() for entry in entries)


def parse(text: str) -> list[Release]:
    """The releases of a changelog, newest first; ValueError naming the line of any departure."""
    lines = text.splitlines()
    if not lines or lines[0] != "# Changelog":
        raise ValueError("line 1: the title must be '# Changelog'")
    releases: list[Release] = []
    section: list[str] | None = None
    for number, line in enumerate(lines, start=1):
        if line.startswith("## "):
            section = None
            if line == "## [Unreleased]":
                if releases:
                    raise ValueError(f"line {number}: [Unreleased] must come first, and once")
                releases.append(Release("Unreleased"))
                continue
            match = RELEASE.match(line)
            if not match:
                raise ValueError(f"line {number}: a release heading is '## [X.Y.Z] - YYYY-MM-DD': {line!r}")
            try:
                date = dt.date.fromisoformat(match.group(4))
            except ValueError:
                raise ValueError(f"line {number}: no such date {match.group(4)}") from None
            version = tuple(int(match.group(i)) for i in (1, 2, 3))
            releases.append(Release(".".join(map(str, version)), version, date))
        elif line.startswith("### "):
            if not releases:
                raise ValueError(f"line {number}: a section outside a release")
            name = line[4:]
            if name not in SECTIONS:
                raise ValueError(f"line {number}: section {name!r}; allowed: {', '.join(SECTIONS)}")
            if name in releases[-1].sections:
                raise ValueError(f"line {number}: a second '{name}' section in [{releases[-1].name}]")
            section = releases[-1].sections[name] = []
        elif line.startswith("#"):
            if number > 1:
                raise ValueError(f"line {number}: only '##' releases and '###' sections: {line!r}")
        elif line.startswith("- "):
            if section is None:
                raise ValueError(f"line {number}: an entry outside a section")
            section.append(line[2:])
        elif line.startswith("  ") and line.strip() and section:
            section[-1] += " " + line.strip()  # an entry's continued line
        elif releases and (match := NEXT.match(line)):
            releases[-1].next_version = tuple(int(match.group(i)) for i in (1, 2, 3))
    check(releases)
    return releases


def check(releases: list[Release]) -> None:
    """Releases newest first (versions and dates falling), no empty section or release, each
    version moved from the one before it as its entries require."""
    dated = [r for r in releases if r.version is not None]
    if not dated:
        raise ValueError("no released version")
    for release in releases:
        if not release.sections and release.version is not None:
            raise ValueError(f"[{release.name}] has no section")
        for name, entries in release.sections.items():
            if not entries:
                raise ValueError(f"[{release.name}] {name}: no entry")
    for newer, older in zip(dated, dated[1:]):
        if not newer.version > older.version or not newer.date >= older.date:
            raise ValueError(f"[{newer.name}] must be newer than [{older.name}] below it (version and date)")
        check_step(older.version, newer)
    if releases[0].name == "Unreleased" and releases[0].sections:
        unreleased = releases[0]
        if unreleased.next_version is None:
            raise ValueError("[Unreleased] must say 'Next release: X.Y.Z'")
        check_step(dated[0].version, unreleased, unreleased.next_version)


def check_step(before: tuple[int, int, int], release: Release, version: tuple[int, int, int] | None = None) -> None:
    """``version`` (the release's own by default) is the one Semantic Versioning gives after
    ``before`` for what the release holds: breaking -> minor while 0.x, major from 1.0."""
    version = version or release.version
    major, minor, _ = before
    if release.breaking:
        allowed = {(0, minor + 1, 0)} if major == 0 else {(major + 1, 0, 0)}
    else:
        allowed = {(major, minor, before[2] + 1), (major, minor + 1, 0), *(((major + 1, 0, 0),) if major else ())}
    if version not in allowed:
        kind = "breaking" if release.breaking else "non-breaking"
        raise ValueError(f"[{release.name}]: {'.'.join(map(str, version))} after {'.'.join(map(str, before))} "
                         f"for {kind} changes; allowed: {', '.join('.'.join(map(str, v)) for v in sorted(allowed))}")


def version_has_entry(version: str, releases: list[Release]) -> None:
    """pyproject's version is a released entry, or the development release of the version that
    [Unreleased] announces."""
    released = {r.name for r in releases if r.version}
    if version in released:
        return
    match = UPCOMING.match(version)
    head = releases[0]
    if match and head.name == "Unreleased" and head.next_version == tuple(int(match.group(i)) for i in (1, 2, 3)):
        return
    announced = ".".join(map(str, head.next_version)) if head.next_version else "none"
    raise ValueError(f"pyproject.toml's version {version} has no entry: released {sorted(released)}, "
                     f"[Unreleased] announces {announced} (a version between releases is <next>.devN)")


def test_the_changelog_is_well_formed_and_the_version_has_its_entry() -> None:
    releases = parse((REPO / "CHANGELOG.md").read_text(encoding="utf-8"))
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    version_has_entry(version, releases)
    assert releases[-1].version == (0, 1, 0)  # the first release


GOOD = """# Changelog

Intro.

## [Unreleased]

Next release: 0.2.0

### Changed

- **Breaking:** `num_models` is `clients_per_round`.

## [0.1.0] - 2026-11-28

### Added

- Everything,
  on two lines.
"""


def test_a_good_changelog_parses() -> None:
    releases = parse(GOOD)
    assert [r.name for r in releases] == ["Unreleased", "0.1.0"]
    assert releases[0].breaking and releases[1].sections["Added"] == ["Everything, on two lines."]
    version_has_entry("0.2.0.dev0", releases)
    version_has_entry("0.1.0", releases)


@pytest.mark.parametrize(("bad", "says"), [
    (GOOD.replace("### Changed", "### Improvements"), "section 'Improvements'"),
    (GOOD.replace("Next release: 0.2.0", "Next release: 0.1.1"), "0.1.1 after 0.1.0 for breaking changes"),
    (GOOD.replace("Next release: 0.2.0\n", ""), "must say 'Next release"),
    (GOOD.replace("- 2026-11-28", "- 2026-11-31"), "no such date"),
    (GOOD.replace("## [0.1.0] - 2026-11-28", "## 0.1.0"), "a release heading is"),
    (GOOD + "\n## [0.2.0] - 2026-11-29\n\n### Added\n\n- x\n", "must be newer than"),
    (GOOD.replace("- Everything,\n  on two lines.\n", ""), "Added: no entry"),
    (GOOD.replace("## [Unreleased]", "## [Unreleased]\n\n### Fixed\n\n- a\n\n### Fixed"), "a second 'Fixed'"),
], ids=["section", "semver", "next", "date", "heading", "order", "empty", "twice"])
def test_a_malformed_changelog_is_refused_naming_why(bad: str, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        parse(bad)


@pytest.mark.parametrize("version", ["0.1.1", "0.3.0.dev0", "0.2.0", "1.0.0.dev0"])
def test_a_version_without_an_entry_is_refused(version: str) -> None:
    with pytest.raises(ValueError, match="has no entry"):
        version_has_entry(version, parse(GOOD))


def test_from_one_a_breaking_change_moves_the_major_version() -> None:
    one = GOOD.replace("Next release: 0.2.0", "Next release: 1.1.0").replace("[0.1.0]", "[1.0.0]")
    with pytest.raises(ValueError, match="allowed: 2.0.0"):
        parse(one)
    parse(one.replace("Next release: 1.1.0", "Next release: 2.0.0"))
