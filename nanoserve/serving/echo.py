"""`echo` on /v1/completions: each choice's text, and its logprobs, start with the prompt.

This is how evaluation harnesses score a text: they send it with `echo: true, logprobs: k` and read
the prompt tokens' logprobs back (the first is null: nothing comes before it), either beside a
generated token or, with `max_tokens: 0`, alone. The engine computes those logprobs already
(`SamplingParams(prompt_logprobs=k)`).
"""
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.serving.protocol import APIError, CompletionRequest


@dataclass
class Echo:
    # Each prompt's text as the answer starts with it; None: token ids, decoded here once the engine
    # has checked them (an id outside the vocabulary is its 400, not the tokenizer's crash).
    prompts: list[str | None]
    tokenizer: object
    with_logprobs: bool
    # max_tokens 0: the request runs with max_tokens=1 and `generate_nothing` hides that token, as
    # vLLM does. The engine needs no request that never samples: its prefill computes the last
    # position's logits anyway, so the hidden token costs one sampling; the price is that the prompt
    # must leave room for it.
    score_only: bool

    def prepend(self, i: int, out: RequestOutput, c: CompletionOutput) -> CompletionOutput:
        """The first output of a choice of prompt i, with the prompt before its text, token ids and
        logprobs."""
        logprobs = c.logprobs
        if self.with_logprobs:
            logprobs = out.prompt_logprobs + (c.logprobs or [])
        prompt = self.prompts[i]
        if prompt is None:
            prompt = self.tokenizer.decode(out.prompt_token_ids)
        return replace(c, text=prompt + c.text, token_ids=out.prompt_token_ids + c.token_ids,
                       logprobs=logprobs)


def make_echo(request: CompletionRequest, prompts: list, tokenizer) -> Echo | None:
    """None without echo; refuses max_tokens 0 without it, and what a prompt-only request cannot
    have."""
    if request.max_tokens == 0 and not request.echo:
        raise APIError(400, "max_tokens must be >= 1, or 0 with echo=true (score the prompt, "
                       "generate nothing)", "max_tokens")
    if not request.echo:
        return None
    if request.max_tokens == 0 and request.min_tokens > 0:
        raise APIError(400, f"min_tokens must be in [0, max_tokens=0], got {request.min_tokens}",
                       "min_tokens")
    if tokenizer is None:
        raise APIError(400, "echo: this model folder has no tokenizer to spell the prompt", "echo")
    texts = [p if isinstance(p, str) else None for p in prompts]
    return Echo(texts, tokenizer, with_logprobs=request.logprobs is not None,
                score_only=request.max_tokens == 0)


async def generate_nothing(outputs: AsyncIterator[tuple[int, RequestOutput]]):
    """The outputs of max_tokens=0 requests (run with max_tokens=1) without their token: "length",
    as asked."""
    async for i, out in outputs:
        c = out.outputs[0]
        empty = CompletionOutput(c.index, "", [], "length" if c.finish_reason else None, None,
                                 None if c.logprobs is None else [])
        yield i, replace(out, outputs=[empty])
