"""Beam search in the engine (LLM.beam_search): a request's live beams are one sequence group, as in
early vLLM. A subclass of each core class it changes, each inert unless the engine was built with
enable_beam_search=True (config.beam_search_config):

- `BeamEngineCore` checks and adds beam requests, and turns a finished search into its outputs;
- `BeamScheduler` knows the searches (request id -> BeamRequest) and so which sequences are beams,
  notes them in each plan (`BeamSchedulerOutput`), and after the step picks the beams: nothing is
  drawn for a beam (`BeamSchedulerOutput.draws`), its logits row goes to its search instead;
- `BeamInputBuilder` adds the beams' logits rows to the step, `BeamExecutor` hands them back with
  the plan (`out.raw_logits`).

search.py's BeamSearch.step says who goes on from whom, and `BeamScheduler.step_beams` acts that out
on the blocks, in order: free the beams that have no child, fork a parent with several children
(the child shares every block: one more reference each), then append each child's token. The next
schedule's `may_append` splits a shared, partly filled last block (copy-on-write) only for a beam
that writes into it. docs/beam_search.md draws it.
"""
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from nanoserve.beam_search.search import BeamChild, BeamSearch, Hypothesis
from nanoserve.beam_search_params import BeamSearchParams
from nanoserve.config import Config
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.core import EngineCore
from nanoserve.engine.model_runner import Executor, InputBuilder, ModelInput
from nanoserve.engine.output_processor import EngineCoreOutput
from nanoserve.engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from nanoserve.engine.sequence import Request, Sequence, SequenceStatus
from nanoserve.sampling_params import SamplingParams

BEAM_SEARCH_OFF = ("beam search: this engine was built without it; pass "
                   "LLM(..., enable_beam_search=True)")


def beam_sampling_params(params: BeamSearchParams) -> SamplingParams:
    """What the scheduler and the request checks see: n = beam_width seats and sequences' worth of
    blocks, and no EOS stop of their own. (Nothing is drawn for a beam: its row skips the sampler,
    and the beam step picks.)"""
    return SamplingParams(n=params.beam_width, temperature=0.0, max_tokens=params.max_tokens,
                          ignore_eos=True)


@dataclass
class BeamSchedulerOutput(SchedulerOutput):
    """The plan, with its beams: their logits rows go to their searches, and what the beam step did
    (the step's record, step_records.py, shows the forks and drops)."""

    beam_seq_ids: set[int] = field(default_factory=set)  # the rows that are beams
    beam_logits_rows: list[int] = field(default_factory=list)  # their rows among the logits
    raw_logits: torch.Tensor | None = None  # those rows' logits, a row per beam that sampled
    forked_beams: list[tuple[int, int]] = field(default_factory=list)  # (new beam, its parent)
    dropped_beams: list[int] = field(default_factory=list)  # beams without a child, freed
    finished_searches: list["BeamRequest"] = field(default_factory=list)  # done: the engine answers

    def draws(self, row: ScheduledSequence) -> bool:
        """Nothing is drawn for a beam: its search picks from the raw logits."""
        return super().draws(row) and row.seq.seq_id not in self.beam_seq_ids


