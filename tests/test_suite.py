"""The test suite's own rules: an optional part that is missing skips its tests, with the reason, and never fails
them; a skip mark sits on a test or a module's `pytestmark`, where pytest reads it (on a fixture it is ignored)."""
import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


def is_mark(node: ast.expr, mark_names: set[str]) -> bool:
    """`@pytest.mark.x(...)`, `@pytest.mark.x`, or a name bound to a mark at module level (`needs_browser`)."""
    node = node.func if isinstance(node, ast.Call) else node
    if isinstance(node, ast.Name):
        return node.id in mark_names
    return "pytest.mark." in ast.unparse(node) + "."


def test_skip_marks_sit_on_tests_never_on_fixtures_or_helpers():
    misplaced = []
    for path in sorted(TESTS.glob("*.py")):
        tree = ast.parse(path.read_text())
        mark_names = {target.id for node in tree.body if isinstance(node, ast.Assign) and is_mark(node.value, set())
                      for target in node.targets if isinstance(target, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("test_"):
                misplaced += [f"{path.name}:{node.lineno} {node.name}" for d in node.decorator_list
                              if is_mark(d, mark_names)]
    assert misplaced == []


def browser_tests() -> list[str]:
    """tests/test_dashboard.py's tests that open Chromium: those that name the browser or the page helper."""
    tree = ast.parse((TESTS / "test_dashboard.py").read_text())
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
            and {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & {"BROWSER", "page_fed"}]


def test_without_chromium_every_browser_test_is_skipped_with_its_reason():
    names = browser_tests()
    assert "test_page_shows_beams_forking" in names and len(names) >= 6
    path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep)
                           if not (Path(d) / "chromium").exists())  # (python runs by its full path)
    env = {**os.environ, "PATH": path}
    assert shutil.which("chromium", path=path) is None
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "-q",
                           *(f"tests/test_dashboard.py::{name}" for name in names)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    summary = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(rf"{len(names)} skipped in .*", summary), done.stdout[-3000:]
    assert done.stdout.count("no browser: `apt-get install chromium`") == len(names)
