"""Docs that cannot drift: cheap checks over every Markdown file and every source file.

- every relative link in every `*.md` of the repository resolves to a file or folder;
- every link into this repository on GitHub (`https://github.com/colibri-moe/colibri/blob/main/PATH`,
  the form package READMEs use so that they work on PyPI) names a PATH that exists here;
- every test file a `*.md` names (`test_*.py`) exists somewhere in the repository;
- every spec beside a package's code (a `*.md` under `packages/NAME/src/`, but the READMEs of data
  folders) is linked from that package's README, as COMPATIBILITY.md promises;
- no README, spec or source file under `packages/` or `src/` (nor the root README.md and
  COMPATIBILITY.md) carries a tracker reference (`issue 19`, `P3`): the history of a change
  belongs in bench/RESULTS.md and the commit log, which bench/ alone may cite.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "build", "dist", "node_modules", "__pycache__", ".pytest_cache", ".ruff_cache",
             ".mypy_cache", ".hypothesis", "shared"}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
REPO_URL = re.compile(r"https://github\.com/colibri-moe/colibri/(?:blob|tree)/main/([^)\s#`'\"]*)")
TEST_FILE = re.compile(r"\btest_[a-z0-9_]+\.py\b")
TRACKER = re.compile(r"\b[Ii]ssues? #?\d+|\bP\d\b")


def repo_files(suffix: str, under: Path = ROOT) -> list[Path]:
    out = []
    for directory, dirs, files in os.walk(under):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        out += [Path(directory) / f for f in sorted(files) if f.endswith(suffix)]
    return out


MARKDOWN = repo_files(".md")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_scan_sees_the_docs():
    names = {_rel(p) for p in MARKDOWN}
    assert {"README.md", "COMPATIBILITY.md", "bench/RESULTS.md", "packages/colibri-stream/README.md"} <= names


def broken_links(markdown: list[Path]) -> list[str]:
    """Relative links that name no file, and links into this repository on GitHub that name no path here."""
    bad = []
    for md in markdown:
        text = md.read_text()
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = target.split("#", 1)[0]
            if path and not (md.parent / path).exists():
                bad.append(f"{md.name}: {target}")
        bad += [f"{md.name}: {path}" for path in REPO_URL.findall(text) if not (ROOT / path.rstrip("/")).exists()]
    return bad


def test_links_resolve():
    assert broken_links(MARKDOWN) == []


def test_link_checker_sees_a_stale_link_of_either_kind(tmp_path):
    (tmp_path / "there.md").write_text("")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "[ok](there.md#part) [gone](missing.md) [web](https://example.com/x.md) [anchor](#top)\n"
        "[spec](https://github.com/colibri-moe/colibri/blob/main/packages/colibri-stream/src/colibri_stream/"
        "ROUTING_TRACE.md) [fine](https://github.com/colibri-moe/colibri/blob/main/COMPATIBILITY.md)\n"
    )
    assert broken_links([doc]) == [
        "doc.md: missing.md", "doc.md: packages/colibri-stream/src/colibri_stream/ROUTING_TRACE.md"]


def test_test_files_named_in_docs_exist():
    existing = {p.name for p in repo_files(".py")}
    bad = sorted({f"{_rel(md)}: {name}" for md in MARKDOWN for name in TEST_FILE.findall(md.read_text())
                  if name not in existing})
    assert bad == []


def test_every_spec_beside_a_package_is_linked_from_its_readme():
    bad = []
    for package in sorted((ROOT / "packages").iterdir()):
        readme = package / "README.md"
        if not readme.is_file():
            continue
        text = readme.read_text()
        for spec in repo_files(".md", package / "src"):
            if spec.name != "README.md" and f"/{_rel(spec)})" not in text:
                bad.append(f"{_rel(readme)} does not link {_rel(spec)}")
    assert bad == []


def tracker_references(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if TRACKER.search(line):
                found.append(f"{_rel(path)}:{number}: {line.strip()[:100]}")
    return found


def test_no_tracker_references_outside_bench():
    paths = [ROOT / "README.md", ROOT / "COMPATIBILITY.md"]
    for top in (ROOT / "packages", ROOT / "src"):
        paths += repo_files(".md", top) + repo_files(".py", top)
    assert tracker_references(paths) == []


def test_tracker_pattern_catches_references_and_spares_look_alikes():
    lines = ["see issue 19", "Issue 18: a bug", "P3 of the plan", "(issue #7)", "FSDP2, FP8, P50 latency",
             "an issue with 2 workers", "Q4_0 x Q8_0"]
    assert [line for line in lines if TRACKER.search(line)] == lines[:4]
