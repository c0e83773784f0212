"""Logprobs, a chapter (SamplingParams(logprobs=k, prompt_logprobs=k)): each sampled token's
log-probability and the k most likely tokens at its place, and the same for each prompt token. A
subclass of each core class it changes, each inert unless the config has a logprobs_config
(max_logprobs > 0; a request may ask up to that k). nanoserve/chapters.py puts them in the parts.

- LogprobsEngineCore: checks the two options, opens each request's records and fills its outputs'
  new_logprobs and prompt_logprobs from them.
- LogprobsInputBuilder: the batch rows whose logits score a prompt token join the logits rows.
- LogprobsModelRunner: after sampling, scores the rows into the records (request id -> lists).
- LogprobsBlockManager: a prompt_logprobs request computes its whole prompt (vLLM V1): cached
  tokens would get no logits.
"""
from dataclasses import dataclass, field

import torch

from nanoserve.config import Config
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.core import EngineCore
from nanoserve.engine.model_runner import InputBuilder, ModelInput, ModelRunner, to_device
from nanoserve.engine.output_processor import EngineCoreOutput
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.engine.sequence import Request, Sequence
from nanoserve.lora_request import LoRARequest
from nanoserve.outputs import Logprob
from nanoserve.sampling_params import SamplingParams

# (seq, prompt position or None for the sampled token, logits row)
LogprobsPlace = tuple[Sequence, int | None, int]


@dataclass
class LogprobsModelInput(ModelInput):
    """The step's batch with the places whose logits rows are scored after sampling."""

    logprobs_places: list[LogprobsPlace] = field(default_factory=list)


class LogprobsInputBuilder(InputBuilder):
    input_class = LogprobsModelInput

    def prepare_inputs(self, out: SchedulerOutput) -> ModelInput | None:
        """The core's batch; then, for requests with prompt_logprobs, the batch rows whose logits
        score a prompt token (the row of position p scores token p + 1) join its logits rows, and
        every place to score, the sampling rows' included, goes with it."""
        inputs = super().prepare_inputs(out)
        if inputs is None:
            return None
        by_id = {s.seq_id: s for row in out.rows for s in (row.seq, *row.forks)}
        places = [(by_id[i], None, row) for row, i in enumerate(inputs.sample_seq_ids)
                  if by_id[i].sampling_params.logprobs is not None]
        first_row, prompt_rows, offset = len(inputs.logits_rows), [], 0
        for row in out.rows:
            seq, start = row.seq, row.start
            if seq.sampling_params.prompt_logprobs is not None:
                end = min(start + row.num_tokens, seq.num_prompt_tokens - 1)
                places += [(seq, p + 1, first_row + len(prompt_rows) + p - start)
                           for p in range(start, end)]
                prompt_rows += range(offset, offset + end - start)
            offset += row.num_tokens
        if not places:  # (always so with the chapter off: no request may ask)
            return inputs
        if prompt_rows:
            inputs.logits_rows = torch.cat((inputs.logits_rows,
                                            self._tensor(prompt_rows, torch.int64)))
        inputs.logprobs_places = places
        return inputs


class LogprobsModelRunner(ModelRunner):
    def __init__(self, config: Config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        # request id -> per sequence, one dict per sampled token; -> one per prompt token (None for
        # the first). LogprobsEngineCore opens a request's and drops it when the request leaves.
        self.sample_logprobs: dict[str, list[list[dict[int, Logprob]]]] = {}
        self.prompt_logprobs: dict[str, list[dict[int, Logprob] | None]] = {}

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, inputs: ModelInput) -> torch.Tensor:
        sampled = super().sample(logits, inputs)
        if isinstance(inputs, LogprobsModelInput):
            self.record_logprobs(logits, sampled, inputs.logprobs_places)
        return sampled

    def record_logprobs(self, logits: torch.Tensor, sampled: torch.Tensor,
                        places: list[LogprobsPlace]) -> None:
        """For each (seq, p, row), score a token under logits[row], with the top k. p None: the
        token sampled from that row, appended to seq's list; else prompt token p, put at p. A
        request that left (finished or aborted with a step in flight) has no records to fill."""
        sampled = sampled.tolist()  # a row that emitted nothing (-1: past a rejected draft): none
        places = [(seq, p, row) for seq, p, row in places if (p is not None or sampled[row] >= 0)
                  and seq.request_id in self.sample_logprobs]
        if not places:
            return
        token_ids = [sampled[row] if p is None else seq.token_ids[p] for seq, p, row in places]
        ks = [s.sampling_params.logprobs if p is None else s.sampling_params.prompt_logprobs
              for s, p, _ in places]
        scores = compute_logprobs(logits[[row for *_, row in places]],
                                  to_device(token_ids, torch.int64, self.device), max(ks))
        for (seq, p, _), k, token_id, lp, rank, top_ids, top_lps in zip(
                places, ks, token_ids, *(t.tolist() for t in scores)):
            d = {i: Logprob(x, r) for r, (i, x) in enumerate(zip(top_ids[:k], top_lps[:k]), 1)}
            d[token_id] = Logprob(lp, rank)
            if p is None:
                self.sample_logprobs[seq.request_id][seq.index].append(d)
            else:
                self.prompt_logprobs[seq.request_id][p] = d


