"""The engine's logprobs (per token: token id -> Logprob(logprob, rank)) in OpenAI's two response
shapes."""
from dataclasses import dataclass
from itertools import accumulate

from nanoserve.outputs import SampleLogprobs
from nanoserve.serving.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TokenLogprob,
)


@dataclass
class LogprobsFormat:
    tokenizer: object
    chat: bool  # the chat shape (a list of entries) or the legacy completions one (parallel lists)
    k: int  # the most likely tokens to list per position

    def __call__(self, token_ids: list[int], logprobs: SampleLogprobs, text_offset: int = 0):
        """text_offset: where the first token starts in the choice's text (a stream's earlier
        chunks). A None in logprobs is an echoed prompt's first token (completions only): spelled,
        with null logprobs."""
        entries = [None if lps is None else self.entry(t, lps)
                   for t, lps in zip(token_ids, logprobs)]
        if self.chat:
            return ChatLogprobs(content=entries)
        tokens = [self.tokenizer.decode([t]) if e is None else e.token
                  for t, e in zip(token_ids, entries)]
        offsets = list(accumulate(map(len, tokens), initial=text_offset))[:-1]
        token_logprobs = [None if e is None else e.logprob for e in entries]
        top_logprobs = [None if e is None else {t.token: t.logprob for t in e.top_logprobs}
                        for e in entries]
        return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs,
                                  top_logprobs=top_logprobs, text_offset=offsets)

    def entry(self, token_id: int, lps: dict) -> ChatTokenLogprob:
        # (the sampled token may be below)
        top = sorted((lp.rank, i) for i, lp in lps.items() if lp.rank <= self.k)
        return ChatTokenLogprob(**self.token(token_id, lps[token_id].logprob).model_dump(),
                                top_logprobs=[self.token(i, lps[i].logprob) for _, i in top])

    def token(self, token_id: int, logprob: float) -> TokenLogprob:
        text = self.tokenizer.decode([token_id])
        # JSON has no -inf
        return TokenLogprob(token=text, logprob=max(logprob, -9999.0), bytes=list(text.encode()))
