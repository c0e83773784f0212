"""Verification of draft tokens (speculative decoding): the sampler's sibling, one call per step.

Request i proposed k_i draft tokens d_1..d_k and the target model computed, in one forward, the
logits of its 1 + k_i positions: row j holds the target's distribution p_j for the token after
d_1..d_j. The drafts are accepted left to right; at the first one rejected the target's own choice
replaces it, and if all are accepted row k_i gives one more token (the bonus). So a step emits
between 1 and k_i + 1 tokens.

Greedy: d_j is accepted while it equals the target's argmax, the output is then exactly the target's
greedy tokens. Sampled (Leviathan et al. 2023, Chen et al. 2023): d_j, drawn from the draft's q_j,
is accepted with probability min(1, p_j(d_j) / q_j(d_j)); on rejection the replacement is drawn from
max(0, p_j - q_j), normalised. Each emitted token is then distributed exactly as p_j: speculation
changes the speed, never the output distribution. N-gram drafts have no distribution: q_j is all
mass on d_j (so accept with p_j(d_j)).
"""
import torch
from torch import nn

# A verification row past a request's emitted run: the sampler emitted nothing there.
PLACEHOLDER_TOKEN_ID = -1


class RejectionSampler(nn.Module):
    def forward(self, draft_token_ids: list[list[int]], target_argmax: torch.Tensor,
                target_probs: torch.Tensor | None = None, greedy: torch.Tensor | None = None,
                generators: list[torch.Generator | None] | None = None,
                draft_probs: torch.Tensor | None = None) -> torch.Tensor:
        """The emitted tokens, one row per request: [num_requests, 1 + max k],
        PLACEHOLDER_TOKEN_ID-padded.

        Rows of the 1 + k_i positions of each request, request after request (sum(1 + k_i) rows in
        all):
        - target_argmax: each row's greedy token (the sampler's argmax, after penalties).
        - target_probs: each row's processed distribution, what the sampler would draw from (after
          penalties, temperature, min_p, top-k, top-p); None when every request is greedy
          (temperatures None).
        greedy: [num_requests] bool, which requests are greedy (temperature 0); None: none is (with
        target_probs).
        generators: one per request, None for an unseeded one (they draw from the global generator).
        draft_probs: [sum k_i, vocab] the draft distributions q_j the drafts were drawn from; None:
        n-gram.
        """
        device = target_argmax.device
        ks = [len(d) for d in draft_token_ids]  # (known on the host: no wait for the device)
        num_requests, max_k = len(ks), max(ks, default=0)
        num_drafts = torch.tensor(ks, device=device)
        drafts = torch.zeros(num_requests, max_k, dtype=torch.int64)
        for i, d in enumerate(draft_token_ids):
            drafts[i, : len(d)] = torch.tensor(d, dtype=torch.int64)
        drafts = drafts.to(device)
        pos = torch.arange(max_k + 1, device=device)
        # [num_requests, max_k]: a real draft, not padding
        is_draft = pos[:max_k] < num_drafts[:, None]
        # rows[i, j]: the row of request i's position j (past its k_i: its last row, masked out
        # anyway).
        first_row = torch.cumsum(num_drafts + 1, dim=0) - num_drafts - 1
        rows = first_row[:, None] + torch.minimum(pos, num_drafts[:, None])
        argmax = target_argmax[rows]
        # Draft j of request i: row first_row[i] - i + j of draft_probs (k_i rows per request, not
        # 1 + k_i).
        first_draft = first_row - torch.arange(num_requests, device=device)
        q_rows = (first_draft[:, None] + pos[:max_k]).clamp(
            max=max(0 if draft_probs is None else len(draft_probs) - 1, 0))

        accepted = is_draft & (drafts == argmax[:, :max_k])  # greedy
        if target_probs is not None:
            uniform, noise = self._random(ks, target_probs.shape[1], generators, device)
            p_draft = target_probs[rows[:, :max_k], drafts]
            q_draft = 1.0 if draft_probs is None else draft_probs[q_rows, drafts]
            # Accept with probability min(1, p/q): u < p/q, written without dividing by a q that may
            # be 0.
            sampled_accepted = is_draft & (uniform * q_draft < p_draft)
            accepted = (sampled_accepted if greedy is None
                        else torch.where(greedy[:, None], accepted, sampled_accepted))
        num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # up to the first rejection
        last = num_accepted[:, None]  # the position of the token the target adds
        final = argmax.gather(1, last).squeeze(1)  # greedy: its argmax there
        if target_probs is not None:
            p = target_probs[rows.gather(1, last).squeeze(1)]
            if max_k:  # at a rejected draft d: draw from max(0, p - q), normalised, instead of p
                at = last.clamp(max=max_k - 1)
                if draft_probs is None:  # n-gram: all of q's mass on d
                    q = torch.zeros_like(p).scatter_(1, drafts.gather(1, at), 1.0)
                else:
                    q = draft_probs[q_rows.gather(1, at).squeeze(1)]
                residual = (p - q).clamp(min=0)
                # (All zero only when p equals q, and then no draft is ever rejected: a rounding
                # guard.)
                residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p)
                p = torch.where((num_accepted < num_drafts)[:, None], residual, p)
            # Gumbel-max as in the sampler: argmax(p / Exp(1) noise) is a draw from p normalised.
            sampled = (p / noise).argmax(dim=1)
            final = sampled if greedy is None else torch.where(greedy, final, sampled)

        out = torch.where(pos[:max_k] < last, drafts, PLACEHOLDER_TOKEN_ID)
        out = torch.cat([out, torch.full_like(final[:, None], PLACEHOLDER_TOKEN_ID)], dim=1)
        return out.scatter(1, last, final[:, None])

    @staticmethod
    def _random(num_drafts: list[int], vocab_size: int,
                generators: list[torch.Generator | None] | None,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """A uniform per draft (accept or not) and one Exp(1) noise row per request: only one token
        per request is ever drawn, whichever position it lands at. A seeded request takes its k
        uniforms then its noise from its own generator, so it is reproducible whatever else runs;
        with no drafts it draws exactly what the sampler would."""
        uniform = torch.rand(len(num_drafts), max(num_drafts, default=0), device=device)
        noise = torch.empty(len(num_drafts), vocab_size, device=device).exponential_()
        for i, generator in enumerate(generators or []):
            if generator is not None:
                if num_drafts[i]:
                    draws = torch.rand(num_drafts[i], generator=generator)
                    uniform[i, : num_drafts[i]] = draws.to(device)
                noise[i] = torch.empty(vocab_size).exponential_(generator=generator).to(device)
        return uniform, noise

    @staticmethod
    def parse_output(output_token_ids: torch.Tensor) -> list[list[int]]:
        """Each request's emitted tokens as a list (on the host): its row without the
        placeholders."""
        return [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in output_token_ids.tolist()]
