"""benchmarks/host_step.py runs through the engine's public steps with a fake forward: every timed step decodes
every sequence, and the phases it reports add up to the step."""
import gc
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import host_step  # noqa: E402


def on_gc_removed() -> bool:
    return not any(getattr(callback, "__name__", "") == "on_gc" for callback in gc.callbacks)


@pytest.mark.parametrize("persistent_batch, final_only", [(False, False), (True, True)])
def test_host_step_times_each_decode_step_by_phase(persistent_batch, final_only, monkeypatch):
    flatten, calls = host_step.InputBatch.flatten, []
    monkeypatch.setattr(host_step.InputBatch, "flatten", lambda self, out: calls.append(1) or flatten(self, out))
    updates, update = [], host_step.RequestState.update
    monkeypatch.setattr(host_step.RequestState, "update", lambda s, out: updates.append(s.kind) or update(s, out))
    times = host_step.measure(num_seqs=4, steps=3, warmup=1, temperature=0.8, persistent_batch=persistent_batch,
                              final_only=final_only)
    assert bool(calls) == persistent_batch  # --persistent-batch builds the inputs as on CUDA, else the core does
    kind = host_step.RequestOutputKind.FINAL_ONLY if final_only else host_step.RequestOutputKind.CUMULATIVE
    assert updates and set(updates) == {kind}  # the front end takes every step's outputs in, as asked
    full_collections = times.pop("full GC")  # as many as happened (the heap is frozen, as LLM.generate does)
    assert all(wall >= 0 for wall, _ in full_collections) and gc.get_freeze_count() == 0 and on_gc_removed()
    assert {phase: len(t) for phase, t in times.items()} == {phase: 3 for phase in (*host_step.PHASES, "step",
                                                                                    "front end")}
    for i, step in enumerate(times["step"]):
        for kind in range(2):  # wall, CPU
            assert min(times[phase][i][kind] for phase in host_step.PHASES[:3]) >= 0
            assert abs(sum(times[phase][i][kind] for phase in host_step.PHASES) - step[kind]) < 1e-9


def test_full_collections_in_the_timed_steps_are_timed(monkeypatch):
    """A full collection that falls in a timed step (here forced, in the last step's front end) is reported."""
    updates, update = [], host_step.RequestState.update
    monkeypatch.setattr(host_step.RequestState, "update",
                        lambda s, out: updates.append(1) or (len(updates) == 4 * 6 and gc.collect()) or update(s, out))
    times = host_step.measure(num_seqs=4, steps=3, warmup=1, temperature=0.0)
    assert len(updates) == 4 * 6 and len(times["full GC"]) == 1 and times["full GC"][0][0] > 0
