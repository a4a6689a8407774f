"""Who may import whom (shared/ARCHITECTURE.md), checked on every package's source with `ast`.

Every `import` counts, wherever it is: at module level, inside a function (lazy), under
`try`/`if TYPE_CHECKING`, or as `importlib.import_module("...")` with a literal name. Relative
imports are resolved to absolute names. The rules, one per row of the table:

| package | may import | never |
|---|---|---|
| colibri-spec | pydantic, stdlib (nothing else, not even its test extras) | torch, numpy, any other colibri package |
| colibri-relay | colibri-spec, huggingface_hub, pydantic, click, filelock, stdlib | torch, any other colibri package |
| colibri-int4 | colibri-spec, numpy, pydantic, safetensors; torch only inside export; gguf (extra) lazily in import_gguf | colibri-model, colibri-stream |
| colibri-model | colibri-spec, torch, safetensors, pydantic, numpy, tokenizers | relay, int4, stream, eval |
| colibri-stream | colibri-spec, colibri-int4, colibri-model, torch, numpy | relay, eval |
| colibri-eval | colibri-spec, lm-eval, numpy, click; adapters import colibri-model / colibri-stream / transformers lazily | relay |
| colibri (app) | all of the above | - |

A third-party import must also be a dependency the package declares (pyproject.toml, extras
included), so a package installed alone can import it; the table's "may import" lists name the
main ones (it omits e.g. click and tqdm, which several packages declare).

Inside every package, no module imports itself back through others (no import circle, lazy
imports included), but for the circles listed in KNOWN_CIRCLES that open work removes.

Between packages, only public names (COMPATIBILITY.md, "Public modules"): a package or the app
imports a sibling's names from the sibling's top level, where they must be in its `__all__`, or
from a module of COMPATIBILITY.md's table of public modules, where they must be in that module's
`__all__` (or be a submodule the table lists too); never from another module, never a name with a
leading underscore, and `import colibri_x.sub` / `import_module("colibri_x.sub")` only for a
listed module. `__all__` is read from the source (a literal list), so nothing is imported. The
table is read from COMPATIBILITY.md itself, so the promise and the check are one list. Not held:
attribute chains after `import colibri_x` (`colibri_x.sub.name`; none exist), bench/ and the test
suites (they measure and test internals).

And inside colibri-stream: the runtime (everything but studies/ and the CLI modules that run
studies) never imports `colibri_stream.studies` nor `colibri_model.training` (the trainer is
only needed to train the routing model of a study workload).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10: `build` (a dev dependency) brings tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
COLIBRI = {"colibri_spec", "colibri_relay", "colibri_int4", "colibri_model", "colibri_stream", "colibri_eval", "colibri"}


@dataclass(frozen=True)
class Rule:
    source: Path  # the import package's directory
    pyproject: Path
    colibri: frozenset[str] = frozenset()  # other colibri packages it may import
    third_party: frozenset[str] = frozenset()  # the table's "may import" (import names)
    never: frozenset[str] = frozenset()
    only_in: dict[str, tuple[str, ...]] = field(default_factory=dict)  # name -> the files that may import it
    only_lazily: frozenset[str] = frozenset()  # names imported only inside functions
    only_the_table: bool = False  # declared dependencies (test extras) do not widen `third_party`


def _package(name: str) -> tuple[Path, Path]:
    directory = ROOT / "packages" / name.replace("_", "-")
    return directory / "src" / name, directory / "pyproject.toml"


RULES = {
    "colibri_spec": Rule(
        *_package("colibri_spec"),
        third_party=frozenset({"pydantic"}),
        never=frozenset({"torch", "numpy"} | COLIBRI - {"colibri_spec"}),
        only_the_table=True,
    ),
    "colibri_relay": Rule(
        *_package("colibri_relay"),
        colibri=frozenset({"colibri_spec"}),
        third_party=frozenset({"huggingface_hub", "pydantic", "click", "filelock"}),
        never=frozenset({"torch"} | COLIBRI - {"colibri_relay", "colibri_spec"}),
    ),
    "colibri_int4": Rule(
        *_package("colibri_int4"),
        colibri=frozenset({"colibri_spec"}),
        third_party=frozenset({"numpy", "pydantic", "safetensors", "torch", "gguf"}),
        never=frozenset({"colibri_model", "colibri_stream", "colibri_relay", "colibri_eval", "colibri"}),
        # gguf is the optional [gguf] extra: imported in one place, when a GGUF is opened
        only_in={"torch": ("export.py",), "gguf": ("import_gguf/gguf_file.py",)},
        only_lazily=frozenset({"gguf"}),
    ),
    "colibri_model": Rule(
        *_package("colibri_model"),
        colibri=frozenset({"colibri_spec"}),
        third_party=frozenset({"torch", "safetensors", "pydantic", "numpy", "tokenizers"}),
        never=frozenset({"colibri_relay", "colibri_int4", "colibri_stream", "colibri_eval", "colibri"}),
    ),
    "colibri_stream": Rule(
        *_package("colibri_stream"),
        colibri=frozenset({"colibri_spec", "colibri_int4", "colibri_model"}),
        third_party=frozenset({"torch", "numpy"}),
        never=frozenset({"colibri_relay", "colibri_eval", "colibri"}),
    ),
    "colibri_eval": Rule(
        *_package("colibri_eval"),
        colibri=frozenset({"colibri_spec", "colibri_model", "colibri_stream"}),
        # `evaluate` is lm-eval's own dependency, imported first only to fix lm-eval's import order
        third_party=frozenset({"lm_eval", "numpy", "click", "transformers", "evaluate"}),
        never=frozenset({"colibri_relay", "colibri_int4", "colibri"}),
        only_in={"colibri_model": ("adapters/",), "colibri_stream": ("adapters/",)},
        only_lazily=frozenset({"colibri_model", "colibri_stream", "transformers"}),
    ),
    "colibri": Rule(ROOT / "src" / "colibri", ROOT / "pyproject.toml", colibri=frozenset(COLIBRI - {"colibri"})),
}

# colibri-stream modules that are not its runtime: the studies and the CLI modules that run them
# (`bench` lives in cli/bench.py, `bench-suite` in cli/bench_suite.py, `policy-study` and `trace-hf` in
# cli/traces.py; they import studies/ only inside the command, so `colibri-stream generate` never
# loads them).
STREAM_NOT_RUNTIME = ("studies/", "cli/bench.py", "cli/bench_suite.py", "cli/traces.py")
STREAM_RUNTIME_NEVER = ("colibri_stream.studies", "colibri_model.training")

# distribution name -> import name, where they differ beyond "-" -> "_"
IMPORT_NAMES = {"pyyaml": "yaml", "lm_eval": "lm_eval", "pillow": "PIL"}


@dataclass(frozen=True)
class Import:
    file: str  # relative to the package directory
    line: int
    module: str  # absolute dotted name
    lazy: bool  # inside a function body

    @property
    def top(self) -> str:
        return self.module.split(".")[0]

    def __str__(self) -> str:
        return f"{self.file}:{self.line} {self.module}{' (lazy)' if self.lazy else ''}"


def imports_of(source: Path) -> list[Import]:
    """Every import in the package at `source`, relative ones resolved."""
    out = []
    for path in sorted(source.rglob("*.py")):
        rel = path.relative_to(source)
        # the package a relative import starts from: the file's folder (for __init__.py too)
        package = (source.name, *rel.parent.parts)
        tree = ast.parse(path.read_text(), str(path))
        _walk(tree, False, str(rel), package, out)
    return out


def _walk(node: ast.AST, lazy: bool, file: str, package: tuple[str, ...], out: list[Import]) -> None:
    for child in ast.iter_child_nodes(node):
        inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(child, ast.Import):
            out += [Import(file, child.lineno, alias.name, lazy) for alias in child.names]
        elif isinstance(child, ast.ImportFrom):
            if child.level:
                base = package[: len(package) - child.level + 1]
                module = ".".join(base + ((child.module,) if child.module else ()))
            else:
                module = child.module or ""
            out.append(Import(file, child.lineno, module, lazy))
            # `from . import studies` imports a submodule by name
            out += [Import(file, child.lineno, f"{module}.{a.name}", lazy) for a in child.names if a.name != "*"]
        elif isinstance(child, ast.Call) and _is_dynamic_import(child):
            out.append(Import(file, child.lineno, child.args[0].value, lazy))
        _walk(child, inner, file, package, out)


def _is_dynamic_import(call: ast.Call) -> bool:
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
    literal = call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)
    return name in ("import_module", "__import__") and bool(literal)


def declared_imports(pyproject: Path) -> set[str]:
    """Import names of the dependencies `pyproject` declares, optional extras included."""
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    names = set()
    for requirement in requirements:
        name = re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0).lower().replace("-", "_")
        names.add(IMPORT_NAMES.get(name, name))
    return names


def violations(name: str, rule: Rule) -> list[str]:
    stdlib = set(sys.stdlib_module_names)
    declared = set() if rule.only_the_table else declared_imports(rule.pyproject)
    allowed = rule.third_party | declared | rule.colibri | {name}
    if name == "colibri":  # the app composes everything: all of the above
        allowed |= {n for other in RULES.values() for n in other.third_party | declared_imports(other.pyproject)}
    bad = []
    for imp in imports_of(rule.source):
        top = imp.top
        if top in stdlib or top == "__future__":
            continue
        if top in rule.never:
            bad.append(f"{imp}: {name} never imports {top}")
        elif top in COLIBRI and top not in rule.colibri | {name}:
            bad.append(f"{imp}: {name} may not import {top}")
        elif top not in allowed:
            bad.append(f"{imp}: {top} is neither in the table nor a declared dependency of {name}")
        if top in rule.only_in and not imp.file.startswith(rule.only_in[top]):
            bad.append(f"{imp}: {top} may be imported only in {', '.join(rule.only_in[top])}")
        if top in rule.only_lazily and not imp.lazy:
            bad.append(f"{imp}: {top} must be imported lazily (inside a function)")
    return bad


@pytest.mark.parametrize("name", list(RULES))
def test_each_package_imports_only_what_the_table_allows(name):
    rule = RULES[name]
    assert rule.source.is_dir(), rule.source
    assert violations(name, rule) == []


def stream_runtime_imports() -> list[Import]:
    source = RULES["colibri_stream"].source
    return [imp for imp in imports_of(source) if not imp.file.startswith(STREAM_NOT_RUNTIME)]


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_stream_runtime_never_imports_studies_or_the_trainer():
    bad = [str(imp) for imp in stream_runtime_imports() if _within(imp.module, STREAM_RUNTIME_NEVER)]
    assert bad == []


def test_stream_runtime_loads_no_studies_or_trainer_module_transitively():
    """The static check sees direct imports; importing every runtime module in a fresh
    interpreter also catches a runtime module reaching studies through another module."""
    source = RULES["colibri_stream"].source
    modules = []
    for path in sorted(source.rglob("*.py")):
        rel = path.relative_to(source)
        if str(rel).startswith(STREAM_NOT_RUNTIME) or rel.name == "__main__.py":
            continue
        parts = ("colibri_stream", *rel.with_suffix("").parts)
        modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"bad = sorted(m for m in sys.modules if any(m == p or m.startswith(p + '.') for p in {STREAM_RUNTIME_NEVER!r}))\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert len(modules) > 20  # engine, plan, compute/, cache/, io/, traces/ ...


# --- the checker itself: each rule fires on a planted import -------------------------------------
def test_checker_resolves_relative_lazy_and_dynamic_imports(tmp_path):
    pkg = tmp_path / "colibri_stream"
    (pkg / "cache").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cache" / "__init__.py").write_text("from .. import studies\n")
    (pkg / "cache" / "lazy.py").write_text(
        "def f():\n    from ..studies.bench import run\n    import importlib\n"
        "    importlib.import_module('colibri_model.training')\n"
    )
    found = {(imp.file, imp.module, imp.lazy) for imp in imports_of(pkg)}
    assert ("cache/__init__.py", "colibri_stream.studies", False) in found
    assert ("cache/lazy.py", "colibri_stream.studies.bench", True) in found
    assert ("cache/lazy.py", "colibri_model.training", True) in found
    assert _within("colibri_model.training.trainer", STREAM_RUNTIME_NEVER)
    assert not _within("colibri_model.cli.training", STREAM_RUNTIME_NEVER)


def test_checker_reports_each_kind_of_violation(tmp_path):
    pkg = tmp_path / "colibri_eval"
    (pkg / "adapters").mkdir(parents=True)
    (pkg / "scoring.py").write_text("import colibri_relay\nimport transformers\nimport colibri_model\nimport leftpad\n")
    (pkg / "adapters" / "x.py").write_text("import colibri_stream\n")
    rule = Rule(pkg, RULES["colibri_eval"].pyproject, **{
        k: getattr(RULES["colibri_eval"], k) for k in ("colibri", "third_party", "never", "only_in", "only_lazily")
    })
    found = "\n".join(violations("colibri_eval", rule))
    assert "never imports colibri_relay" in found
    assert "scoring.py:2 transformers: transformers must be imported lazily" in found
    assert "colibri_model may be imported only in adapters/" in found
    assert "leftpad is neither in the table nor a declared dependency" in found
    assert "adapters/x.py:1 colibri_stream: colibri_stream must be imported lazily" in found
    int4 = tmp_path / "colibri_int4"
    int4.mkdir()
    (int4 / "reader.py").write_text("import torch\nfrom colibri_model import x\n")
    rule = Rule(int4, RULES["colibri_int4"].pyproject, third_party=RULES["colibri_int4"].third_party,
                never=RULES["colibri_int4"].never, only_in=RULES["colibri_int4"].only_in)
    found = "\n".join(violations("colibri_int4", rule))
    assert "torch may be imported only in export.py" in found and "never imports colibri_model" in found


def test_checker_holds_colibri_spec_to_pydantic_and_the_stdlib(tmp_path):
    """colibri-spec's row: its own test extras (pytest, hypothesis) do not count as allowed."""
    spec = tmp_path / "colibri_spec"
    spec.mkdir()
    (spec / "schema.py").write_text("import json\nimport pydantic\nimport numpy\nimport pytest\nfrom colibri_model import x\n")
    rule = Rule(spec, RULES["colibri_spec"].pyproject, third_party=RULES["colibri_spec"].third_party,
                never=RULES["colibri_spec"].never, only_the_table=True)
    found = violations("colibri_spec", rule)
    assert found == [
        "schema.py:3 numpy: colibri_spec never imports numpy",
        "schema.py:4 pytest: pytest is neither in the table nor a declared dependency of colibri_spec",
        "schema.py:5 colibri_model: colibri_spec never imports colibri_model",
        "schema.py:5 colibri_model.x: colibri_spec never imports colibri_model",
    ]


