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
    "inference.urls",
    "inference.views",
    "inference.realtime",
    "inference.lemonade_urls",
    "logs.urls",
)
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
    assert any(imp.local for imp in imports("inference.runtime"))  # the embedded worker, lazily
    assert loads_an_engine("inference.engines.llama") and not loads_an_engine("inference.engines.tools")
