"""Each package alone, as PyPI users will get it: `make check-packages` (CI: per package, per Python).

For every distribution (the six packages and the app):

1. build its sdist, then its wheel FROM that sdist (`python -m build`), and `twine check --strict`;
2. inspect them: LICENSE (the root's text) in both, every file of `src/` in the wheel (spec .md
   files, data, py.typed), every file of `tests/` in the sdist (conftest.py, assets), metadata
   (license expression, URLs, bounded sibling and torch requirements, no README link that only
   works inside the repository);
3. install the wheel into a fresh venv (`python -m venv`) with only its declared dependencies:
   torch==2.13.0 first where its extras need torch, colibri siblings from the just-built wheels
   (passed as files, and pip's install report must show every colibri-* came from them, at the
   built version), `pip check`; colibri-spec, colibri-relay and colibri-int4 must not pull torch;
4. import it (from site-packages, `__version__` == the built version), run each console script's
   `--help` and the main one's `--version`, load its entry points;
5. run its own tests from the unpacked SDIST (which proves the sdist carries them) with
   `python -m pytest -q -p no:cacheprovider --import-mode=importlib`.

A summary table goes to stdout (and summary.json); the exit status is 1 if anything failed.
Everything is written under --workdir (default build/check-packages/, git-ignored).

    .venv/bin/python .ci/check_packages.py                          # all, with this Python
    python .ci/check_packages.py --only colibri-relay --python python3.12
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass, field
from email.parser import Parser
from pathlib import Path
from xml.etree import ElementTree

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
TORCH_PIN = "torch==2.13.0"


@dataclass
class Dist:
    """One distribution to check, and what its own venv needs."""

    name: str
    directory: str  # relative to the repository root
    module: str
    extras: list[str]  # installed for the tests
    torch: bool  # install TORCH_PIN first (its test extras need torch); otherwise torch must not appear
    bare_torch: bool | None = None  # the same for a bare `pip install NAME` (default: as `torch`)
    tests_dir: str = "tests"
    extra_checks: list[str] = field(default_factory=list)  # python snippets run in its venv


DISTS = [
    Dist("colibri-spec", "packages/colibri-spec", "colibri_spec", ["test"], torch=False),
    Dist("colibri-relay", "packages/colibri-relay", "colibri_relay", ["test"], torch=False, extra_checks=[
        # the fake-Hub fixtures are a pytest11 plugin (loaded once: see its tests' conftest.py)
        "import importlib.metadata as m; eps = {e.name: e for e in m.entry_points(group='pytest11')};"
        "ep = eps['colibri_relay.testing.pytest_plugin']; mod = ep.load();"
        "assert hasattr(mod, 'fake_hub') and hasattr(mod, 'hub_store'), mod",
    ]),
    Dist("colibri-int4", "packages/colibri-int4", "colibri_int4", ["test"], torch=False),
    Dist("colibri-model", "packages/colibri-model", "colibri_model", ["test", "data"], torch=True),
    Dist("colibri-stream", "packages/colibri-stream", "colibri_stream", ["test", "hf"], torch=True),
    Dist("colibri-eval", "packages/colibri-eval", "colibri_eval", ["test", "colibri", "hf", "lm-eval"], torch=True,
         bare_torch=False, extra_checks=[
             "import importlib.metadata as m; eps = {e.name: e for e in m.entry_points(group='lm_eval.models')};"
             "cls = eps['colibri'].load(); assert cls.__name__ == 'ColibriLM', cls;"
             "from lm_eval.api.registry import MODEL_REGISTRY; assert 'colibri' in MODEL_REGISTRY",
         ]),
    # The app: its tests are the cross-package tests (a quick demo, relay legs), here against the wheels.
    Dist("colibri", ".", "colibri", ["test"], torch=True),
]


class CheckFailed(Exception):
    pass


@dataclass
class Result:
    name: str
    install_s: float = 0.0
    tests_s: float = 0.0
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    errors: int = 0
    tests: str = "-"
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


# --------------------------------------------------------------------------------------------
# helpers


def run(cmd: list[str], log: Path | None = None, cwd: Path | None = None, env: dict | None = None,
        timeout: float = 1800, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command; its output goes to `log` (appended) and, on failure, its tail into the error."""
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env or clean_env(), capture_output=True,
                          text=True, timeout=timeout)
    if log is not None:
        with log.open("a") as f:
            f.write(f"$ {' '.join(str(c) for c in cmd)}\n{done.stdout}{done.stderr}\n[exit {done.returncode}]\n")
    if check and done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
        raise CheckFailed(f"`{' '.join(str(c) for c in cmd[:4])} ...` exited {done.returncode}:\n    "
                          + "\n    ".join(tail))
    return done