# --- no import circle inside a package ------------------------------------------------------------
# The circles that open work still has to remove: none now. The test fails on any circle that is not
# listed here, and when a listed one is gone, so that the list only shrinks.
KNOWN_CIRCLES: list[list[str]] = []


def module_graph(name: str, rule: Rule) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (lazy imports included)."""
    files = {}
    for path in sorted(rule.source.rglob("*.py")):
        parts = (name, *path.relative_to(rule.source).with_suffix("").parts)
        files[str(path.relative_to(rule.source))] = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    known = set(files.values())
    found = imports_of(rule.source)
    # `from . import x` with x a module imports x; its package is the one already being imported
    submodule_lines = {(i.file, i.line, i.module.rpartition(".")[0]) for i in found if i.module in known}
    graph: dict[str, set[str]] = {module: set() for module in known}
    for imp in found:
        if (imp.file, imp.line, imp.module) in submodule_lines:
            continue
        target = imp.module
        while target and target not in known:  # `pkg.mod.name` -> the module `pkg.mod`
            target = target.rpartition(".")[0]
        if target and target != files[imp.file]:
            graph[files[imp.file]].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_no_import_circle_inside_a_package():
    found = sorted(circle for name, rule in RULES.items() for circle in circles(module_graph(name, rule)))
    assert found == sorted(KNOWN_CIRCLES)


def test_circle_finder_sees_lazy_and_relative_imports(tmp_path):
    pkg = tmp_path / "colibri_spec"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("from .b import x\n")
    (pkg / "b.py").write_text("def f():\n    from .a import y\n")
    (pkg / "c.py").write_text("from . import a\n")
    rule = Rule(pkg, RULES["colibri_spec"].pyproject)
    assert circles(module_graph("colibri_spec", rule)) == [["colibri_spec.a", "colibri_spec.b"]]


# --- siblings import each other's public names only ---------------------------------------------
def public_modules(compatibility: Path = ROOT / "COMPATIBILITY.md") -> set[str]:
    """The modules of COMPATIBILITY.md's "Public modules" table (the first cell of each row)."""
    text = compatibility.read_text()
    section = text.split("### Public modules", 1)[1].split("\n#", 1)[0]
    return set(re.findall(r"^\| `(colibri[\w.]*)` \|", section, re.MULTILINE))


