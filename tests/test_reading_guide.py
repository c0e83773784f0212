"""The reading guide cannot drift: a plain greedy LLM.generate on the demo model, with default options, runs code
in exactly the files the README's first part ("The core, in request order") lists, no feature file among them."""
import re
import sys
import threading
from pathlib import Path

import pytest
from test_structure import floor

from nanoserve import LLM, SamplingParams

REPO = Path(__file__).resolve().parent.parent


def guide_core_files() -> set[str]:
    """The .py files the README's reading guide lists in its first part."""
    readme = (REPO / "README.md").read_text()
    part = readme.split("### The core, in request order", 1)[1].split("\n### ", 1)[0]
    return set(re.findall(r"`(nanoserve/[\w/]+\.py)`", part))


def files_run(fn) -> set[str]:
    """Every nanoserve .py file that runs a line while fn() runs, in any thread (repo-relative paths)."""
    root, seen = str(REPO / "nanoserve"), set()

    def tracer(frame, event, arg):
        path = frame.f_code.co_filename
        if not path.startswith(root):
            return None
        seen.add(str(Path(path).relative_to(REPO)))
        return tracer

    sys.settrace(tracer)
    threading.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
        threading.settrace(None)
    return seen


def test_a_plain_request_runs_the_guides_core_files_and_no_feature(converted):
    llm = LLM(str(converted[1]))
    ran = files_run(lambda: llm.generate(["Hello, my name is", "The capital of France is"],
                                         SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False))
    features = {f for f in ran if floor(f.removesuffix(".py").replace("/", ".")) >= 5}  # chapters and above
    assert not features, features
    assert ran == guide_core_files(), (ran - guide_core_files(), guide_core_files() - ran)
    assert len(ran) <= 16
    assert sum(sum(1 for line in (REPO / f).read_text().splitlines() if line.strip()) for f in ran) <= 1500


# The designs that left the core (issue: the first read at nano size), each with an option that plugs it in: a plain
# request runs none of their files (above); with the option on, they run.
CHAPTERS = [
    (dict(preemption_mode="swap"), "nanoserve/scheduling/swap.py"),
    (dict(scheduling_policy="priority"), "nanoserve/scheduling/priority.py"),
    (dict(async_scheduling=True), "nanoserve/scheduling/async_scheduling.py"),
    (dict(async_scheduling=True), "nanoserve/persistent_batch.py"),
]


@pytest.mark.parametrize("options,chapter", CHAPTERS)
def test_a_chapter_runs_when_its_option_is_on(tiny_models, options, chapter):
    llm = LLM(tiny_models["qwen3"], num_kvcache_blocks=64, **options)
    ran = files_run(lambda: llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False))
    assert chapter in ran and chapter not in guide_core_files()


def test_the_check_can_fail(converted):
    """A feature plugged into a plain engine's after_step seam shows up in the trace."""
    from nanoserve.spec_decode.proposer import propose_drafts
    from nanoserve.speculative_config import SpeculativeConfig

    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_max": 2})
    llm = LLM(str(converted[1]))
    llm.engine.seams.after_step.append(lambda out, updated: propose_drafts([], spec))
    ran = files_run(lambda: llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False))
    assert "nanoserve/spec_decode/proposer.py" in ran and ran != guide_core_files()


def test_the_side_by_side_counts_are_the_files(converted):
    """docs/nano_vllm.md's nanoserve column: each row's line counts are its files' non-blank lines, and the total
    is the traced core's."""
    def count(path: str) -> int:
        return sum(1 for line in (REPO / path).read_text().splitlines() if line.strip())

    rows = [line.split("|") for line in (REPO / "docs" / "nano_vllm.md").read_text().splitlines()
            if line.startswith("| ") and "`nanoserve/" in line]
    for row in rows:
        paths, counts = re.findall(r"`(nanoserve/[\w/]+\.py)`", row[4]), re.findall(r"\d+", row[5])
        assert list(map(int, counts)) == list(map(count, paths)), row
    total = next(line for line in (REPO / "docs" / "nano_vllm.md").read_text().splitlines()
                 if line.startswith("| in all"))
    assert int(total.split("|")[5].strip().replace(",", "")) == sum(map(count, guide_core_files()))


def test_the_readmes_sizes_are_the_files():
    """The README's opening sizes ("about 2,400 lines in 20 files", "about 5,400 ... and 7,900 ...") are the guide's
    core, the package without serving/ and tools/, and the whole package, to the nearest hundred."""
    def count(path: Path) -> int:
        return sum(1 for line in path.read_text().splitlines() if line.strip())

    package = list((REPO / "nanoserve").rglob("*.py"))
    features = [p for p in package if p.relative_to(REPO / "nanoserve").parts[0] not in ("serving", "tools")]
    actual = [sum(count(REPO / f) for f in guide_core_files()), sum(map(count, features)), sum(map(count, package))]
    opening = (REPO / "README.md").read_text().split("## Quick start")[0]
    stated = re.search(r"runs about ([\d,]+) lines in (\d+) files.*?about ([\d,]+) lines with them and ([\d,]+) with",
                       opening, re.S)
    assert stated, "the README's opening no longer states the sizes"
    assert int(stated[2]) == len(guide_core_files())
    assert [int(stated[i].replace(",", "")) for i in (1, 3, 4)] == [round(n, -2) for n in actual], actual


def chapter_pages(readme: str) -> dict[str, tuple[list[str], list[str], int]]:
    """README's chapter pages (#### headings after "### The seams, and the chapters"): title -> (the seams it names,
    its files (those given with a line count), the total it states)."""
    part = readme.split("### The seams, and the chapters", 1)[1].split("\n## ", 1)[0]
    pages = {}
    for page in part.split("\n#### ")[1:]:
        title, body = page.split("\n", 1)
        seams = re.search(r"Seams: (.*?)\. Files:", body, re.S)
        total = re.search(r"In all: ([\d,]+) lines", body)
        if seams and total:
            pages[title] = (re.findall(r"`(\w+)`", seams[1]), re.findall(r"`(nanoserve/[\w/]+\.py)` \(\d+\)", body),
                            int(total[1].replace(",", "")))
    return pages


def test_each_chapter_page_names_real_seams_its_files_and_their_total():
    from dataclasses import fields

    from nanoserve.engine.seams import Seams

    pages = chapter_pages((REPO / "README.md").read_text())
    assert len(pages) >= 10
    seam_names = {f.name for f in fields(Seams)}
    plugging = (REPO / "nanoserve" / "chapters.py").read_text()
    for title, (seams, files, total) in pages.items():
        assert seams and set(seams) <= seam_names, (title, set(seams) - seam_names)
        code = plugging + "".join((REPO / f).read_text() for f in files)
        assert all(name in code for name in seams), (title, [name for name in seams if name not in code])
        lines = sum(sum(1 for line in (REPO / f).read_text().splitlines() if line.strip()) for f in files)
        assert lines == total, (title, lines, total)
        assert not set(files) & guide_core_files(), title  # a chapter's files are none of the core's


def test_the_page_check_can_fail():
    page = ("### The seams, and the chapters\n\n#### X\n\nSeams: `no_such_seam`. Files: `nanoserve/llm.py` (1). "
            "In all: 1 lines.\n")
    assert chapter_pages(page) == {"X": (["no_such_seam"], ["nanoserve/llm.py"], 1)}