class BeamRequest(Request):
    """A beam search's request: `seqs` are its live beams, in `search.beams` order (best first)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: BeamSearchParams,
                 config: Config, seq_ids: Iterator[int]):
        super().__init__(request_id, prompt_token_ids, beam_sampling_params(params),
                         block_size=config.block_size, seq_ids=seq_ids)
        self.params, self.eos_token_ids, self.seq_ids = params, config.eos_token_ids, seq_ids
        self.num_cached_tokens = 0
        self.restart()

    def restart(self) -> None:
        """One beam, the prompt, and a fresh search. (Request made n sequences for parallel
        sampling; beams fork only as the search splits.)"""
        self.search = BeamSearch(self.params, self.eos_token_ids)
        first = Sequence(next(self.seq_ids), self.prompt_token_ids, self.sampling_params,
                         self.seqs[0].block_size, request_id=self.request_id)
        self.seqs[:] = [first]
        first.group = self.seqs


class BeamScheduler(Scheduler):
    """Knows the searches, notes each plan's beams, and takes in each step's beam rows."""

    output_class = BeamSchedulerOutput

    def __init__(self, config: Config, block_manager: BlockManager, *args, **kwargs):
        super().__init__(config, block_manager, *args, **kwargs)
        # request id -> its search: a sequence is a beam if its request is here (empty when off)
        self.searches: dict[str, BeamRequest] = {}

    def schedule(self) -> SchedulerOutput:
        for search in self.searches.values():  # a search takes one token a step: no lookahead
            for beam in search.seqs:  # (speculative decoding's drafts for it are dropped)
                beam.spec_token_ids = []
        out = super().schedule()
        if self.searches:
            out.beam_seq_ids = {row.seq.seq_id for row in out.rows
                                if row.seq.request_id in self.searches}
        return out

    def postprocess(self, out: SchedulerOutput, token_ids: list[int]) -> list[Sequence]:
        updated = super().postprocess(out, token_ids)
        if self.searches:
            self.step_beams(out)
        return updated

    def step_beams(self, out: BeamSchedulerOutput) -> None:
        """Take in a step's beam rows (out.raw_logits: one row per beam that sampled, in batch
        order). A search that is done has all its beams freed, and goes to out.finished_searches:
        the engine returns its hypotheses."""
        searches, logits = self.searches, out.raw_logits
        for request in {searches[s.request_id]: None for s in out.preempted
                        if s.request_id in searches}:
            self._restart_if_recomputed(request)
        beam_seqs = [row.seq for row in out.rows if row.do_sample and not out.draws(row)]
        row_of = {s.seq_id: row for row, s in enumerate(beam_seqs)}
        for request in {searches[s.request_id]: None for s in beam_seqs if not s.is_finished}:
            if any(s.seq_id not in row_of for s in request.seqs):  # (a step ran part of the beams)
                for s in request.seqs:  # whoever ran computes its newest token again, with the rest
                    s.num_computed_tokens -= s.seq_id in row_of
                continue
            if request.search.beams[0].token_ids == []:  # the prompt's step: its cache hits
                request.num_cached_tokens = request.seqs[0].num_cached_tokens
            result = request.search.step(logits[[row_of[s.seq_id] for s in request.seqs]])
            self._act_out(request, result.children, result.dropped, out)
            if result.done:
                for seq in request.seqs:
                    self.finish(seq)
                out.finished_searches.append(searches.pop(request.request_id))

    def _act_out(self, request: BeamRequest, children: list[BeamChild], dropped: list[int],
                 out: BeamSchedulerOutput) -> None:
        """Free the dropped beams, fork the parents of several children (before anyone appends),
        append. `out` notes the forks and drops for the step's record."""
        parents = list(request.seqs)
        for i in dropped:
            self.finish(parents[i])
            out.dropped_beams.append(parents[i].seq_id)
        new_seqs = []
        for child in children:
            parent = parents[child.parent]
            new_seqs.append(self._fork_beam(request, parent) if child.is_fork else parent)
            if child.is_fork:
                out.forked_beams.append((new_seqs[-1].seq_id, parent.seq_id))
        for seq, child in zip(new_seqs, children):
            seq.append_token(child.token_id)
            self.stats.num_generated_tokens += 1
        request.seqs[:] = new_seqs  # (the same list: it is every beam's `group`)

    def _fork_beam(self, request: BeamRequest, parent: Sequence) -> Sequence:
        """A new beam, a copy of parent that shares its blocks, next to it in the running queue."""
        child = Sequence(next(request.seq_ids), parent.token_ids, parent.sampling_params,
                         parent.block_size, parent.request_id)
        child.group = parent.group
        self.block_manager.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = SequenceStatus.RUNNING
        self.running.insert(self.running.index(parent) + 1, child)
        return child

    def _restart_if_recomputed(self, request: BeamRequest) -> None:
        """Preempted to recompute, the beams would come back one by one, not as a group: the search
        starts over from the prompt instead (same model, same result; prefix caching keeps the
        prompt's KV if it can). Swapped out, the group waits in host memory and comes back whole."""
        if request.seqs[0].status != SequenceStatus.WAITING:
            return
        for seq in request.seqs:
            self.finish(seq)
        request.restart()
        self.waiting.add(request.seqs[0], front=True)


class BeamInputBuilder(InputBuilder):
    """The step's inputs, and the logits rows of the beams that sample (their newest tokens')."""

    def prepare_inputs(self, out: BeamSchedulerOutput) -> ModelInput | None:
        inputs = super().prepare_inputs(out)
        if inputs is None or not out.beam_seq_ids:
            return inputs
        ends = accumulate(row.num_tokens for row in out.rows)
        rows = [end - 1 for row, end in zip(out.rows, ends) if row.do_sample and not out.draws(row)]
        first = len(inputs.logits_rows)
        inputs.logits_rows = torch.cat([inputs.logits_rows, self._tensor(rows, torch.int64)])
        out.beam_logits_rows = list(range(first, first + len(rows)))
        return inputs