def module_file(module: str) -> Path | None:
    """The source file of a colibri module (`pkg/mod.py` or `pkg/mod/__init__.py`), or None."""
    top, *rest = module.split(".")
    if top not in RULES:
        return None
    base = RULES[top].source.joinpath(*rest)
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def declared_all(path: Path) -> set[str] | None:
    """The names of a module's literal `__all__` (assignments and `+=`), or None without one."""
    names = None
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        if any(isinstance(target, ast.Name) and target.id == "__all__" for target in targets):
            names = (names or set()) | set(ast.literal_eval(node.value))
    return names


@dataclass(frozen=True)
class NamedImport:
    file: str
    line: int
    module: str
    names: tuple[str, ...]  # () for `import module` and import_module("module")

    def __str__(self) -> str:
        return f"{self.file}:{self.line} {self.module}" + (f" import {', '.join(self.names)}" if self.names else "")


def sibling_imports(name: str, source: Path) -> list[NamedImport]:
    """Every import in the package at `source` of another colibri package, lazy ones included."""
    out = []
    for path in sorted(source.rglob("*.py")):
        rel = str(path.relative_to(source))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found = [(node.module, tuple(a.name for a in node.names))]
            elif isinstance(node, ast.Import):
                found = [(a.name, ()) for a in node.names]
            elif isinstance(node, ast.Call) and _is_dynamic_import(node):
                found = [(node.args[0].value, ())]
            else:
                continue
            out += [NamedImport(rel, node.lineno, module, names) for module, names in found
                    if module.split(".")[0] in COLIBRI - {name}]
    return sorted(out, key=lambda imp: (imp.file, imp.line))


