"""The package's shape (the developer's guide): imports run one way down the layers, with no circles; the core
never imports a feature (chapters subclass the core's classes); no file in nanoserve/ is over 400 lines
(nano-vllm's model_runner.py holds the step's inputs, the model runner and its CUDA graphs in 251; ours, the
inputs with the sampling metadata, the runner and the executor), nor over 350 non-blank lines. Read from the
source with ast: function-level imports count too."""
import ast
import shutil
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "nanoserve"
RECORDS = {"nanoserve.config", "nanoserve.sampling_params", "nanoserve.structured_outputs",  # importable by all
           "nanoserve.outputs", "nanoserve.speculative_config", "nanoserve.beam_search_params",
           "nanoserve.lora_request", "nanoserve.kv_transfer_config", "nanoserve.chapter_configs"}
# Higher floors import lower ones, never the reverse. The core is floors 0-4; the features (chapters) stand on it
# at 5; chapters.py, which plugs them in, above them; then what is built on the whole engine.
FLOORS = {"utils": 0, "layers": 1, "models": 2, "engine": 3, "llm": 4, "async_llm": 4,
          "spec_decode": 5, "beam_search": 5, "structured_output": 5, "step_records": 5, "parallel": 5,
          "kv_offload": 5, "host_kv_pool": 5, "lora": 5, "scheduling": 5, "persistent_batch": 5, "logprobs": 5,
          "kv_transfer": 5, "sliding_window": 5,
          "chapters": 6, "serving": 7, "tools": 7}
CORE = {"utils", "layers", "models", "engine", "llm", "async_llm"}


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor(module: str) -> int:
    if module in RECORDS:
        return 0
    parts = module.split(".")
    if len(parts) == 1:
        return 7  # the package itself: its __init__ exports the API
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


def is_core(module: str) -> bool:
    parts = module.split(".")
    return len(parts) > 1 and parts[1] in CORE


def core_to_feature(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a core module into anything but the core and the parameter records."""
    return [f"{a} -> {b}" for a, targets in graph.items() if is_core(a)
            for b in targets if not is_core(b) and b not in RECORDS]


def test_the_core_never_imports_a_feature():
    assert not core_to_feature(imports()), core_to_feature(imports())


def test_no_import_cycles():
    assert not cycle(imports()), " -> ".join(cycle(imports()))


def test_imports_go_down_the_layers():
    assert not upward(imports()), upward(imports())


def test_no_core_file_over_400_lines():
    core = [p for p in ROOT.rglob("*.py") if not {"serving", "tools"} & set(p.relative_to(ROOT).parts)]
    long = {str(p.relative_to(ROOT)): n for p in core if (n := len(p.read_text().splitlines())) > 400}
    assert core and not long, long


def non_blank_lines(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.strip())


def long_files(root: Path = ROOT, limit: int = 350) -> dict[str, int]:
    """Every .py file under root with more than `limit` non-blank lines -> how many it has."""
    return {str(p.relative_to(root)): n for p in root.rglob("*.py") if (n := non_blank_lines(p.read_text())) > limit}


def test_no_file_over_350_non_blank_lines():
    assert not long_files(), long_files()


def test_the_line_check_can_fail(tmp_path):
    """351 non-blank lines are one too many; 350, however many blank (or all-space) lines lie between, are not."""
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "long.py").write_text("x = 1\n\n" * 351)
    (tmp_path / "short.py").write_text("x = 1\n    \n\n" * 350)
    assert long_files(tmp_path) == {"tools/long.py": 351}


def test_the_checks_can_fail(tmp_path):
    """A circle (inside a function, as engine/workers.py once had one) and an upward import, planted in a copy
    of the package, are found."""
    copy = tmp_path / "nanoserve"
    shutil.copytree(ROOT, copy)
    with open(copy / "engine" / "sequence.py", "a") as f:
        f.write("\n\ndef scheduler():\n    from nanoserve.engine.scheduler import Scheduler\n    return Scheduler\n")
    with open(copy / "engine" / "scheduler.py", "a") as f:  # a feature import, deep inside a function
        f.write("\n\ndef drafts():\n    from nanoserve.spec_decode.proposer import propose_drafts\n"
                "    return propose_drafts\n")
    with open(copy / "layers" / "sampler.py", "a") as f:
        f.write("\nfrom nanoserve.engine.output_processor import EngineCoreOutput  # noqa\n")
    graph = imports(copy)
    assert {"nanoserve.engine.sequence", "nanoserve.engine.scheduler"} <= set(cycle(graph))
    assert "nanoserve.layers.sampler -> nanoserve.engine.output_processor" in upward(graph)
    assert core_to_feature(graph) == ["nanoserve.engine.scheduler -> nanoserve.spec_decode.proposer"]
