"""Sampler unit tests on hand-made logits."""
import torch

from nanoserve.layers.sampler import Sampler
from nanoserve.layers.sampling_metadata import SamplingMetadata

PROBS = [0.5, 0.3, 0.15, 0.05]
N = 2000  # draws: one row per draw, in one call


def sample(logits, temperature=1.0, top_k=None, top_p=1.0, generators=None, min_p=0.0) -> torch.Tensor:
    """Sample each row; scalars apply to every row. top_k=None keeps the whole vocabulary."""
    n, vocab = logits.shape

    def per_row(x, dtype):
        return torch.as_tensor(x, dtype=dtype).expand(n).clone()

    return Sampler()(logits, SamplingMetadata(
        temperatures=per_row(temperature, torch.float32), top_ks=per_row(top_k or vocab, torch.int64),
        top_ps=per_row(top_p, torch.float32), min_ps=per_row(min_p, torch.float32),
        generators=generators or [None] * n))


def options(temperatures=None, top_ks=None, top_ps=None, min_ps=None) -> SamplingMetadata:
    return SamplingMetadata(temperatures, top_ks, top_ps, min_ps, [None] * N)


def draws(**kwargs) -> set[int]:
    """The tokens sampled in N draws from PROBS."""
    torch.manual_seed(0)
    return set(sample(torch.tensor(PROBS).log().repeat(N, 1), **kwargs).tolist())


def test_temperature_0_is_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 0.0, 0.0, 4.9], [-3.0, -2.0, -1.0, -1.5]])
    assert sample(logits, temperature=0.0).tolist() == [1, 0, 2]
    assert sample(logits, temperature=0.0, top_k=3, top_p=0.1).tolist() == [1, 0, 2]


def test_full_distribution_samples_every_token():
    assert draws() == {0, 1, 2, 3}
    assert draws(top_k=2 ** 63 - 1) == {0, 1, 2, 3}  # the largest top_k SamplingParams takes keeps all


def test_top_k_2_never_leaves_the_two_largest():
    assert draws(top_k=2) == {0, 1}
    assert draws(top_k=1) == {0}


def test_top_p_keeps_the_smallest_nucleus():
    assert draws(top_p=0.7) == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3
    assert draws(top_p=0.5) == {0}  # token 0 alone reaches 0.5
    assert draws(top_p=0.9) == {0, 1, 2}
    assert draws(top_k=3, top_p=0.7) == {0, 1}  # both filters: the stricter one wins


def test_min_p_drops_tokens_below_a_share_of_the_most_likely():
    assert draws(min_p=0.5) == {0, 1}  # kept: p >= 0.5 * 0.5
    assert draws(min_p=0.2) == {0, 1, 2}  # kept: p >= 0.1
    assert draws(min_p=0.2, temperature=0.5) == {0, 1}  # after temperature p is about 0.68, 0.25, 0.06, 0.01


def test_mixed_greedy_and_sampled_rows():
    uniform = torch.zeros(8)
    peaked = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    logits = torch.stack([peaked, uniform] * (N // 2))
    torch.manual_seed(0)
    out = sample(logits, temperature=torch.tensor([0.0, 1.0] * (N // 2)))
    assert set(out[0::2].tolist()) == {5}  # greedy rows: always the argmax
    assert set(out[1::2].tolist()) == set(range(8))  # sampled rows: anything


def test_seeded_generator_is_reproducible():
    logits = torch.zeros(2, 1000)

    def run(seed_a, seed_b, global_seed=0):
        torch.manual_seed(global_seed)
        generators = [torch.Generator().manual_seed(seed_a), torch.Generator().manual_seed(seed_b)]
        return [sample(logits, generators=generators).tolist() for _ in range(5)]

    first = run(1, 2)
    assert run(1, 2, global_seed=99) == first  # the global RNG does not matter
    assert [r[0] for r in run(1, 3)] == [r[0] for r in first]  # row 0 keeps its own stream
    assert run(3, 2) != first


def test_options_no_row_uses_can_be_none():
    """The engine passes None for an option no row uses (temperatures None: all greedy), over many rows."""
    logits = torch.tensor(PROBS).log().repeat(N, 1)
    torch.manual_seed(0)
    assert Sampler()(logits, options()).tolist() == [0] * N
    ones = torch.ones(N)
    assert set(Sampler()(logits, options(ones, top_ps=torch.full((N,), 0.7))).tolist()) == {0, 1}  # top_p alone
    assert set(Sampler()(logits, options(ones, top_ks=torch.full((N,), 3))).tolist()) == {0, 1, 2}  # top_k alone
    assert set(Sampler()(logits, options(ones, min_ps=torch.full((N,), 0.5))).tolist()) == {0, 1}
