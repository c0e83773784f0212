"""Verification of draft tokens: exact on greedy rows, distribution-preserving on sampled ones, reproducible."""
import torch

from nanoserve.layers.sampler import Sampler
from nanoserve.layers.sampling_metadata import SamplingMetadata
from nanoserve.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler

V = 8
N = 100_000  # trials of one request each, all in one call
_ = PLACEHOLDER_TOKEN_ID


def one_hot_logits(argmaxes: list[list[int]]) -> torch.Tensor:
    """Rows of logits, request after request, whose argmax is the given token (the others random, lower)."""
    rows = torch.rand(sum(map(len, argmaxes)), V)
    rows[torch.arange(len(rows)), torch.tensor([t for a in argmaxes for t in a])] = 2.0
    return rows


def test_greedy_accepts_the_longest_prefix_matching_the_argmax():
    torch.manual_seed(0)
    argmaxes = [[3, 1, 4, 7], [3, 2, 4, 7], [5], [0, 6], [3, 1, 4, 5], [3, 1, 6, 2]]
    drafts = [[3, 1, 4], [3, 1, 4], [], [2], [2, 1, 4], [3, 1]]
    out = RejectionSampler()(drafts, one_hot_logits(argmaxes).argmax(dim=-1))
    assert out.tolist() == [
        [3, 1, 4, 7],  # all accepted, then the bonus token from the last row
        [3, 2, _, _],  # the second draft differs: the target's own token replaces it, the rest is dropped
        [5, _, _, _],  # no drafts: a plain decode
        [0, _, _, _],  # the first draft rejected
        [3, _, _, _],
        [3, 1, 6, _],  # two drafts, both accepted, and the bonus
    ]
    assert RejectionSampler.parse_output(out) == [[3, 1, 4, 7], [3, 2], [5], [0], [3], [3, 1, 6]]


def test_no_drafts_anywhere_is_a_plain_decode():
    logits = torch.randn(3, V)
    assert RejectionSampler()([[], [], []], logits.argmax(dim=-1)).tolist() == [[t] for t in logits.argmax(-1).tolist()]


def test_greedy_requests_stay_exact_in_a_batch_with_sampled_ones():
    """Mixed batch: the greedy requests get the argmax exactly, whatever the probabilities say."""
    torch.manual_seed(0)
    argmaxes = [[3, 1, 4, 7], [3, 2, 4, 7]] * 50
    logits = one_hot_logits(argmaxes)
    probs = torch.full((len(logits), V), 1 / V)  # uniform: sampled requests would almost never match
    greedy = torch.tensor([True, False] * 50)
    out = RejectionSampler()([[3, 1, 4], [3, 1, 4]] * 50, logits.argmax(dim=-1), probs, greedy)
    assert out[0::2].tolist() == [[3, 1, 4, 7]] * 50


def emit(p_rows: torch.Tensor, draft_token_ids: list[int] | None = None, q_rows: torch.Tensor | None = None,
         n: int = N) -> torch.Tensor:
    """n trials of one request whose target distribution at position j is p_rows[j] (whatever came before),
    with the given n-gram drafts, or drafts drawn from q_rows[j] (a draft model that ignores context too)."""
    k = len(p_rows) - 1
    if q_rows is None:
        drafts, draft_probs = [draft_token_ids] * n, None
    else:
        drafts = torch.stack([torch.multinomial(q, n, replacement=True) for q in q_rows], dim=1).tolist()
        draft_probs = q_rows.repeat(n, 1)
    target_probs = p_rows.repeat(n, 1)
    assert len(drafts[0]) == k
    return RejectionSampler()(drafts, target_probs.argmax(dim=-1), target_probs, torch.zeros(n, dtype=torch.bool),
                              draft_probs=draft_probs)


def max_error(samples: torch.Tensor, p: torch.Tensor) -> float:
    """The largest gap between the empirical and the target distribution, in standard errors of that cell
    (sqrt(p(1 - p) / n)). The bound used below, 5, has a false alarm chance under 1e-5 for 8 cells; a token
    with p = 0 must never appear at all."""
    freq = torch.bincount(samples, minlength=V).double() / len(samples)
    p = p.double()
    se = (p * (1 - p) / len(samples)).sqrt()
    assert not ((p == 0) & (freq > 0)).any(), "a token with probability 0 was emitted"
    return ((freq - p).abs() / se.clamp(min=1e-12)).max().item()