def clean_env() -> dict:
    """This environment without anything that would leak the caller's venv into the checked one."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONDONTWRITEBYTECODE="1")
    return env


def tracked_files(directory: Path) -> list[str]:
    """Files of `directory` (relative to it) as git tracks them; a plain walk outside a git checkout."""
    done = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--", str(directory.relative_to(ROOT))],
                          capture_output=True, text=True)
    if done.returncode == 0 and done.stdout.strip():
        prefix = "" if directory == ROOT else str(directory.relative_to(ROOT)) + "/"
        return [line[len(prefix):] for line in done.stdout.splitlines() if Path(ROOT, line).exists()]
    return [str(p.relative_to(directory)) for p in directory.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and not any(s.endswith(".egg-info") for s in p.parts)]


def version_of(dist: Dist) -> str:
    try:
        import tomllib
    except ImportError:  # Python 3.10: `build` brings tomli
        import tomli as tomllib

    return tomllib.loads((ROOT / dist.directory / "pyproject.toml").read_text())["project"]["version"]


def wheel_path(dist_dir: Path, name: str) -> Path:
    found = sorted(dist_dir.glob(f"{name.replace('-', '_')}-*-py3-none-any.whl"))
    if len(found) != 1:
        raise CheckFailed(f"expected one wheel of {name} in {dist_dir}, found {[p.name for p in found]}")
    return found[0]


def sdist_path(dist_dir: Path, name: str) -> Path:
    found = sorted(dist_dir.glob(f"{name.replace('-', '_')}-*.tar.gz"))
    if len(found) != 1:
        raise CheckFailed(f"expected one sdist of {name} in {dist_dir}, found {[p.name for p in found]}")
    return found[0]


def wheel_metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(z.read(name).decode())


# --------------------------------------------------------------------------------------------
# 1-2: build and inspect


def build(dists: list[Dist], dist_dir: Path, log: Path) -> None:
    dist_dir.mkdir(parents=True, exist_ok=True)
    for dist in dists:
        for old in list(dist_dir.glob(f"{dist.name.replace('-', '_')}-*")):
            old.unlink()
        run([sys.executable, "-m", "build", "--outdir", dist_dir, ROOT / dist.directory], log=log, timeout=600)
    run([sys.executable, "-m", "twine", "check", "--strict", *sorted(dist_dir.iterdir())], log=log)


README_LINK = re.compile(r"\]\(([^)\s]+)\)")


def inspect_dists(dist: Dist, dist_dir: Path, built: dict[str, str]) -> list[str]:
    problems = []
    wheel, sdist = wheel_path(dist_dir, dist.name), sdist_path(dist_dir, dist.name)
    license_text = (ROOT / "LICENSE").read_bytes()
    src = ROOT / dist.directory / "src" / dist.module
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        licenses = [n for n in names if re.fullmatch(r"[^/]+\.dist-info/licenses/LICENSE", n)]
        if not licenses or z.read(licenses[0]) != license_text:
            problems.append("wheel: no LICENSE, or not the root's Apache-2.0 text")
    for rel in tracked_files(src):
        if "__pycache__" not in rel and f"{dist.module}/{rel}" not in names:
            problems.append(f"wheel lacks {dist.module}/{rel}")
    if f"{dist.module}/py.typed" not in names:
        problems.append("wheel lacks py.typed")
    with tarfile.open(sdist) as t:
        top = t.getnames()[0].split("/")[0]
        members = {n[len(top) + 1:] for n in t.getnames()}
        lic = t.extractfile(f"{top}/LICENSE") if "LICENSE" in members else None
        if lic is None or lic.read() != license_text:
            problems.append("sdist: no LICENSE, or not the root's Apache-2.0 text")
    tests = ROOT / dist.directory / dist.tests_dir
    if tests.is_dir():
        for rel in tracked_files(tests):
            if f"{dist.tests_dir}/{rel}" not in members:
                problems.append(f"sdist lacks {dist.tests_dir}/{rel}")

    meta = wheel_metadata(wheel)
    if meta["License-Expression"] != "Apache-2.0":
        problems.append(f"License-Expression is {meta['License-Expression']!r}")
    if not meta.get_all("Project-URL"):
        problems.append("no Project-URL")
    if "Typing :: Typed" not in (meta.get_all("Classifier") or []):
        problems.append("no 'Typing :: Typed' classifier")
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if name == canonicalize_name(dist.name):  # an extra that includes others (`dev = ["colibri[test]"]`)
            continue
        if name.startswith("colibri") or name == "torch":
            ops = {s.operator for s in req.specifier}
            if not ({">=", ">", "~=", "=="} & ops and ({"<", "<=", "~=", "=="} & ops)):
                problems.append(f"{line!r}: needs a lower and an upper bound")
        if name in built and not req.specifier.contains(built[name], prereleases=True):
            problems.append(f"{line!r} does not admit the {name} {built[name]} built beside it")
    for target in README_LINK.findall(meta.get_payload() or ""):
        if not target.startswith(("https://", "http://", "#", "mailto:")):
            problems.append(f"README link {target!r} works only inside the repository")
    return problems


# --------------------------------------------------------------------------------------------
# 3-5: install, smoke, test


def sibling_closure(name: str, extras: set[str], dist_dir: Path, built: dict[str, str]) -> dict[str, set[str]]:
    """The colibri distributions (with the extras asked of them) that `name[extras]` requires."""
    need: dict[str, set[str]] = {}
    todo = [(name, set(extras))]
    while todo:
        current, wanted = todo.pop()
        for line in wheel_metadata(wheel_path(dist_dir, current)).get_all("Requires-Dist") or []:
            req = Requirement(line)
            dep = canonicalize_name(req.name)
            if dep not in built:
                continue
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in wanted | {""}):
                continue
            if dep not in need or not req.extras <= need[dep]:
                need.setdefault(dep, set()).update(req.extras)
                todo.append((dep, need[dep]))
    need.pop(canonicalize_name(name), None)
    return need


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def new_venv(venv: Path, python: str, log: Path) -> Path:
    """A fresh venv; returns its python."""
    if venv.exists():
        shutil.rmtree(venv)
    run([python, "-m", "venv", venv], log=log)
    return venv_python(venv)


def install_torch(py: Path, torch_index_url: str | None, log: Path) -> None:
    """TORCH_PIN from `torch_index_url`, or else from local wheels only (pip's --find-links): the
    index's torch for Linux is the multi-GB build with CUDA, never wanted here."""
    if torch_index_url:
        run([py, "-m", "pip", "install", "-q", TORCH_PIN, "--index-url", torch_index_url], log=log, timeout=1800)
        return
    done = run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", TORCH_PIN], log=log, timeout=1800,
               check=False)
    if done.returncode != 0:
        raise CheckFailed(f"no local wheel of {TORCH_PIN} for this Python (pip's find-links): pass "
                          "--torch-index-url with an index of CPU builds, or --skip-torch")
    run([py, "-m", "pip", "install", "-q", TORCH_PIN], log=log, timeout=1800)  # its dependencies