class LogprobsEngineCore(EngineCore):
    """Requests' side: the options' checks, and the outputs read from the model runner's
    records."""

    model_runner: LogprobsModelRunner

    def __init__(self, config: Config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        logprobs = config.logprobs_config
        self.max_logprobs = 0 if logprobs is None else logprobs.max_logprobs  # 0: the chapter off

    def check_option(self, name: str, value: object) -> None:
        """What no engine could serve, then vLLM's rule: a request asks for at most max_logprobs.
        (Without max_logprobs the core refuses both options.)"""
        if name not in ("logprobs", "prompt_logprobs") or not self.max_logprobs:
            return super().check_option(name, value)
        vocab_size = self.config.hf_config.vocab_size
        if value > vocab_size:
            raise ValueError(f"{name}: got {value}, the vocabulary has {vocab_size} tokens")
        if value > self.max_logprobs:
            raise ValueError(f"{name}: {value} exceeds max_logprobs ({self.max_logprobs}); "
                             f"pass LLM(..., max_logprobs={value}) or more")

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> None:
        super().add_request(request_id, prompt_token_ids, sampling_params, priority, lora_request)
        if sampling_params.logprobs is not None or sampling_params.prompt_logprobs is not None:
            runner = self.model_runner  # (rank 0's, in this process: it samples)
            runner.sample_logprobs[request_id] = [[] for _ in range(sampling_params.n)]
            runner.prompt_logprobs[request_id] = [None] * len(prompt_token_ids)

    def _output(self, request: Request, seq: Sequence, num_new: int) -> EngineCoreOutput:
        """The core's output, with the logprobs of its new tokens (the model runner wrote them when
        they were sampled; a later step may be ahead) and of the prompt."""
        first = len(seq.token_ids) - num_new - seq.num_prompt_tokens  # (before a stop string cuts)
        output = super()._output(request, seq, num_new)
        params, runner = request.sampling_params, self.model_runner
        if params.logprobs is not None:
            logprobs = runner.sample_logprobs[request.request_id][seq.index]
            output.new_logprobs = logprobs[first : seq.num_completion_tokens]
        if params.prompt_logprobs is not None:
            output.prompt_logprobs = runner.prompt_logprobs[request.request_id]
        return output

    def _update_from_output(self, out: SchedulerOutput,
                            token_ids: list[int]) -> list[EngineCoreOutput]:
        outputs = super()._update_from_output(out, token_ids)
        for output in outputs:
            if output.finished and output.request_id not in self.requests:
                self.forget(output.request_id)
        return outputs

    def abort_request(self, request_id: str) -> bool:
        self.forget(request_id)
        return super().abort_request(request_id)

    def forget(self, request_id: str) -> None:
        """A request left: its records go."""
        self.model_runner.sample_logprobs.pop(request_id, None)
        self.model_runner.prompt_logprobs.pop(request_id, None)


class LogprobsBlockManager(BlockManager):
    def prefix_hashes(self, seq: Sequence) -> list[int]:
        """A request for prompt_logprobs computes its whole prompt: cached tokens would get no
        logits (vLLM V1)."""
        return [] if seq.sampling_params.prompt_logprobs is not None else super().prefix_hashes(seq)


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                     num_logprobs: int) -> tuple[torch.Tensor, ...]:
    """Of the raw model distribution (before penalties and temperature: vLLM's default): each row's
    logprob of its token and that token's rank (1 = most likely), and the row's num_logprobs most
    likely tokens."""
    logprobs = logits.float().log_softmax(dim=-1)
    token_logprobs = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    return token_logprobs.squeeze(1), ranks, top_ids, top_logprobs
