"""The step trace (LLM(..., trace=True)) and nanoserve/tools/ trace.py, step_table.py and trace_pictures.py: the
records agree with llm.stats and with the live engine after every step, each scenario keeps the invariants and
writes its table and pictures, and the articles' 3/5/12 example comes out step for step."""
import shutil
import subprocess
from pathlib import Path

import pytest
from matplotlib.image import imread
from test_lora import make_adapter
from test_speculative_decoding import repetitive_prompts

from nanoserve import LLM, LoRARequest, SamplingParams
from nanoserve.beam_search_params import BeamSearchParams
from nanoserve.step_records import StepReader
from nanoserve.tools.step_table import adapter_names, default_names, format_trace, request_states
from nanoserve.tools.trace import DEFAULT_OUT, SCENARIOS, main, run_scenario
from nanoserve.tools.trace_pictures import LORA_COLOURS, plot_adapters, plot_kv, plot_timeline


def check_step(llm: LLM) -> None:
    """After each step, its record against the engine itself."""
    rec, scheduler, bm = llm.trace[-1], llm.engine.scheduler, llm.engine.block_manager
    assert rec.step == len(llm.trace) - 1
    assert rec.num_scheduled_tokens == sum(r.num_tokens for r in rec.scheduled) <= rec.token_budget
    assert all(r.num_tokens >= 1 for r in rec.scheduled)
    assert len({r.seq_id for r in rec.scheduled}) == len(rec.scheduled)
    assert all(rec.seq_requests[r.seq_id] == (r.request_id, 0) for r in rec.scheduled)  # (n = 1 here)
    for ids, queue in ((rec.waiting, scheduler.waiting), (rec.running, scheduler.running),
                       (rec.swapped, getattr(scheduler, "swapped", []))):
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
    # A step samples one token per sequence, and with speculative decoding the drafts it accepted too.
    assert sum(r.sampled + r.num_accepted_tokens for rec in trace for r in rec.scheduled) == stats.num_generated_tokens
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
    # The last column is the time since the step before, not the step's own time: its header says so.
    assert table[0].endswith("tokens/budget  ms since prev")
    table[0] = table[0].removesuffix("ms since prev") + "-"
    assert [line.rsplit(maxsplit=1)[0] for line in table] == [  # all but the ms since prev column
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


# ---- speculative decoding and beam search in the records ----------------------------------------------------
@pytest.mark.parametrize("scheduling", [
    dict(num_kvcache_blocks=64),
    # a token budget that trims drafts and mixes them with prompt chunks; a pool that forces preemptions
    dict(num_kvcache_blocks=24, enable_chunked_prefill=True, max_num_batched_tokens=12),
], ids=["default", "chunked-preempting"])
def test_speculative_drafts_are_recorded(tiny_models, monkeypatch, scheduling):
    """trace=True with n-gram speculation: each verifying sequence's drafts and how many passed, per step, adding
    up to llm.stats.spec_decoding; a verify step is a decode (1 + k tokens), and the table and the timeline show
    the drafts. Tracing changes no token; without it, no record is made."""
    prompts = repetitive_prompts(6, seed=1)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=24)
    options = dict(block_size=4, max_model_len=128, **scheduling,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                       "prompt_lookup_max": 3})
    llm = LLM(tiny_models["qwen3"], trace=True, **options)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    trace, spec = llm.trace, llm.stats.spec_decoding
    verified = [r for rec in trace for r in rec.scheduled if r.spec_token_ids]
    assert spec.num_accepted_tokens > 0 and spec.num_accepted_tokens < spec.num_draft_tokens  # some pass, some not
    assert len(verified) == spec.num_drafts
    assert sum(len(r.spec_token_ids) for r in verified) == spec.num_draft_tokens
    assert sum(r.num_accepted_tokens for r in verified) == spec.num_accepted_tokens
    assert all(r.num_tokens == 1 + len(r.spec_token_ids) and 0 <= r.num_accepted_tokens <= len(r.spec_token_ids)
               and r.is_decode for r in verified)
    assert all(r.num_accepted_tokens == 0 for rec in trace for r in rec.scheduled if not r.spec_token_ids)
    check_states(trace)
    check_stats(trace, llm.stats)
    if "enable_chunked_prefill" in scheduling:  # (what this combination is for)
        assert llm.stats.num_preemptions > 0 and llm.stats.num_mixed_steps > 0
        assert any(rec.kind == "mixed" and any(r.spec_token_ids for r in rec.scheduled) for rec in trace)
    # The reader follows each sequence past its rejected drafts: a verify step is no prefix-cache hit ("@N"); only
    # a request preempted to recompute finds its own blocks in the cache when it comes back.
    reader, recomputed = StepReader(), set()
    views = [reader.read(rec) for rec in trace]
    for rec, view in zip(trace, views):
        assert {seq_id for seq_id, label in view.labels.items() if "@" in label} == view.hits.keys() <= recomputed
        recomputed |= set(rec.recomputed)
    assert sum(len(view.spec) for view in views) == spec.num_drafts
    table = format_trace(trace).splitlines()
    assert table[0].split()[-5:] == ["spec", "a/p", "ms", "since", "prev"]
    names = default_names(trace)
    for rec, line in zip(trace, table[1:]):
        accepted, proposed = (sum(r.num_accepted_tokens for r in rec.scheduled),
                              sum(len(r.spec_token_ids) for r in rec.scheduled))
        assert line.split()[-2] == (f"{accepted}/{proposed}" if proposed else "-")
        for r in rec.scheduled:  # each verifying request: "name:4[2/3]"
            if r.spec_token_ids:
                assert f"{names[r.seq_id]}:{r.num_tokens}[{r.num_accepted_tokens}/{len(r.spec_token_ids)}]" in line
    # Tracing changes nothing; off, nothing is recorded.
    monkeypatch.setattr("nanoserve.step_records.record_step", lambda *args: pytest.fail("a record was made"))
    untraced = LLM(tiny_models["qwen3"], **options)
    assert [o.outputs[0].token_ids for o in untraced.generate(prompts, params, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in outputs]
    assert untraced.trace is None and untraced.stats.spec_decoding == spec


def test_beam_forks_and_drops_are_recorded(tiny_models, tmp_path):
    """trace=True with beam search: replaying each step's forks (a new beam from a live parent) and drops on
    the live beams gives exactly the running queue after the step, and at the end no beam is left. The
    reader starts a forked beam in the step after its fork; the table and the timeline show both."""
    llm = LLM(tiny_models["qwen3"], trace=True, block_size=4, num_kvcache_blocks=64, max_model_len=64,
              enable_beam_search=True)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=6), use_tqdm=False)
    trace, live, forks, drops = llm.trace, set(), 0, 0
    for rec in trace:
        live |= {r.seq_id for r in rec.scheduled if r.start == 0}  # a request's first beam, at its prompt
        for child, parent in rec.forked:
            assert parent in live and child not in live and rec.seq_requests[child][0] == rec.seq_requests[parent][0]
            live.add(child)
        assert set(rec.dropped) <= live
        live -= set(rec.dropped)
        assert live == set(rec.running)
        forks, drops = forks + len(rec.forked), drops + len(rec.dropped)
    seqs = {seq_id for rec in trace for seq_id in rec.seq_requests}
    assert not live and forks > 0 and forks == len(seqs) - len(prompts) and drops == len(seqs)
    reader = StepReader()
    for rec in trace:
        states = reader.read(rec).states
        assert all(child not in states for child, _ in rec.forked)
        assert all(states[seq_id] == "decode" for seq_id in rec.dropped if rec.step > 0)
    names = default_names(trace)
    for request_id in "01":  # each request's beams: .0, .1... in the order they came
        beams = sorted(s for s in seqs if any(rec.seq_requests.get(s, ("",))[0] == request_id for rec in trace))
        assert [names[s] for s in beams] == [f"{request_id}.{i}" for i in range(len(beams))]
    table = format_trace(trace, names).splitlines()
    for rec, line in zip(trace, table[1:]):
        if rec.forked:
            assert " ".join(f"{names[c]}<{names[p]}" for c, p in rec.forked) + " forked" in line
        if rec.dropped:
            assert " ".join(names[i] for i in rec.dropped) + " dropped" in line
    plot_timeline(trace, tmp_path / "beams.png")
    assert 10_000 < (tmp_path / "beams.png").stat().st_size < 100_000


