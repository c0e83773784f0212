import torch
from torch import nn
from transformers import PretrainedConfig


class RotaryEmbedding(nn.Module):
    """RoPE: rotate each (x1, x2) pair of q and k by an angle proportional to the token's
    position."""

    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
        # One table for all positions, looked up per token; not a parameter, not saved.
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1),
                             persistent=False)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [num_tokens, heads, head_dim], k likewise; positions: [num_tokens]."""
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


def rope_theta(config: PretrainedConfig) -> float:
    """transformers 5 moved rope_theta into rope_parameters; older configs keep it at the top
    level."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope type {rope_type!r} is not supported; only 'default' RoPE is")
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
