import torch
from torch import nn


class Sampler(nn.Module):
    """Turns each row of logits into one token: greedy where temperature is 0, else sampled."""

    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
                top_ps: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        if (temperatures == 0).all():
            return greedy
        logits = logits / temperatures.clamp(min=1e-5).unsqueeze(1)
        logits = self._apply_top_k_top_p(logits, top_ks, top_ps)
        probs = torch.softmax(logits, dim=-1)
        # Gumbel-max trick: argmax(p / Exp(1) noise) is a sample from p, with no sync for multinomial.
        noise = torch.empty_like(probs).exponential_()
        for i, generator in enumerate(generators):
            if generator is not None:  # a seeded request draws its own reproducible noise
                noise[i] = torch.empty(probs.shape[1]).exponential_(generator=generator).to(probs.device)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(temperatures == 0, greedy, sampled)

    @staticmethod
    def _apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
        """Mask (to -inf) every token outside the row's top_k, then outside its top_p nucleus."""
        vocab_size = logits.shape[1]
        if (top_ks >= vocab_size).all() and (top_ps >= 1).all():
            return logits
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab_size, device=logits.device)
        drop = rank[None, :] >= top_ks[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Drop a token when the more likely ones before it already reach top_p (the first always stays).
        drop |= (probs.cumsum(dim=-1) - probs) >= top_ps[:, None]
        return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
