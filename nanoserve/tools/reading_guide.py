"""The reading guide's core table, generated: the files a plain greedy request runs, in the order
the request first enters them, with their non-blank lines. README.md's table under "The core, in
request order" is this tool's output (`python -m nanoserve.tools.reading_guide`);
tests/test_reading_guide.py traces a request and checks the README's files and their order, so a
core edit changes no prose, only this table's numbers.
"""
import sys
import threading
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def files_run(fn: Callable[[], object]) -> list[str]:
    """Every nanoserve .py file that runs a line while fn() runs, in any thread, in the order the
    run first enters each (repo-relative paths). This file is left out: fn may be a lambda in it."""
    root, seen = str(REPO / "nanoserve"), {}

    def tracer(frame, event, arg):
        path = frame.f_code.co_filename
        if not path.startswith(root) or path == __file__:
            return None
        seen.setdefault(str(Path(path).relative_to(REPO)), None)
        return tracer

    sys.settrace(tracer)
    threading.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
        threading.settrace(None)
    return list(seen)


def plain_request_files(model: str | None = None) -> list[str]:
    """The files a plain greedy LLM.generate runs with default options (the demo model if none is
    given), in request order. Building the LLM is not traced: the core is what a request runs."""
    from nanoserve import LLM, SamplingParams

    llm = LLM(model)
    prompts = ["Hello, my name is", "The capital of France is"]
    return files_run(lambda: llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8),
                                          use_tqdm=False))


def decode_step_files(model: str | None = None) -> list[str]:
    """The files one decode step of a plain greedy request runs: `engine.step()` after its
    prefill."""
    from nanoserve import LLM, SamplingParams

    engine = LLM(model).engine
    prompt = engine.tokenizer.encode("Hello, my name is")
    engine.add_request("0", prompt, SamplingParams(temperature=0.0, max_tokens=8))
    engine.step()  # the prefill
    return files_run(engine.step)


def non_blank_lines(path: str) -> int:
    return sum(1 for line in (REPO / path).read_text().splitlines() if line.strip())


def table(files: list[str]) -> str:
    """The Markdown table: one row per file in request order, then the total."""
    rows = ["| # | file | non-blank lines |", "| --- | --- | --- |"]
    rows += [f"| {i} | `{f}` | {non_blank_lines(f)} |" for i, f in enumerate(files, 1)]
    rows.append(f"| | in all: {len(files)} files | {sum(map(non_blank_lines, files)):,} |")
    return "\n".join(rows)


if __name__ == "__main__":
    model = sys.argv[1] if len(sys.argv) > 1 else None
    print(table(plain_request_files(model)))
    decode = decode_step_files(model)
    print(f"\nOne decode step runs {len(decode)} files: " + ", ".join(f"`{f}`" for f in decode))
