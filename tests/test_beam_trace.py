"""A beam search's step records (block_tables, blocks_copied) and nanoserve/tools/beam_trace.py: after every step
the record agrees with the block manager, and the tool's reading of them (forks, frees, copies) is the dance the
engine did."""
import subprocess
import sys
from pathlib import Path

from conftest import ROOMY_POOL
from nanoserve import LLM, BeamSearchParams
from nanoserve.chapters import beam_search_feature
from nanoserve.tools.beam_trace import beam_steps, format_beam_trace, plot_beam_blocks

OPTIONS = dict(trace=True, block_size=4, max_model_len=128, device="cpu", enable_prefix_caching=False,
               enable_beam_search=True, **ROOMY_POOL)
PROMPT = [5, 17, 300, 42, 9, 101]  # 6 tokens: one full block and a partly filled one


def test_records_agree_with_the_block_manager(tiny_models, tmp_path):
    llm = LLM(tiny_models["qwen3"], **OPTIONS)
    engine, bm = llm.engine, llm.engine.block_manager
    params = BeamSearchParams(beam_width=3, max_tokens=9, ignore_eos=True)
    beam_search_feature(engine).add_beam_request("r", PROMPT, params)
    while engine.has_unfinished_requests():
        engine.step()
        rec = llm.trace[-1]
        assert rec.block_tables == {seq.seq_id: seq.block_table for seq in engine.scheduler.running}
        holders = [b for table in rec.block_tables.values() for b in table]
        assert all(holders.count(b) == bm.blocks[b].ref_count for b in holders)  # each share is a reference
        assert rec.num_used_blocks == len(set(holders))
    steps = beam_steps(llm.trace)
    assert [len(s.tables) for s in steps] == [3] * 8 + [0]  # the search's 9 steps; the last frees everything
    assert [s.num_tokens for s in steps] == list(range(6, 15))
    for s, rec in zip(steps, llm.trace):
        assert s.copies == rec.blocks_copied
        for child, parent in s.forks:  # a fork shares its parent's whole table until the next step's writes
            assert s.tables[child] == s.tables[parent]
        assert sorted(s.holders.elements()) == sorted(b for t in s.tables.values() for b in t)
    assert sorted(steps[0].forks) == [("B", "A"), ("C", "A")]  # the prompt's sequence, A, and its two forks
    assert sum(len(s.forks) for s in steps) == sum(len(s.freed) for s in steps) - 1  # every beam ends freed
    assert sum(len(s.copies) for s in steps) >= 1  # siblings wrote different tokens into a shared block
    assert sorted(steps[-1].freed) == sorted(steps[-2].tables)
    table = format_beam_trace(llm.trace)
    assert len(table.splitlines()) == 1 + len(steps) and "forks from A" in table.splitlines()[1]
    plot_beam_blocks(llm.trace, str(tmp_path / "b.png"), block_size=4)
    assert (tmp_path / "b.png").read_bytes().startswith(b"\x89PNG")


def test_command_writes_table_and_picture(converted, tmp_path):
    """The command docs/beam_search.md gives (on the demo model, which has a tokenizer for the prompt's text)."""
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, "-m", "nanoserve.tools.beam_trace", "--model", str(converted[1]),
                             "--beam-width", "2", "--max-tokens", "4", "--out", str(tmp_path)],
                            cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "beam_blocks.png").read_bytes().startswith(b"\x89PNG")
    assert len((tmp_path / "beam.txt").read_text().splitlines()) == 1 + 4  # the prefill, 3 decodes
