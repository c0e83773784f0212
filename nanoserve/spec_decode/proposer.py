"""Who gets drafts for the next step, and how many (docs/speculative.md, "The path through the
engine")."""
from collections.abc import Callable, Iterable

import numpy as np

from nanoserve.engine.sequence import Sequence
from nanoserve.spec_decode.accounting import num_spec_tokens_allowed
from nanoserve.spec_decode.ngram_proposer import NgramProposer
from nanoserve.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID
from nanoserve.speculative_config import SpeculativeConfig


def propose_drafts(running: Iterable[Sequence], spec: SpeculativeConfig,
                   grammar: Callable[[Sequence], object] | None = None) -> None:
    """Before a step is planned (SpecDecodeScheduler.schedule): set each running sequence's
    spec_token_ids, the drafts it will verify. Only a sequence about to decode gets drafts (not one
    still prefilling its prompt), at most as many as its max_tokens leave room for; none at all in a
    batch past disable_by_batch_size. N-gram lookup proposes them here; a draft model only holds
    their places (PLACEHOLDER_TOKEN_ID): it runs once the step is scheduled, in the KV slots the
    scheduler reserved for them (draft_model_proposer.py). grammar: a sequence's grammar matcher,
    or None (structured outputs)."""
    running = list(running)
    ngram = (NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
             if spec.method == "ngram" else None)
    enabled = spec.enabled_for(len(running))
    for seq in running:
        matcher = None if grammar is None else grammar(seq)
        if seq.num_output_placeholders:
            # async scheduling: a step in flight computes it (and keeps its drafts)
            continue
        k = num_spec_tokens_allowed(spec.num_speculative_tokens, seq.num_completion_tokens,
                                    seq.sampling_params.max_tokens)
        # (A grammar keeps the n-gram drafts it allows; a draft model's drafts are drawn
        # unmasked, so a grammar-constrained request takes none of them. A beam's are dropped:
        # beam_search/scheduler.py.)
        decoding = (seq.num_computed_tokens == len(seq.token_ids) - 1
                    and (ngram is not None or matcher is None))
        if not (enabled and decoding and k):
            seq.spec_token_ids = []
        elif ngram is not None:
            seq.spec_token_ids = ngram.propose_one(np.asarray(seq.token_ids), k)
            if matcher is not None:
                seq.spec_token_ids = matcher.valid_drafts(seq.spec_token_ids)
        else:
            seq.spec_token_ids = [PLACEHOLDER_TOKEN_ID] * k
