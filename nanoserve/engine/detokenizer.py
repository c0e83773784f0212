from nanoserve.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """One request's output text, token by token, and its stop strings (vLLM's semantics).

    Byte-level BPE splits a character like an emoji over several tokens, and decoding a token alone can give
    the wrong text (a broken character, a missing space). So each step decodes a short window: the tokens since
    `prefix_offset`, minus the text those before `read_offset` already gave; text that ends in a broken
    character (U+FFFD) waits for the next token. The pieces concatenate to the text of decoding all at once.
    """

    def __init__(self, tokenizer, params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.token_ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.text = ""
        self.num_sent = 0  # characters of text already handed out
        # Without include_stop_str_in_output, the tail that may turn out to begin a stop string is held back.
        longest = max(map(len, params.stop), default=0)
        self.hold_back = 0 if params.include_stop_str_in_output else max(longest - 1, 0)

    def update(self, token_id: int, finished: bool) -> str | None:
        """Take in a new token (the last one if finished); returns the stop string its text completes, if any
        (the text is cut there)."""
        self.token_ids.append(token_id)
        new_text = self._decode_new(flush=finished)
        self.text += new_text
        if not new_text or len(self.token_ids) <= self.params.min_tokens:
            return None
        for stop in self.params.stop:
            # Only where the new text can complete it: the match may begin in earlier tokens' text.
            i = self.text.find(stop, max(len(self.text) - len(new_text) - len(stop) + 1, 0))
            if i != -1:
                self.text = self.text[: i + len(stop) if self.params.include_stop_str_in_output else i]
                return stop
        return None

    def _decode_new(self, flush: bool) -> str:
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        prefix_text = decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not flush):
            return ""  # no new text yet, or a character still incomplete
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text) :]

    def get_delta(self, finished: bool) -> str:
        """The text not handed out yet (all of it once finished)."""
        end = len(self.text) if finished else max(len(self.text) - self.hold_back, self.num_sent)
        delta, self.num_sent = self.text[self.num_sent : end], end
        return delta
