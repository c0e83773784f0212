from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Prompt lookup: text that repeats itself (code edits, summaries, quotes) is guessed from its
    own past.

    Of the request's latest n tokens (n from prompt_lookup_max down to prompt_lookup_min, longest
    first), find the earliest place they occurred before, and propose the up to k tokens that
    followed there. The earliest place is vLLM's choice: it has the most tokens after it. No model,
    no torch: a few numpy passes per request.
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, token_id_lists: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        """Up to k draft tokens for each request's tokens (prompt + output); [] where nothing
        matches."""
        return [self.propose_one(np.asarray(token_ids), k) for token_ids in token_id_lists]

    def propose_one(self, tokens: np.ndarray, k: int) -> list[int]:
        # Grow the match one token leftwards at a time. `ends` holds the positions e where an
        # earlier occurrence of the latest n tokens ends (e < last: the suffix itself does not
        # count).
        last = len(tokens) - 1
        ends = (np.flatnonzero(tokens[:last] == tokens[last]) if last > 0
                else np.empty(0, dtype=np.int64))
        n = 1
        while ends.size and n < self.prompt_lookup_max:
            longer = ends[ends >= n]  # room for one more token before the occurrence
            longer = longer[tokens[longer - n] == tokens[last - n]]
            if not longer.size:
                break
            ends, n = longer, n + 1
        if not ends.size or n < self.prompt_lookup_min:
            return []
        start = ends[0] + 1  # the earliest occurrence of the longest match
        return tokens[start : start + k].tolist()
