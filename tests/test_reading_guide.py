"""The reading guide cannot drift: a plain greedy LLM.generate on the demo model, with default options, runs code
in exactly the files the README's first part ("The core, in request order") lists, in its table's order (the order
the request first enters them), no feature file among them. The table's counts are
`python -m nanoserve.tools.reading_guide`'s output; tests check names and order, never hand-written numbers."""
import re

import pytest
from test_structure import floor

from nanoserve import LLM, SamplingParams
from nanoserve.tools.reading_guide import (
    REPO,
    decode_step_files,
    files_run,
    non_blank_lines,
    plain_request_files,
    table,
)

# The core's ceiling (the README's opening states it). Its budget is 1,600 lines: wrapped at 100 columns the core's
# code is about 1,700.
MAX_FILES, MAX_LINES, MAX_COLUMNS, MAX_DECODE_FILES = 16, 1800, 100, 10


def core_part(readme: str) -> str:
    return readme.split("### The core, in request order", 1)[1].split("\n### ", 1)[0]


def guide_table_files(readme: str) -> list[str]:
    """The files of the core part's table, in its order."""
    return re.findall(r"^\| \d+ \| `(nanoserve/[\w/]+\.py)` \|", core_part(readme), re.M)


def guide_core_files() -> set[str]:
    """The .py files the README's reading guide names in its first part (its table and the walk through it)."""
    return set(re.findall(r"`(nanoserve/[\w/]+\.py)`", core_part((REPO / "README.md").read_text())))


def test_a_plain_request_runs_the_guides_core_files_in_order_and_no_feature(converted):
    ran = plain_request_files(str(converted[1]))
    features = {f for f in ran if floor(f.removesuffix(".py").replace("/", ".")) >= 5}  # chapters and above
    assert not features, features
    listed = guide_table_files((REPO / "README.md").read_text())
    assert ran == listed, (ran, listed)
    assert guide_core_files() == set(ran), guide_core_files() ^ set(ran)  # the walk-through names no other file
    assert len(ran) <= MAX_FILES
    assert sum(map(non_blank_lines, ran)) <= MAX_LINES
    too_long = [f"{f}:{i}" for f in ran for i, line in enumerate((REPO / f).read_text().splitlines(), 1)
                if len(line) > MAX_COLUMNS]
    assert not too_long, too_long


def test_one_decode_step_runs_at_most_ten_core_files(converted):
    """engine.step() after the prefill: the files a student follows to read one decode step."""
    ran = decode_step_files(str(converted[1]))
    assert len(ran) <= MAX_DECODE_FILES, ran
    assert set(ran) <= set(plain_request_files(str(converted[1]))), ran


def test_the_table_is_the_tools_output_but_for_its_counts():
    """The README's table has the tool's shape (a row per file, then the total), whatever today's numbers."""
    readme = (REPO / "README.md").read_text()
    files = guide_table_files(readme)
    def shape(text: str) -> str:
        return re.sub(r"\d[\d,]*", "N", text)

    assert shape(table(files)) in shape(core_part(readme))


def test_the_order_check_can_fail():
    readme = "### The core, in request order\n\n| 1 | `nanoserve/b.py` | 3 |\n| 2 | `nanoserve/a.py` | 4 |\n"
    assert guide_table_files(readme) == ["nanoserve/b.py", "nanoserve/a.py"] != ["nanoserve/a.py", "nanoserve/b.py"]


def test_the_readme_states_the_budget_the_trace_checks():
    """The README's opening and the guide's intro state the core's ceiling (at most 16 files, 1,800 lines) that the
    trace above checks, not today's counts."""
    readme = (REPO / "README.md").read_text()
    opening = readme.split("## Quick start")[0]
    stated = re.search(r"runs at most ([\d,]+) lines in at most (\d+) files", opening)
    assert stated, "the README's opening no longer states the budget"
    assert (int(stated[1].replace(",", "")), int(stated[2])) == (MAX_LINES, MAX_FILES)
    assert f"at most {MAX_FILES} files and {MAX_LINES:,} lines" in readme.split("### The core, in request order")[0]


