"""The step trace (LLM(..., trace=True)) and nanoserve/tools/trace.py: the records agree with llm.stats and with
the live engine after every step, each scenario keeps the invariants and writes its table and pictures, and the
articles' 3/5/12 example comes out step for step."""
import shutil
import subprocess
from pathlib import Path

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.tools.trace import (
    DEFAULT_OUT,
    SCENARIOS,
    format_trace,
    main,
    plot_kv,
    plot_timeline,
    request_states,
    run_scenario,
)


def check_step(llm: LLM) -> None:
    """After each step, its record against the engine itself."""
    rec, scheduler, bm = llm.trace[-1], llm.engine.scheduler, llm.engine.block_manager
    assert rec.step == len(llm.trace) - 1
    assert rec.num_scheduled_tokens == sum(r.num_tokens for r in rec.scheduled) <= rec.token_budget
    assert all(r.num_tokens >= 1 for r in rec.scheduled)
    assert len({r.seq_id for r in rec.scheduled}) == len(rec.scheduled)
    assert all(rec.seq_requests[r.seq_id] == (r.request_id, 0) for r in rec.scheduled)  # (n = 1 here)
    for ids, queue in ((rec.waiting, scheduler.waiting), (rec.running, scheduler.running),
                       (rec.swapped, scheduler.swapped)):
        assert ids == [seq.seq_id for seq in queue]
    held = {block for seq in scheduler.running for block in seq.block_table}  # prefix blocks are shared
    assert rec.num_used_blocks == len(held) == bm.num_blocks - rec.num_free_blocks
    assert 0 <= rec.num_cached_blocks <= rec.num_free_blocks


def check_states(trace) -> None:
    """Every request that has arrived is in exactly one place in each step, and never vanishes."""
    finished, seen = set(), set()
    for rec in trace:
        finished |= set(rec.finished)
        places = [*rec.waiting, *rec.running, *rec.swapped, *finished]
        assert len(places) == len(set(places)) and seen <= set(places)
        seen = set(places)
        assert {r.seq_id for r in rec.scheduled} <= set(rec.running) | set(rec.finished)
        assert set(rec.recomputed) <= set(rec.waiting) | set(rec.running)  # re-admitted in the same step is fine
        assert set(rec.swapped_out) <= set(rec.swapped)
    states = request_states(trace)
    assert set(states) == seen and all(len(row) == len(trace) for row in states.values())


def check_stats(trace, stats) -> None:
    assert len(trace) == stats.num_steps
    assert sum(len(r.recomputed) + len(r.swapped_out) for r in trace) == stats.num_preemptions
    assert sum(len(r.swapped_out) for r in trace) == stats.num_swapped_out
    assert sum(len(r.swapped_in) for r in trace) == stats.num_swapped_in
    assert sum(r.sampled for rec in trace for r in rec.scheduled) == stats.num_generated_tokens
    assert sum(not r.sampled for rec in trace for r in rec.scheduled) == stats.num_chunked_prefills
    assert sum(rec.kind in ("prefill", "mixed") for rec in trace) == stats.num_prefill_steps
    assert sum(rec.kind == "mixed" for rec in trace) == stats.num_mixed_steps
    # A request admitted from waiting starts where its cached prefix ends.
    cached, running = 0, set()
    for rec in trace:
        cached += sum(r.start for r in rec.scheduled if r.seq_id not in running | set(rec.swapped_in))
        running = set(rec.running)
    assert cached == stats.num_cached_tokens


@pytest.fixture(scope="module")
def scenario_runs(tiny_models):
    return {name: run_scenario(name, tiny_models["qwen3"], on_step=check_step)[0] for name in SCENARIOS}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_trace_keeps_invariants_and_agrees_with_stats(scenario_runs, name):
    llm = scenario_runs[name]
    check_states(llm.trace)
    check_stats(llm.trace, llm.stats)


def test_scenarios_show_what_they_are_for(scenario_runs):
    stats = {name: llm.stats for name, llm in scenario_runs.items()}
    assert stats["default"].num_preemptions >= 2 and stats["default"].num_swapped_out == 0
    assert stats["chunked"].num_chunked_prefills >= 4 and stats["chunked"].num_mixed_steps >= 4
    assert stats["priority"].num_priority_preemptions == 1
    assert stats["swap"].num_swapped_out >= 2 and stats["swap"].num_swapped_in == stats["swap"].num_swapped_out
    assert stats["prefix"].num_cached_tokens >= 4 * 16