def install(dist: Dist, extras: list[str], torch: bool, py: Path, dist_dir: Path, built: dict[str, str],
            siblings_from_index: bool, log: Path, report: Path) -> None:
    """The wheel and its declared dependencies. Siblings come from the just-built wheels (passed as
    files; pip's install report must show that each did), or with `siblings_from_index` from the
    index (release)."""
    wheel = wheel_path(dist_dir, dist.name)
    targets = [f"{wheel}[{','.join(extras)}]" if extras else str(wheel)]
    if not siblings_from_index:
        for sib, sib_extras in sorted(sibling_closure(dist.name, set(extras), dist_dir, built).items()):
            w = wheel_path(dist_dir, sib)
            targets.append(f"{w}[{','.join(sorted(sib_extras))}]" if sib_extras else str(w))
    # NOTE: torch stays at the pin: it satisfies every torch requirement, so pip keeps it.
    # --find-links too: pip 23.0 does not match `colibri-model; extra == "colibri"` to a wheel passed
    # as a file with other extras (`...whl[data]`); the report check below still proves the origin.
    links = [] if siblings_from_index else ["--find-links", dist_dir]
    run([py, "-m", "pip", "install", "-q", *links, "--report", report, *targets], log=log, timeout=1800)
    run([py, "-m", "pip", "check"], log=log)

    versions = json.loads(run([py, "-c", "import importlib.metadata as m, json; print(json.dumps("
                                         "{d.metadata['Name']: d.version for d in m.distributions()}))"],
                              log=log).stdout)
    if versions.get(dist.name) != built[canonicalize_name(dist.name)]:
        raise CheckFailed(f"{dist.name} {versions.get(dist.name)} is installed, not the built wheel")
    if not siblings_from_index:  # every colibri distribution in the venv is a just-built wheel
        for item in json.loads(report.read_text())["install"]:
            name = canonicalize_name(item["metadata"]["name"])
            url = item["download_info"]["url"]
            if name in built and (not url.startswith("file://") or Path(url[7:]).parent != dist_dir):
                raise CheckFailed(f"{name} was installed from {url}, not from the just-built wheels")
        for name, version in versions.items():
            if canonicalize_name(name) in built and version != built[canonicalize_name(name)]:
                raise CheckFailed(f"{name} {version} is installed, {built[canonicalize_name(name)]} was built")
    if torch and versions.get("torch", "").split("+")[0] != TORCH_PIN.split("==")[1]:
        raise CheckFailed(f"torch {versions.get('torch')} is installed, not {TORCH_PIN}")
    if not torch and "torch" in versions:
        raise CheckFailed(f"{dist.name}[{','.join(extras)}] pulled torch {versions['torch']}, "
                          "but it must install without torch")