# The designs that left the core (issue: the first read at nano size), each with an option that plugs it in: a plain
# request runs none of their files (above); with the option on, they run.
CHAPTERS = [
    (dict(preemption_mode="swap"), "nanoserve/scheduling/swap.py"),
    (dict(scheduling_policy="priority"), "nanoserve/scheduling/priority.py"),
    (dict(async_scheduling=True), "nanoserve/scheduling/async_scheduling.py"),
    (dict(async_scheduling=True), "nanoserve/persistent_batch.py"),
    # the chapters a request asks for are switched on by the config too (nanoserve serve turns them on)
    (dict(max_logprobs=1), "nanoserve/logprobs.py"),
    (dict(enable_beam_search=True), "nanoserve/beam_search/scheduler.py"),
]


@pytest.mark.parametrize("options,chapter", CHAPTERS)
def test_a_chapter_runs_when_its_option_is_on(tiny_models, options, chapter):
    llm = LLM(tiny_models["qwen3"], num_kvcache_blocks=64, **options)
    ran = files_run(lambda: llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False))
    assert chapter in ran and chapter not in guide_core_files()


def test_the_check_can_fail(converted):
    """A chapter's code run by a plain engine's step shows up in the trace."""
    from nanoserve.spec_decode.proposer import propose_drafts
    from nanoserve.speculative_config import SpeculativeConfig

    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_max": 2})
    llm = LLM(str(converted[1]))
    step = llm.engine.step
    llm.engine.step = lambda: propose_drafts([], spec) or step()
    ran = files_run(lambda: llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False))
    assert "nanoserve/spec_decode/proposer.py" in ran and set(ran) != guide_core_files()


def test_the_side_by_side_names_the_traced_files(converted):
    """docs/nano_vllm.md's nanoserve column names exactly the traced core's files, and its total row their
    number and the budget."""
    doc = (REPO / "docs" / "nano_vllm.md").read_text().splitlines()
    rows = [line.split("|") for line in doc if line.startswith("| ") and "`nanoserve/" in line]
    named = [path for row in rows for path in re.findall(r"`(nanoserve/[\w/]+\.py)`", row[4])]
    ran = plain_request_files(str(converted[1]))
    assert sorted(named) == sorted(ran), set(named) ^ set(ran)
    total = next(line for line in doc if line.startswith("| in all")).split("|")[4]
    assert f"{len(ran)} files, at most {MAX_LINES:,} lines" in total, total


def chapter_pages(readme: str) -> dict[str, tuple[list[tuple[str, str]], list[str], list[str]]]:
    """README's chapter pages (#### headings after "### The chapters"): title -> (the subclasses it names, each
    with the core class it subclasses; the files its "Files:" sentence names)."""
    part = readme.split("### The chapters", 1)[1].split("\n## ", 1)[0]
    pages = {}
    for page in part.split("\n#### ")[1:]:
        title, body = page.split("\n", 1)
        subclasses = re.search(r"Subclasses: (.*?)\. Files:", body, re.S)
        files = re.search(r"Files:\s(.*?)\.(?:\n|$)", body, re.S)
        if subclasses and files:
            pages[title] = (re.findall(r"`(\w+)` of `(\w+)`", subclasses[1]),
                            re.findall(r"`(nanoserve/[\w/]+\.py)`", files[1]))
    return pages


def test_each_chapter_page_names_real_subclasses_and_its_files():
    pages = chapter_pages((REPO / "README.md").read_text())
    assert len(pages) >= 10
    for title, (subclasses, files) in pages.items():
        assert subclasses, title
        assert files and all((REPO / f).is_file() for f in files), (title, files)
        code = "".join((REPO / f).read_text() for f in files)
        for subclass, base in subclasses:  # defined in the chapter's files, as a subclass of that core class
            assert re.search(rf"^class {subclass}\([^)]*\b{base}\b", code, re.M), (title, subclass, base)
        assert not set(files) & guide_core_files(), title  # a chapter's files are none of the core's


def test_the_page_check_can_fail():
    page = ("### The chapters\n\n#### X\n\nSubclasses: `Y` of `Z`. Files: "
            "`nanoserve/llm.py`,\n`nanoserve/no_such.py` (a note).\nWhat it does, `nanoserve/other.py`.\n")
    assert chapter_pages(page) == {"X": ([("Y", "Z")], ["nanoserve/llm.py", "nanoserve/no_such.py"])}