class BeamExecutor(Executor):
    """Hands the beams' logits rows back with the plan (out.raw_logits) for the beam step. (It
    comes after the ranks' executor in the composite: with pipeline stages that one receives the
    logits.)"""

    def finish(self, out: BeamSchedulerOutput, inputs: ModelInput | None,
               logits: torch.Tensor | None) -> torch.Tensor:
        if inputs is not None and out.beam_logits_rows:  # (none with beam search off)
            out.raw_logits = logits[out.beam_logits_rows]
        return super().finish(out, inputs, logits)


class BeamEngineCore(EngineCore):
    """Checks and adds beam requests (LLM.beam_search), and returns each finished search's
    hypotheses."""

    scheduler: BeamScheduler

    def __init__(self, config: Config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.beam_search_config = config.beam_search_config  # None: beam search is off

    def check_beam_request(self, token_ids: list[int], params: BeamSearchParams) -> None:
        """The limits of beam search itself, then the prompt and the KV blocks of beam_width
        sequences."""
        if self.beam_search_config is None:
            raise ValueError(BEAM_SEARCH_OFF)
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params: expected BeamSearchParams, got {type(params).__name__}")
        config = self.config
        # each step's beams decide the next batch: it cannot be planned ahead
        if config.scheduler_config.async_scheduling:
            raise ValueError("beam search: not with async scheduling (the next step's batch "
                             "depends on this step's beams; it is on by default on CUDA): create "
                             "the LLM with async_scheduling=False")
        if config.enable_chunked_prefill and params.beam_width > config.max_num_batched_tokens:
            # a step that runs part of a request's beams computes them again with the others the
            # next step: a budget below the width would never run them all
            raise ValueError(f"beam_width ({params.beam_width}) exceeds max_num_batched_tokens "
                             f"({config.max_num_batched_tokens}) with enable_chunked_prefill=True")
        if params.beam_width > config.max_num_seqs:  # a request's beams run together
            raise ValueError(f"beam_width ({params.beam_width}) exceeds max_num_seqs "
                             f"({config.max_num_seqs})")
        search, vocab_size = BeamSearch(params, config.eos_token_ids), config.hf_config.vocab_size
        if search.num_candidates > vocab_size:
            raise ValueError(f"beam_width ({params.beam_width}): each step ranks "
                             f"{search.num_candidates} candidates, more than the vocabulary's "
                             f"{vocab_size} tokens")
        self.check_request(token_ids, beam_sampling_params(params))

    def add_beam_request(self, request_id: str, prompt_token_ids: list[int],
                         params: BeamSearchParams) -> None:
        """A beam search: its beams are one sequence group."""
        self.check_beam_request(prompt_token_ids, params)
        request = BeamRequest(request_id, prompt_token_ids, params, self.config, self.seq_ids)
        self.add(request)
        self.scheduler.searches[request_id] = request

    def abort_request(self, request_id: str) -> bool:
        if self.beam_search_config is not None:
            self.scheduler.searches.pop(request_id, None)
        return super().abort_request(request_id)

    def _update_from_output(self, out: BeamSchedulerOutput,
                            token_ids: list[int]) -> list[EngineCoreOutput]:
        """The step's outputs, then each search the beam step finished: its hypotheses, best
        first."""
        outputs = super()._update_from_output(out, token_ids)
        if self.beam_search_config is None:
            return outputs
        for request in out.finished_searches:
            del self.requests[request.request_id]
            outputs += [self._beam_output(request, i, h)
                        for i, h in enumerate(request.search.hypotheses)]
        return outputs

    def _beam_output(self, request: BeamRequest, index: int,
                     hypothesis: Hypothesis) -> EngineCoreOutput:
        tokenizer = self.tokenizer
        text = tokenizer.decode(hypothesis.token_ids, skip_special_tokens=True) if tokenizer else ""
        return EngineCoreOutput(request.request_id, hypothesis.token_ids, new_text=text,
                                finished=True, finish_reason=hypothesis.finish_reason,
                                num_cached_tokens=request.num_cached_tokens, index=index,
                                cumulative_logprob=hypothesis.cumulative_logprob)
