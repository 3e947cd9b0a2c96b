"""The dependency rules of ARCHITECTURE.md, read from the source with `ast` (nothing is imported).

- `hypnos_site -> inference -> {models_registry, memory, logs}`: nothing but `hypnos_site` (and
  the tests and benchmarks) imports `inference`;
- `memory` imports no Django, not even through another first-party module;
- no import cycle among `inference`'s modules. Every import counts, at module level, inside a
  function and under `if TYPE_CHECKING:` alike: a cycle that only a function-local import hides
  still ties the modules together. An edge a module needs deliberately is annotated on its line
  with `# deliberate cycle: <why>` and listed in DELIBERATE below, so both places say it. The
  parent package an import runs first (`inference.worker` for `inference.worker.runtime`) is not
  an edge: a package's `__init__` re-exporting its parts would otherwise tie every part to all
  the others;
- the layout of `inference` (inference/web/__init__.py, docs/architecture.md): an API surface
  (`inference.web.openai`, `.ollama`, `.anthropic`, `.lemonade`) imports `inference.web.common`,
  `inference.transport` and `inference.jobs`, never another surface, `inference.worker` or
  `inference.engines`; `inference.web.common` imports no surface; `inference.transport` and
  `inference.jobs` import nothing of `inference.web`; no module but the Django app's own lies
  directly in `inference/`;
- the web process's module-level imports reach no engine library, no module that imports one
  (an engine backend: its heavy imports are inside it) and no worker module;
  tests/e2e/test_distributed.py checks the same thing at run time in a real distributed web
  process (`sys.modules` after importing `hypnos_site.asgi`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from hypnos_site.config import BASE_DIR

APPS = ("hypnos_site", "inference", "models_registry", "memory", "logs")
DJANGO = ("django", "rest_framework", "adrf", "channels", "channels_redis", "asgiref", "daphne", "celery")
ENGINE_LIBRARIES = (
    "llama_cpp",
    "onnxruntime",
    "faster_whisper",
    "ctranslate2",
    "piper",
    "docling",
    "stable_diffusion_cpp",
    "ncnn",
    "rapidocr_onnxruntime",
    "gliner",
)
# What the distributed web process imports: the ASGI application, its URL table and the routes.
WEB_ENTRY_POINTS = (
    "hypnos_site.asgi",
    "hypnos_site.urls",
    "inference.web.openai.urls",
    "inference.web.openai.views",
    "inference.web.openai.realtime",
    "inference.web.ollama.urls",
    "inference.web.anthropic.urls",
    "inference.web.lemonade.urls",
    "logs.urls",
)
SURFACES = ("openai", "ollama", "anthropic", "lemonade")
# The modules that lie directly in inference/: the Django app's own (apps.py; models.py,
# admin.py if it grows them). Everything else belongs to a package that says its process.
APP_MODULES = {"inference", "inference.apps", "inference.models", "inference.admin"}
# (importer, imported) edges of a cycle that is meant, each with its `# deliberate cycle:` line.
DELIBERATE: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Import:
    module: str  # the first-party or library module imported
    line: int
    local: bool  # inside a function (or a method)
    typing_only: bool  # under `if TYPE_CHECKING:`: never run
    deliberate: bool


def module_name(path: Path) -> str:
    parts = path.relative_to(BASE_DIR).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def sources() -> dict[str, Path]:
    """Every module of the apps (migrations included: they run in the web process too)."""
    return {module_name(path): path for app in APPS for path in sorted((BASE_DIR / app).rglob("*.py"))}


def _resolve(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool) -> Iterator[str]:
    """The modules an import statement loads: `from a import b` loads `a.b` when that is a
    module, else `a`."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = _resolve(node, importer, is_package)
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        yield submodule if submodule in sources() else base


@cache
def imports(module: str) -> tuple[Import, ...]:
    path = sources()[module]
    text = path.read_text()
    lines = text.splitlines()
    found: list[Import] = []

    def visit(node: ast.AST, local: bool, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                deliberate = "# deliberate cycle:" in lines[child.lineno - 1]
                for target in _targets(child, module, path.name == "__init__.py"):
                    found.append(Import(target, child.lineno, local, typing_only, deliberate))
            visit(
                child,
                local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)),
                typing_only or _is_type_checking(child),
            )

    visit(ast.parse(text, str(path)), local=False, typing_only=False)
    return tuple(found)