def non_public_imports(name: str, source: Path, public: set[str]) -> list[str]:
    bad = []
    exported: dict[str, set[str] | None] = {}

    def all_of(module: str) -> set[str] | None:
        if module not in exported:
            path = module_file(module)
            exported[module] = declared_all(path) if path else None
        return exported[module]

    for imp in sibling_imports(name, source):
        top = imp.module.split(".")[0]
        if imp.module != top and imp.module not in public:
            bad.append(f"{imp}: {imp.module} is not a public module of {top} (COMPATIBILITY.md)")
            continue
        names = all_of(imp.module)
        for imported in imp.names:
            if imported.startswith("_"):
                bad.append(f"{imp}: {imported} is private")
            elif imported == "*":
                bad.append(f"{imp}: no star imports across packages")
            elif imported not in (names or set()) and f"{imp.module}.{imported}" not in public:
                bad.append(f"{imp}: {imported} is not in {imp.module}.__all__")
    return bad


def test_public_modules_exist_and_declare_their_names():
    public = public_modules()
    assert len(public) >= 5, public
    for module in sorted(public | set(RULES)):
        path = module_file(module)
        assert path is not None, f"{module} (COMPATIBILITY.md) has no source file"
        if module != "colibri":  # the app is no one's dependency
            assert declared_all(path), f"{module} has no literal __all__"


