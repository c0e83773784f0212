"""Logprobs, a chapter (SamplingParams(logprobs=k, prompt_logprobs=k)): each sampled token's
log-probability and the k most likely tokens at its place, and the same for each prompt token. An
engine built with max_logprobs > 0 plugs it in (nanoserve/chapters.py; a request may ask up to that
k) at two seams (engine/seams.py): extra logits rows for the prompt tokens
(InputBuilder.prepare_inputs), and a hook after sampling that scores the rows (ModelRunner.sample).
The results go on the sequences (Sequence.logprobs, Sequence.prompt_logprobs), where the engine's
outputs read them.
"""
import torch

from nanoserve.engine.core import EngineCore
from nanoserve.engine.model_runner import ModelInput, ModelRunner, SamplingRow, to_device
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.engine.sequence import Sequence
from nanoserve.outputs import Logprob

LogprobsPlace = tuple[Sequence, int | None, int]  # (seq, prompt position or None for the sampled token, logits row)


def plug_in(engine: EngineCore) -> None:
    engine.seams.extra_logits_rows["logprobs"] = logprobs_places
    engine.seams.after_sample.append(record_logprobs)
    engine.seams.features["logprobs"] = record_logprobs


def logprobs_places(out: SchedulerOutput, rows: list[SamplingRow], first_row: int
                    ) -> tuple[list[int], list[LogprobsPlace]]:
    """The extra logits rows seam: for requests with prompt_logprobs, the batch rows whose logits score a prompt
    token (the row of position p scores token p + 1), numbered from first_row on; and every place to score,
    the sampling rows' included."""
    places = [(seq, None, row) for row, (seq, _) in enumerate(rows) if seq.logprobs is not None]
    prompt_rows, offset = [], 0
    for row in out.rows:
        seq, start = row.seq, row.start
        if seq.prompt_logprobs is not None:
            end = min(start + row.num_tokens, seq.num_prompt_tokens - 1)
            places += [(seq, p + 1, first_row + len(prompt_rows) + p - start) for p in range(start, end)]
            prompt_rows += range(offset, offset + end - start)
        offset += row.num_tokens
    return prompt_rows, places


def record_logprobs(runner: ModelRunner, logits: torch.Tensor, sampled: torch.Tensor, inputs: ModelInput) -> None:
    """The after-sample seam: for each (seq, p, row), score a token under logits[row], with the top k. p None:
    the token sampled from that row, appended to seq.logprobs; else prompt token p, in seq.prompt_logprobs[p]."""
    places = inputs.extras.get("logprobs")
    if not places:
        return
    sampled = sampled.tolist()  # a row that emitted nothing (-1: past a rejected draft) gets no logprobs
    places = [(seq, p, row) for seq, p, row in places if p is not None or sampled[row] >= 0]
    token_ids = [sampled[row] if p is None else seq.token_ids[p] for seq, p, row in places]
    ks = [s.sampling_params.logprobs if p is None else s.sampling_params.prompt_logprobs for s, p, _ in places]
    scores = compute_logprobs(logits[[row for *_, row in places]], to_device(token_ids, torch.int64, runner.device),
                              max(ks))
    for (seq, p, _), k, token_id, lp, rank, top_ids, top_lps in zip(places, ks, token_ids,
                                                                   *(t.tolist() for t in scores)):
        d = {i: Logprob(x, r) for r, (i, x) in enumerate(zip(top_ids[:k], top_lps[:k]), 1)}
        d[token_id] = Logprob(lp, rank)
        if p is None:
            seq.logprobs.append(d)
        else:
            seq.prompt_logprobs[p] = d


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> tuple[torch.Tensor, ...]:
    """Of the raw model distribution (before penalties and temperature: vLLM's default): each row's logprob of
    its token and that token's rank (1 = most likely), and the row's num_logprobs most likely tokens."""
    logprobs = logits.float().log_softmax(dim=-1)
    token_logprobs = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    return token_logprobs.squeeze(1), ranks, top_ids, top_logprobs