def _is_type_checking(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def first_party(name: str) -> str | None:
    """The app module `name` is, or the app module it lies in (`a.b.C` -> `a.b`)."""
    while name and name not in sources():
        name = name.rpartition(".")[0]
    return name or None


def top(name: str) -> str:
    return name.split(".")[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def inference_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module in sources():
        if top(module) != "inference":
            continue
        edges = graph.setdefault(module, set())
        for imp in imports(module):
            target = first_party(imp.module)
            if target is None or top(target) != "inference" or target == module:
                continue
            if imp.deliberate and (module, target) in DELIBERATE:
                continue
            if module.startswith(target + "."):
                continue  # the parent package, which Python runs first anyway
            edges.add(target)
    return graph


def test_nothing_below_inference_imports_it():
    found = [
        f"{module}:{imp.line} imports {imp.module}"
        for module in sources()
        if top(module) in ("models_registry", "memory", "logs")
        for imp in imports(module)
        if top(imp.module) == "inference"
    ]
    assert found == []


def test_memory_imports_no_django_even_through_another_module():
    seen: set[str] = set()
    todo = [module for module in sources() if top(module) == "memory"]
    found = []
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for imp in imports(module):
            if top(imp.module) in DJANGO:
                found.append(f"{module}:{imp.line} imports {imp.module}")
            target = first_party(imp.module)
            if target is not None:
                todo.append(target)
    assert found == [], f"memory reaches Django through {sorted(seen - {m for m in seen if top(m) == 'memory'})}"


def test_there_is_no_import_cycle_in_inference():
    assert cycles(inference_graph()) == []


def test_every_deliberate_cycle_edge_is_annotated_where_it_is_imported():
    annotated = {
        (module, first_party(imp.module))
        for module in sources()
        if top(module) == "inference"
        for imp in imports(module)
        if imp.deliberate
    }
    assert annotated == DELIBERATE


def test_the_web_process_imports_no_engine_and_no_worker_at_module_level():
    seen: set[str] = set()
    todo = list(WEB_ENTRY_POINTS)
    found = []
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for imp in imports(module):
            if imp.local or imp.typing_only:
                continue
            if top(imp.module) in ENGINE_LIBRARIES:
                found.append(f"{module}:{imp.line} imports {imp.module}")
            target = first_party(imp.module)
            if target is None:
                continue
            if target.startswith("inference.worker") or loads_an_engine(target):
                found.append(f"{module}:{imp.line} imports {target}")
            todo.append(target)
    assert found == []


def loads_an_engine(module: str) -> bool:
    """Whether the module imports an engine library anywhere (an engine backend: its heavy
    imports are inside it, and run when the worker uses it)."""
    return any(top(imp.module) in ENGINE_LIBRARIES for imp in imports(module))


def test_the_checks_see_the_imports_they_are_about():
    # A test that cannot fail is a defect: these edges exist, so the graph must hold them.
    graph = inference_graph()
    assert "inference.worker.tier_moves" in graph["inference.worker.core"]
    assert "inference.worker.runtime" in graph["inference.worker.tier_moves"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert any(imp.local for imp in imports("inference.transport.runtime"))  # the embedded worker, lazily
    assert loads_an_engine("inference.engines.llama") and not loads_an_engine("inference.transport.tools")


def package(module: str) -> str | None:
    """The package of the layout a module of `inference` lies in: a surface's name, `common`,
    `transport`, `jobs`, `worker`, `engines`; None for the Django app's own modules."""
    parts = module.split(".")
    if parts[:2] == ["inference", "web"]:
        return parts[2] if len(parts) > 2 else "web"
    if len(parts) > 1 and parts[1] in ("transport", "jobs", "worker", "engines", "management", "migrations"):
        return parts[1]
    return None


def crossings(importer: str, forbidden: set[str]) -> list[str]:
    """Every import (local and typing-only ones too) from a package named in `importer` into
    one of the `forbidden` packages."""
    found = []
    for module in sources():
        if top(module) != "inference" or package(module) != importer:
            continue
        for imp in imports(module):
            target = first_party(imp.module)
            if target is not None and top(target) == "inference" and package(target) in forbidden:
                found.append(f"{module}:{imp.line} imports {target}")
    return found


@pytest.mark.parametrize("surface", SURFACES)
def test_an_api_surface_imports_no_other_surface_no_worker_and_no_engine(surface):
    assert crossings(surface, {*SURFACES, "worker", "engines"} - {surface}) == []


def test_the_shared_web_package_imports_no_surface_no_worker_and_no_engine():
    assert crossings("common", {*SURFACES, "worker", "engines"}) == []


@pytest.mark.parametrize("side", ["transport", "jobs"])
def test_the_transport_and_the_jobs_import_nothing_of_the_web_packages(side):
    assert crossings(side, {*SURFACES, "common"}) == []


def test_no_module_but_the_django_apps_own_lies_directly_in_inference():
    loose = [m for m in sources() if top(m) == "inference" and package(m) is None and m not in APP_MODULES]
    assert loose == []


def test_the_layout_checks_see_the_packages_they_are_about():
    # Each surface has the same skeleton, and the checks above classify real modules.
    for surface in SURFACES:
        assert {f"inference.web.{surface}.{name}" for name in ("urls", "views", "protocol")} <= set(sources())
        assert any(m.startswith(f"inference.web.{surface}.serving") for m in sources())
    assert package("inference.web.ollama.serving") == "ollama" and package("inference.transport.wire") == "transport"
    assert crossings("ollama", {"common"}) != [] and crossings("openai", {"transport"}) != []
