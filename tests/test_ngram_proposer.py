"""Prompt lookup: exact proposals on hand-made token lists."""
import numpy as np
import pytest

from nanoserve.spec_decode.ngram_proposer import NgramProposer


def propose(tokens: list[int], k: int, lookup_min: int = 1, lookup_max: int = 5) -> list[int]:
    return NgramProposer(lookup_min, lookup_max).propose([tokens], k)[0]


def test_vllm_docstring_example():
    # [4, 2, 3] occurs nowhere earlier; [2, 3] does, followed by 4, 2, 3 (only 3 tokens left before the end).
    assert propose([1, 2, 3, 4, 2, 3], k=4, lookup_min=2, lookup_max=3) == [4, 2, 3]


def test_longest_suffix_wins_over_an_earlier_shorter_one():
    tokens = [2, 3, 8, 1, 2, 3, 9, 1, 2, 3]
    assert propose(tokens, k=3, lookup_max=3) == [9, 1, 2]  # [1, 2, 3] matched at position 3
    assert propose(tokens, k=3, lookup_max=2) == [8, 1, 2]  # [2, 3] first at position 0


def test_earliest_occurrence_of_the_longest_suffix():
    tokens = [5, 6, 7, 5, 6, 8, 5, 6]
    assert propose(tokens, k=2) == [7, 5]  # [5, 6] at 0 and 3: the earliest (vLLM's choice), not [8, 5]


def test_prompt_lookup_min_rejects_short_matches():
    tokens = [1, 2, 3, 9, 9, 2, 3]
    assert propose(tokens, k=2, lookup_min=2) == [9, 9]
    assert propose(tokens, k=2, lookup_min=3) == []


def test_occurrence_may_overlap_the_suffix():
    assert propose([1, 1, 1, 1], k=3, lookup_min=2, lookup_max=2) == [1, 1]  # [1, 1] at 0; 2 tokens follow
    assert propose([7, 1, 1, 1], k=3, lookup_min=1, lookup_max=3) == [1]  # [1, 1] at 1, followed by the last 1


def test_no_proposal_cases():
    assert propose([], k=3) == []
    assert propose([4], k=3) == []
    assert propose([1, 2, 3, 4], k=3) == []  # nothing repeats
    assert propose([1, 2, 1], k=0) == []


def test_batch_keeps_order_and_takes_lists_or_arrays():
    proposer = NgramProposer(1, 3)
    batch = [[1, 2, 3, 1, 2], np.array([9, 9]), [5, 6]]
    assert proposer.propose(batch, 2) == [[3, 1], [9], []]


@pytest.mark.parametrize("seed", range(20))
def test_matches_a_brute_force_search(seed):
    """Against the definition, on random short token lists over a tiny vocabulary (many repeats)."""
    rng = np.random.default_rng(seed)
    lookup_min, lookup_max = sorted(rng.integers(1, 5, size=2).tolist())
    proposer = NgramProposer(lookup_min, lookup_max)
    for _ in range(50):
        tokens = rng.integers(0, 3, size=rng.integers(0, 30)).tolist()
        expected = []
        for n in range(lookup_max, lookup_min - 1, -1):
            starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == tokens[len(tokens) - n :]]
            if n <= len(tokens) and starts:
                expected = tokens[starts[0] + n : starts[0] + n + 4]
                break
        assert proposer.propose([tokens], 4) == [expected], tokens
