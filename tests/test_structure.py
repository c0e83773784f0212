"""The package's shape (the developer's guide): imports run one way down the layers, with no circles, and no
file a student reads is over 300 lines. Read from the source with ast: function-level imports count too."""
import ast
import shutil
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "nanoserve"
RECORDS = {"nanoserve.config", "nanoserve.sampling_params", "nanoserve.structured_outputs",  # importable by all
           "nanoserve.outputs", "nanoserve.speculative_config", "nanoserve.beam_search_params"}
# Higher floors import lower ones, never the reverse.
FLOORS = {"utils": 0, "layers": 1, "models": 2, "engine": 3, "llm": 4, "async_llm": 4, "serving": 5, "tools": 5}


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor(module: str) -> int:
    if module in RECORDS:
        return 0
    parts = module.split(".")
    if len(parts) == 1:
        return 5  # the package itself: its __init__ exports the API
    assert parts[1] in FLOORS, f"{module}: a new top-level module; place it in FLOORS or RECORDS"
    return FLOORS[parts[1]]


def imports(root: Path = ROOT) -> dict[str, set[str]]:
    """Each nanoserve module -> the nanoserve modules it imports, anywhere in the file."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from package import module` imports the module
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str]:
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as error:
        return error.args[1]
    return []


def upward(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} -> {b}" for a, targets in graph.items() for b in targets if floor(b) > floor(a)]


def test_no_import_cycles():
    assert not cycle(imports()), " -> ".join(cycle(imports()))


def test_imports_go_down_the_layers():
    assert not upward(imports()), upward(imports())


def test_no_core_file_over_300_lines():
    core = [p for p in ROOT.rglob("*.py") if not {"serving", "tools"} & set(p.relative_to(ROOT).parts)]
    long = {str(p.relative_to(ROOT)): n for p in core if (n := len(p.read_text().splitlines())) > 300}
    assert core and not long, long


def test_the_checks_can_fail(tmp_path):
    """A circle (inside a function, as engine/workers.py once had one) and an upward import, planted in a copy
    of the package, are found."""
    copy = tmp_path / "nanoserve"
    shutil.copytree(ROOT, copy)
    with open(copy / "engine" / "sequence.py", "a") as f:
        f.write("\n\ndef request():\n    from nanoserve.engine.request import Request\n    return Request\n")
    with open(copy / "layers" / "sampler.py", "a") as f:
        f.write("\nfrom nanoserve.engine.detokenizer import IncrementalDetokenizer  # noqa\n")
    graph = imports(copy)
    assert {"nanoserve.engine.sequence", "nanoserve.engine.request"} <= set(cycle(graph))
    assert "nanoserve.layers.sampler -> nanoserve.engine.detokenizer" in upward(graph)