def siblings_published(dist: Dist, py: Path, dist_dir: Path, log: Path, scratch: Path) -> None:
    """Release gate: each colibri requirement of the wheel (extras included) is on the index."""
    problems = []
    for line in wheel_metadata(wheel_path(dist_dir, dist.name)).get_all("Requires-Dist") or []:
        req = Requirement(line)
        if canonicalize_name(req.name).startswith("colibri"):
            wanted = f"{req.name}{req.specifier}"
            done = run([py, "-m", "pip", "download", "-q", "--no-deps", "--dest", scratch / "published", wanted],
                       log=log, check=False)
            if done.returncode != 0:
                problems.append(f"{dist.name} requires `{line}`, and no such release is on the index yet")
    if problems:
        raise CheckFailed("; ".join(problems) + ": publish those siblings first")


def smoke(dist: Dist, venv: Path, version: str, torch: bool, log: Path, scratch: Path,
          core_only: bool = False) -> list[str]:
    """Import from site-packages, --help of every console script (the main one only for a bare
    install), --version of the main one, and its entry points. Returns the problems of the last
    three (the tests still run); a failed import raises."""
    py = venv_python(venv)
    scratch.mkdir(parents=True, exist_ok=True)
    where = run([py, "-c", f"import {dist.module} as m; print(m.__file__); print(m.__version__)"],
                log=log, cwd=scratch).stdout.split()
    if "site-packages" not in where[0]:
        raise CheckFailed(f"{dist.module} imported from {where[0]}, not from the venv's site-packages")
    if where[1] != version:
        raise CheckFailed(f"{dist.module}.__version__ is {where[1]}, the distribution is {version}")
    if not torch:
        run([py, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"],
            log=log, cwd=scratch)
    scripts = json.loads(run([py, "-c", "import importlib.metadata as m, json; print(json.dumps("
                                        f"[e.name for e in m.distribution('{dist.name}').entry_points "
                                        "if e.group == 'console_scripts']))"], log=log).stdout)
    problems = []
    if dist.name not in scripts:
        problems.append(f"no console script {dist.name!r} (it has {scripts})")
    checks = [[venv / "bin" / s, "--help"] for s in ([dist.name] if core_only else scripts)]
    checks += [[venv / "bin" / dist.name, "--version"]]
    checks += [[py, "-c", snippet] for snippet in ([] if core_only else dist.extra_checks)]
    for cmd in checks:
        try:
            shown = run(cmd, log=log, cwd=scratch, timeout=300).stdout
        except CheckFailed as exc:
            problems.append(str(exc))
            continue
        if cmd[-1] == "--version" and version not in shown:
            problems.append(f"`{dist.name} --version` printed {shown.strip()!r}, not {version}")
    return problems


def eval_core_smoke(venv: Path, log: Path, scratch: Path) -> None:
    """Plain `pip install colibri-eval`: the light core works, and scoring a model without the extra
    it needs says which extra to install in one line (no traceback)."""
    run([venv / "bin" / "colibri-eval", "tasks"], log=log, cwd=scratch)
    model = scratch / "hf-model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"model_type": "llama"}')
    done = run([venv / "bin" / "colibri-eval", "run", "--model", f"hf:{model}", "--tasks", "piqa",
                "--data-dir", "bundled", "--limit", "2", "--out", scratch / "r.json"],
               log=log, cwd=scratch, check=False)
    said = done.stdout + done.stderr
    if done.returncode == 0 or "Traceback" in said or "colibri-eval[hf]" not in said:
        raise CheckFailed("`colibri-eval run --model hf:DIR` without the [hf] extra should exit non-zero with "
                          f"one line naming colibri-eval[hf]; it exited {done.returncode}: {said.strip()[-400:]!r}")


def run_tests(dist: Dist, venv: Path, sdist: Path, work: Path, slug: str, log: Path, result: Result) -> None:
    unpacked = work / "sdists"
    unpacked.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as t:
        top = t.getnames()[0].split("/")[0]
        if (unpacked / top).exists():
            shutil.rmtree(unpacked / top)
        t.extractall(unpacked, filter="data")
    junit = work / "reports" / f"{slug}.junit.xml"
    junit.unlink(missing_ok=True)
    start = time.monotonic()
    # NOTE: `-c pyproject.toml` pins the rootdir and the config to the sdist's own; without it pytest
    # climbs out of the unpacked sdist and picks up the repository's pyproject.toml.
    done = run([venv_python(venv), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
                "-c", "pyproject.toml", "--rootdir", ".", f"--junitxml={junit}", dist.tests_dir],
               log=log, cwd=unpacked / top, timeout=3600, check=False)
    result.tests_s = time.monotonic() - start
    if junit.exists():
        suite = ElementTree.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        total, result.failed, result.errors, result.skipped = (
            int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        result.passed = total - result.failed - result.errors - result.skipped
    result.tests = f"{result.passed} passed, {result.failed} failed, {result.skipped} skipped" + (
        f", {result.errors} errors" if result.errors else "")
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-12:]
        raise CheckFailed(f"tests from the sdist exited {done.returncode}:\n    " + "\n    ".join(tail))


def check_one(dist: Dist, args, work: Path, dist_dir: Path, built: dict[str, str], bare: bool = False) -> Result:
    """Every check of one distribution. `bare`: `pip install NAME` with no extras and no tests."""
    label = f"{dist.name} (no extras)" if bare else dist.name
    slug = f"py{args.pyver}-{dist.name}" + ("-bare" if bare else "")
    result = Result(label)
    log = work / "logs" / f"{slug}.log"
    log.write_text("")
    venv, scratch = work / "venvs" / slug, work / "scratch" / slug
    scratch.mkdir(parents=True, exist_ok=True)
    version = built[canonicalize_name(dist.name)]
    extras = [] if bare else dist.extras
    torch = (dist.torch if dist.bare_torch is None else dist.bare_torch) if bare else dist.torch
    if torch and args.skip_torch:
        result.tests = "skipped: needs torch, and --skip-torch"
        return result
    try:
        if not bare or args.published_siblings:
            result.problems += inspect_dists(dist, dist_dir, built)
        start = time.monotonic()
        py = new_venv(venv, args.python, log)
        if args.published_siblings:
            siblings_published(dist, py, dist_dir, log, scratch)
        if torch:
            install_torch(py, args.torch_index_url, log)
        install(dist, extras, torch, py, dist_dir, built, args.published_siblings, log,
                work / "reports" / f"{slug}.pip-report.json")
        result.install_s = time.monotonic() - start
        result.problems += smoke(dist, venv, version, torch, log, scratch, core_only=bare)
        if bare and dist.name == "colibri-eval":
            eval_core_smoke(venv, log, scratch)
        if bare or args.no_tests:
            result.tests = "not run"
        else:
            run_tests(dist, venv, sdist_path(dist_dir, dist.name), work, slug, log, result)
    except (CheckFailed, subprocess.TimeoutExpired) as exc:
        result.problems.append(str(exc))
    if result.ok and not args.keep_venvs:
        shutil.rmtree(venv, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated distributions (default: all)")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the fresh venvs")
    parser.add_argument("--workdir", default=str(ROOT / "build" / "check-packages"))
    parser.add_argument("--torch-index-url", default=os.environ.get("COLIBRI_TORCH_INDEX_URL"),
                        help="index for torch (CI: the CPU-only build); default: pip's configured index")
    parser.add_argument("--no-build", action="store_true", help="reuse the wheels and sdists in WORKDIR/dist")
    parser.add_argument("--dist-dir", help="check the wheels and sdists in DIR (built elsewhere) instead of building")
    parser.add_argument("--published-siblings", action="store_true",
                        help="release smoke test: a bare install whose colibri siblings come from the index, "
                             "after checking that the versions it requires are published")
    parser.add_argument("--no-tests", action="store_true", help="install and smoke-test only")
    parser.add_argument("--skip-torch", action="store_true",
                        help="skip the checks that need torch (e.g. a Python with no local CPU torch wheel)")
    parser.add_argument("--keep-venvs", action="store_true", help="keep the venvs of passing checks too")
    args = parser.parse_args(argv)

    chosen = [d for d in DISTS if not args.only or d.name in args.only.split(",")]
    if args.only and len(chosen) != len(set(args.only.split(","))):
        parser.error(f"--only: known distributions are {', '.join(d.name for d in DISTS)}")
    work = Path(args.workdir).resolve()
    dist_dir = Path(args.dist_dir).resolve() if args.dist_dir else work / "dist"
    for sub in ("logs", "reports"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    args.pyver = pyver = run([args.python, "-c", "import platform; print(platform.python_version())"]).stdout.strip()
    print(f"check-packages: Python {pyver} ({args.python}), work in {work}", flush=True)

    wall = time.monotonic()
    results: list[Result] = []
    try:
        if not (args.no_build or args.dist_dir):
            print("  building every sdist and wheel (wheel from sdist), twine check --strict", flush=True)
            build(DISTS, dist_dir, work / "logs" / "build.log")  # all: siblings come from here
            print(f"  built in {time.monotonic() - wall:.0f} s", flush=True)
    except CheckFailed as exc:
        results.append(Result("build", problems=[str(exc)]))
    else:
        built = {canonicalize_name(d.name): version_of(d) for d in DISTS}
        for dist in chosen:
            if not args.published_siblings:
                print(f"  {dist.name} ...", flush=True)
                results.append(check_one(dist, args, work, dist_dir, built))
            if args.published_siblings or dist.name == "colibri-eval":  # what `pip install NAME` gives
                print(f"  {dist.name} without extras ...", flush=True)
                results.append(check_one(dist, args, work, dist_dir, built, bare=True))
    wall = time.monotonic() - wall

    print(f"\n{'package (Python ' + pyver + ')':<28} {'install':>8} {'tests':>8}  {'result':<7} tests")
    for r in results:
        status = "FAILED" if not r.ok else "skipped" if r.tests.startswith("skipped") else "ok"
        print(f"{r.name:<28} {r.install_s:>7.1f}s {r.tests_s:>7.1f}s  {status:<7} {r.tests}")
    for r in results:
        for problem in r.problems:
            print(f"\nFAILED {r.name}: {problem}")
    print(f"\ncheck-packages: {sum(r.ok for r in results)}/{len(results)} ok in {wall:.0f} s "
          f"(logs: {work / 'logs'})")
    (work / "summary.json").write_text(json.dumps(
        {"python": pyver, "wall_s": round(wall, 1),
         "results": [{**r.__dict__, "ok": r.ok} for r in results]}, indent=2))
    return 0 if results and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
