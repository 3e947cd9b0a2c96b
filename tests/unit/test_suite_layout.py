"""Rules of the suite itself: every end-to-end module carries the e2e marker, so
`pytest -m "not e2e"` really leaves out everything that starts processes."""

from __future__ import annotations

import ast
from pathlib import Path

E2E = Path(__file__).resolve().parents[1] / "e2e"


def _marks_e2e(source: str) -> bool:
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            return "e2e" in ast.unparse(node.value)
    return False


def test_every_e2e_module_is_marked() -> None:
    modules = sorted(E2E.glob("test_*.py"))
    assert modules
    unmarked = [m.name for m in modules if not _marks_e2e(m.read_text())]
    assert unmarked == []