def test_article_example_table(tiny_models):
    """Budget 10, prompts of 3, 5 and 12 tokens: the table of docs/scheduling.md and the article, exactly."""
    llm = LLM(tiny_models["qwen3"], trace=True, enable_chunked_prefill=True, max_num_batched_tokens=10,
              block_size=4, num_kvcache_blocks=16, max_model_len=64)
    prompts = [[10 + 20 * i + j for j in range(n)] for i, n in enumerate((3, 5, 12))]
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=m) for m in (4, 4, 2)]
    llm.generate(prompts, params, use_tqdm=False)
    table = format_trace(llm.trace, {0: "R1", 1: "R2", 2: "R3"}).splitlines()
    assert [line.rsplit(maxsplit=1)[0] for line in table] == [  # all but the ms column
        "step  kind     batch                           events                      w/r/s     blocks u/c/f  "
        "tokens/budget",
        "   0  prefill  R1:3 R2:5 R3:2*                                             0/3/0     6/0/10        10/10",
        "   1  mixed    R1:1 R2:1 R3:8*                                             0/3/0     6/0/10        10/10",
        "   2  mixed    R1:1 R2:1 R3:2                                              0/3/0     7/0/9         4/10",
        "   3  decode   R1:1 R2:1 R3:1                  R1 R2 R3 finished           0/0/0     0/6/16        3/10",
    ]
    check_stats(llm.trace, llm.stats)


def test_trace_is_off_by_default_and_spans_generate_calls(tiny_models):
    assert LLM(tiny_models["qwen3"], num_kvcache_blocks=8, block_size=4).trace is None
    llm = LLM(tiny_models["qwen3"], num_kvcache_blocks=8, block_size=4, trace=True)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=3)
    llm.generate([[5, 6, 7]], params, use_tqdm=False)
    llm.generate([[5, 6, 7, 8, 9]], params, use_tqdm=False)  # hits the first prompt's... nothing: 4-token blocks
    assert [rec.step for rec in llm.trace] == list(range(6)) == list(range(llm.stats.num_steps))
    assert all(a.time < b.time for a, b in zip(llm.trace, llm.trace[1:]))


def png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        header = f.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_pictures_of_every_scenario(scenario_runs, tmp_path, name):
    trace = scenario_runs[name].trace
    plot_timeline(trace, tmp_path / "timeline.png")
    plot_kv(trace, tmp_path / "kv.png")
    width, height = png_size(tmp_path / "timeline.png")  # 100 dpi; 0.35 inch a step, 0.4 a request
    assert (width, height) == (max(750, 300 + 35 * len(trace)), 220 + 40 * len(request_states(trace)))
    assert png_size(tmp_path / "kv.png") == (500 + 35 * len(trace), 520)
    for picture in ("timeline", "kv"):  # not blank, and small enough to commit
        assert 10_000 < (tmp_path / f"{picture}.png").stat().st_size < 100_000


def test_command_writes_table_and_pictures(tiny_models, tmp_path, capsys):
    main(["--scenario", "chunked", "--model", tiny_models["qwen3"], "--out", str(tmp_path)])
    table = (tmp_path / "chunked.txt").read_text()
    assert table.splitlines()[1].startswith("   0  prefill  R1:3 R2:5 R3:2*") and len(table.splitlines()) == 13
    assert table in capsys.readouterr().out
    assert all(png_size(tmp_path / f"chunked_{picture}.png") for picture in ("timeline", "kv"))


def test_default_out_folder_is_ignored_by_git(tiny_models, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main(["--scenario", "chunked", "--model", tiny_models["qwen3"]])
    written = sorted(p.name for p in (tmp_path / DEFAULT_OUT).iterdir())
    assert written == ["chunked.txt", "chunked_kv.png", "chunked_timeline.png"]
    root = Path(__file__).resolve().parent.parent
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    for name in written:  # run in the repository, it would leave nothing for `git status` to show
        assert subprocess.run(["git", "check-ignore", "-q", f"{DEFAULT_OUT}/{name}"], cwd=root).returncode == 0


def test_trace_under_async_scheduling(tiny_models):
    """With the batch queue a record is taken when its step's output comes in, after the next step was planned
    (its queues may already show that plan's preemptions), and a step may sample a token for a request that
    finished while it was in flight (the token is dropped): still one record per step, agreeing with stats."""
    llm = LLM(tiny_models["qwen3"], trace=True, async_scheduling=True, num_kvcache_blocks=6, block_size=4,
              enable_chunked_prefill=True, max_num_batched_tokens=10, max_model_len=64)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=6)
    llm.generate([[10 + 20 * i + j for j in range(n)] for i, n in enumerate((3, 5, 12))], params, use_tqdm=False)
    trace, stats = llm.trace, llm.stats
    assert len(trace) == stats.num_steps and stats.num_preemptions > 0
    assert sum(len(r.recomputed) + len(r.swapped_out) for r in trace) == stats.num_preemptions
    assert sum(not r.sampled for rec in trace for r in rec.scheduled) == stats.num_chunked_prefills
    assert sum(r.sampled for rec in trace for r in rec.scheduled) >= stats.num_generated_tokens == 18
    assert sorted(i for rec in trace for i in rec.finished) == [0, 1, 2]
    assert all(len(row) == len(llm.trace) for row in request_states(llm.trace).values())
