"""Beam search in the engine (LLM.beam_search): a request's live beams are one sequence group, as in early vLLM.

Its beams have raw_logits: nothing is drawn for them; their logits rows join the step (the extra_logits_rows
seam, `beam_rows`) and go back with the plan (`out.raw_logits`, the after_sample seam). search.py's
BeamSearch.step says who goes on from whom, and `BeamScheduler.step` (the after_step seam, plugged
in when the engine is built with enable_beam_search=True) acts that out on the blocks, in order:
free the beams that have no child, fork a parent with several children (the child shares every block: one
more reference each), then append each child's token. The next schedule's `may_append` splits a shared,
partly filled last block (copy-on-write) only for a beam that writes into it. docs/beam_search.md draws it.
"""
import weakref
from collections.abc import Iterator
from itertools import accumulate

import torch

from nanoserve.beam_search.search import BeamChild, BeamSearch, Hypothesis
from nanoserve.beam_search_params import BeamSearchParams
from nanoserve.config import Config
from nanoserve.engine.core import EngineCore
from nanoserve.engine.model_runner import ModelInput
from nanoserve.engine.output_processor import EngineCoreOutput
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.engine.sequence import Request, Sequence, SequenceStatus
from nanoserve.sampling_params import SamplingParams


def beam_sampling_params(params: BeamSearchParams) -> SamplingParams:
    """What the scheduler and the request checks see: n = beam_width seats and sequences' worth of blocks, and no
    EOS stop of their own. (Nothing is drawn for a beam: its row skips the sampler, and the beam step picks.)"""
    return SamplingParams(n=params.beam_width, temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True)


def beam_rows(out: SchedulerOutput, rows: list, first_row: int) -> tuple[list[int], tuple[SchedulerOutput, list[int]]]:
    """The extra_logits_rows seam: the batch row of each beam's newest token, for the beams that sample (in batch
    order); its state: the plan and where those rows are among the logits."""
    ends = accumulate(row.num_tokens for row in out.rows)
    batch_rows = [end - 1 for row, end in zip(out.rows, ends) if row.do_sample and row.seq.raw_logits]
    return batch_rows, (out, list(range(first_row, first_row + len(batch_rows))))


def keep_beam_logits(runner, logits: torch.Tensor, sampled: torch.Tensor, inputs: ModelInput) -> None:
    """The after_sample seam: the beams' logits rows go back with the plan (out.raw_logits), for BeamScheduler.step."""
    out, rows = inputs.extras["beam_search"]
    if rows:
        out.raw_logits = logits[rows]