@pytest.mark.parametrize("name", list(RULES))
def test_siblings_import_only_each_others_public_names(name):
    assert non_public_imports(name, RULES[name].source, public_modules()) == []


def test_public_name_checker_refuses_each_kind(tmp_path):
    app = tmp_path / "colibri"
    app.mkdir()
    (app / "a.py").write_text(
        "from colibri_relay import Relay\n"  # top-level __all__: fine
        "from colibri_relay import _private\n"
        "from colibri_relay import NotExported\n"
        "from colibri_relay.rounds import RoundRelay\n"  # not a public module
        "from colibri_relay.testing import FakeHub\n"  # a public module's __all__: fine
        "from colibri_spec.hf_config import config_fields\n"  # a public submodule by name: fine
        "def f():\n    import colibri_stream.studies.bench\n"
        "    import importlib\n    importlib.import_module('colibri_model.training')\n"  # public: fine
        "from colibri_model.training import *\n"
    )
    found = non_public_imports("colibri", app, public_modules())
    assert found == [
        "a.py:2 colibri_relay import _private: _private is private",
        "a.py:3 colibri_relay import NotExported: NotExported is not in colibri_relay.__all__",
        "a.py:4 colibri_relay.rounds import RoundRelay: colibri_relay.rounds is not a public module of "
        "colibri_relay (COMPATIBILITY.md)",
        "a.py:8 colibri_stream.studies.bench: colibri_stream.studies.bench is not a public module of "
        "colibri_stream (COMPATIBILITY.md)",
        "a.py:11 colibri_model.training import *: no star imports across packages",
    ]