def test_lora_adapters_in_the_table_and_the_picture(tiny_models, tmp_path):
    """A row computed with a LoRA adapter: +NAME in the step table, and its adapter's colour in plot_adapters."""
    lora = LoRARequest("style", 1, make_adapter(tiny_models["qwen3"], tmp_path / "style", 1, r=4, lora_alpha=8,
                                                target_modules=["q_proj"]))
    llm = LLM(tiny_models["qwen3"], trace=True, enable_lora=True, block_size=4, num_kvcache_blocks=32,
              max_model_len=64)
    llm.generate([[5, 6, 7], [8, 9, 10, 11]], SamplingParams(temperature=0, ignore_eos=True, max_tokens=3),
                 use_tqdm=False, lora_request=[None, lora])
    assert adapter_names(llm.trace) == {1: "style"}
    table = format_trace(llm.trace).splitlines()
    assert [line.split()[2:4] for line in table[1:]] == [["0:3", "1:4+style"]] + [["0:1", "1:1+style"]] * 2
    plot_adapters(llm.trace, tmp_path / "adapters.png", max_loras=1)
    pixels = {tuple(p) for p in (imread(tmp_path / "adapters.png")[..., :3] * 255).round().astype(int).reshape(-1, 3)}
    assert tuple(int(LORA_COLOURS[0][i:i + 2], 16) for i in (1, 3, 5)) in pixels  # the adapter's cells