class BeamRequest(Request):
    """A beam search's request: `seqs` are its live beams, in `search.beams` order (best first)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: BeamSearchParams, config: Config,
                 seq_ids: Iterator[int]):
        super().__init__(request_id, prompt_token_ids, beam_sampling_params(params), block_size=config.block_size,
                         seq_ids=seq_ids)
        self.params, self.eos_token_ids, self.seq_ids = params, config.eos_token_ids, seq_ids
        self.num_cached_tokens = 0
        self.restart()

    def restart(self) -> None:
        """One beam, the prompt, and a fresh search. (Request made n sequences for parallel sampling; beams
        fork only as the search splits.)"""
        self.search = BeamSearch(self.params, self.eos_token_ids)
        first = Sequence(next(self.seq_ids), self.prompt_token_ids, self.sampling_params,
                         self.seqs[0].block_size, request_id=self.request_id)
        first.raw_logits = True  # the search picks its tokens: nothing is drawn for a beam
        self.seqs[:] = [first]
        first.group = self.seqs


class BeamScheduler:
    """Checks and adds beam requests, and takes in each step's beam rows (the after_step seam)."""

    def __init__(self, engine: EngineCore):
        # (A weak reference: the engine's seams hold this object, and a strong one back would keep `del llm` from
        # freeing the engine at once.)
        self.engine, self.config, self.scheduler = weakref.proxy(engine), engine.config, engine.scheduler

    @classmethod
    def plug_in(cls, engine: EngineCore) -> "BeamScheduler":
        engine.seams.features["beam_search"] = beams = cls(engine)
        engine.seams.after_step.append(beams.step)
        engine.seams.extra_logits_rows["beam_search"] = beam_rows
        engine.seams.after_sample.append(keep_beam_logits)
        return beams

    def check_request(self, token_ids: list[int], params: BeamSearchParams) -> None:
        """The limits of beam search itself, then the prompt and the KV blocks of beam_width sequences."""
        self.check(params)
        self.engine.check_request(token_ids, beam_sampling_params(params))

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: BeamSearchParams) -> None:
        """A beam search: its beams are one sequence group."""
        self.check_request(prompt_token_ids, params)
        self.engine.add(BeamRequest(request_id, prompt_token_ids, params, self.config, self.engine.seq_ids))

    def check(self, params: BeamSearchParams) -> None:
        """The limits of beam search itself (EngineCore.check_request checks the prompt and the KV pool)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params: expected BeamSearchParams, got {type(params).__name__}")
        # each step's beams decide the next batch: it cannot be planned ahead
        if self.config.scheduler_config.async_scheduling:
            raise ValueError("beam search: not with async scheduling (the next step's batch depends on this "
                             "step's beams; it is on by default on CUDA): create the LLM with "
                             "async_scheduling=False")
        if self.config.enable_chunked_prefill and params.beam_width > self.config.max_num_batched_tokens:
            # a step that runs part of a request's beams computes them again with the others the next step:
            # a budget below the width would never run them all
            raise ValueError(f"beam_width ({params.beam_width}) exceeds max_num_batched_tokens "
                             f"({self.config.max_num_batched_tokens}) with enable_chunked_prefill=True")
        if params.beam_width > self.config.max_num_seqs:  # a request's beams run together
            raise ValueError(f"beam_width ({params.beam_width}) exceeds max_num_seqs ({self.config.max_num_seqs})")
        search, vocab_size = BeamSearch(params, self.config.eos_token_ids), self.config.hf_config.vocab_size
        if search.num_candidates > vocab_size:
            raise ValueError(f"beam_width ({params.beam_width}): each step ranks {search.num_candidates} "
                             f"candidates, more than the vocabulary's {vocab_size} tokens")

    def step(self, out: SchedulerOutput, updated: dict[Sequence, int]) -> list[EngineCoreOutput]:
        """Take in a step's beam rows (out.raw_logits: one row per beam that sampled, in batch order). A request
        whose search is done has all its beams freed (the engine then drops it); it returns its hypotheses, best
        first, as outputs."""
        requests, logits = self.engine.requests, out.raw_logits
        for request in {requests[s.request_id]: None for s in out.preempted if s.raw_logits}:
            self._restart_if_recomputed(request)
        beam_seqs = [row.seq for row in out.rows if row.do_sample and row.seq.raw_logits]
        row_of = {s.seq_id: row for row, s in enumerate(beam_seqs)}
        outputs = []
        for request in {requests[s.request_id]: None for s in beam_seqs if not s.is_finished}:
            if any(s.seq_id not in row_of for s in request.seqs):  # (a step that ran part of the beams)
                for s in request.seqs:  # whoever ran computes its newest token again, with the others
                    s.num_computed_tokens -= s.seq_id in row_of
                continue
            if request.search.beams[0].token_ids == []:  # the prompt's step: its cache hits are the request's
                request.num_cached_tokens = request.seqs[0].num_cached_tokens
            result = request.search.step(logits[[row_of[s.seq_id] for s in request.seqs]])
            self._act_out(request, result.children, result.dropped, out)
            if result.done:
                for seq in request.seqs:
                    self.scheduler.finish(seq)
                outputs += [self._output(request, i, h) for i, h in enumerate(request.search.hypotheses)]
        return outputs

    def _output(self, request: BeamRequest, index: int, hypothesis: Hypothesis) -> EngineCoreOutput:
        tokenizer = self.engine.tokenizer
        text = tokenizer.decode(hypothesis.token_ids, skip_special_tokens=True) if tokenizer else ""
        return EngineCoreOutput(request.request_id, hypothesis.token_ids, new_text=text, finished=True,
                                finish_reason=hypothesis.finish_reason, num_cached_tokens=request.num_cached_tokens,
                                index=index, cumulative_logprob=hypothesis.cumulative_logprob)

    def _act_out(self, request: BeamRequest, children: list[BeamChild], dropped: list[int],
                 out: SchedulerOutput) -> None:
        """Free the dropped beams, fork the parents of several children (before anyone appends), append. The
        step's record (step_records.py) shows the forks and drops: `out` notes them."""
        parents = list(request.seqs)
        for i in dropped:
            self.scheduler.finish(parents[i])
            out.dropped_beams.append(parents[i].seq_id)
        new_seqs = []
        for child in children:
            parent = parents[child.parent]
            new_seqs.append(self._fork(request, parent) if child.is_fork else parent)
            if child.is_fork:
                out.forked_beams.append((new_seqs[-1].seq_id, parent.seq_id))
        for seq, child in zip(new_seqs, children):
            seq.append_token(child.token_id)
            self.scheduler.stats.num_generated_tokens += 1
        request.seqs[:] = new_seqs  # (the same list: it is every beam's `group`)

    def _fork(self, request: BeamRequest, parent: Sequence) -> Sequence:
        """A new beam, a copy of parent that shares its blocks, next to it in the running queue."""
        child = Sequence(next(request.seq_ids), parent.token_ids, parent.sampling_params, parent.block_size,
                         parent.request_id)
        child.raw_logits, child.group = True, parent.group
        self.scheduler.block_manager.fork(parent, child)
        child.num_computed_tokens, child.num_cached_tokens = parent.num_computed_tokens, parent.num_cached_tokens
        child.status = SequenceStatus.RUNNING
        running = self.scheduler.running
        running.insert(running.index(parent) + 1, child)
        return child

    def _restart_if_recomputed(self, request: BeamRequest) -> None:
        """Preempted to recompute, the beams would come back one by one, not as a group: the search starts over
        from the prompt instead (same model, same result; prefix caching keeps the prompt's KV if it can).
        Swapped out, the group waits in host memory and comes back whole."""
        if request.seqs[0].status != SequenceStatus.WAITING:
            return
        for seq in request.seqs:
            self.scheduler.finish(seq)
        request.restart()
        self.scheduler.waiting.add(request.seqs[0], front=True)