def target_rows(k: int, seed: int) -> torch.Tensor:
    """1 + k processed target distributions over V tokens: temperature 0.8, and the 2 least likely tokens of
    each row removed (top-k = 6), as the sampler would leave them."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1 + k, V, generator=g) * 1.5 / 0.8
    logits = logits.masked_fill(logits < logits.sort(dim=-1).values[:, 2:3], float("-inf"))
    return logits.softmax(dim=-1)


def test_ngram_drafts_keep_the_target_distribution():
    torch.manual_seed(1)
    p = target_rows(k=3, seed=1)
    d0 = int(p[0].argmax())
    drafts = [d0, int(p[1].argmax()), int(p[2].argmin())]  # the last one has probability 0: always rejected
    out = emit(p, drafts)
    assert max_error(out[:, 0], p[0]) < 5  # the first emitted token is distributed as p_0
    second = out[out[:, 0] == d0, 1]  # after the first draft was accepted: as p_1
    assert len(second) > N // 10 and max_error(second, p[1]) < 5
    assert (out[:, 3] == _).all() and (out[:, 2] != _).any()  # the third draft never survives
    # This test can fail: a verifier that redrew from p (not from p without d) after a rejection would emit
    # d0 with probability p(d0) + (1 - p(d0)) p(d0), far beyond 5 standard errors here.
    naive = p[0] * (1 - p[0, d0])
    naive[d0] += p[0, d0]
    assert (naive - p[0]).abs().max() / (0.25 / N) ** 0.5 > 50


def test_draft_model_drafts_keep_the_target_distribution():
    torch.manual_seed(2)
    p = target_rows(k=3, seed=2)
    # A draft half right: half the target's distribution, half noise (also on the tokens the target ruled out,
    # which are then always rejected).
    noise = torch.rand(3, V, generator=torch.Generator().manual_seed(3)) ** 3
    q = 0.5 * p[:3] + 0.5 * noise / noise.sum(dim=-1, keepdim=True)
    out = emit(p, q_rows=q)
    assert max_error(out[:, 0], p[0]) < 5
    second = out[out[:, 1] != _, 1]  # the first draft was accepted (p_1 does not depend on it here)
    assert len(second) > N // 10 and max_error(second, p[1]) < 5
    accepted = (out[:, :3] != _).sum(dim=1) - 1
    expected = (torch.minimum(p[0], q[0])).sum()  # P(accept d0) = sum_x min(p(x), q(x))
    assert abs((accepted >= 1).double().mean() - expected) < 5 * (0.25 / N) ** 0.5


def test_seeded_requests_are_reproducible():
    torch.manual_seed(0)
    p = target_rows(k=2, seed=4).repeat(3, 1)
    drafts = [[1, 2], [3, 4], [5, 6]]

    def run(seeds: list[int | None], global_seed: int) -> list[list[int]]:
        torch.manual_seed(global_seed)
        generators = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
        return [RejectionSampler()(drafts, p.argmax(dim=-1), p, torch.zeros(3, dtype=torch.bool), generators).tolist()
                for _ in range(20)]

    first = run([7, 8, 9], global_seed=0)
    assert run([7, 8, 9], global_seed=123) == first  # the global generator plays no part
    other = run([7, None, 10], global_seed=5)
    assert [r[0] for r in other] == [r[0] for r in first]  # request 0 keeps its own stream
    assert [r[2] for r in other] != [r[2] for r in first]


def test_a_seeded_request_without_drafts_draws_what_the_sampler_draws():
    """Speculation on or off, a seeded request that gets no drafts in a step samples the same token."""
    torch.manual_seed(0)
    logits = torch.randn(64, V)
    temperatures = torch.full((64,), 0.7)
    sampling = SamplingMetadata(temperatures=temperatures, top_ks=None, top_ps=None, min_ps=None,
                                generators=[torch.Generator().manual_seed(i) for i in range(64)])
    plain = Sampler()(logits, sampling)
    probs = (logits / temperatures[:, None]).softmax(dim=-1)
    verified = RejectionSampler()([[]] * 64, logits.argmax(dim=-1), probs, None,  # None: no request is greedy
                                  [torch.Generator().manual_seed(i) for i in range(64)])
    assert verified[:, 0].tolist() == plain.tolist()
