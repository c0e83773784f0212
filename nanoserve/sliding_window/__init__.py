"""Sliding-window attention (Mistral, windowed Qwen2): the blocks behind the window go back to the
pool.

The attention itself is the core's: models/qwen3.py reads each layer's window (sliding_windows) and
every backend attends to the last `sliding_window` positions (layers/attention.py). This chapter is
the block manager's part, a subclass of the core's BlockManager that nanoserve/chapters.py builds
when every layer is windowed. With full layers too (a hybrid Qwen2) one block table serves every
layer and the full layers read every block, so nothing is freed: the core's BlockManager stays
(docs/sliding_window.md says what vLLM's hybrid manager does).
"""
from collections.abc import Callable
from functools import partial

from nanoserve.config import Config, sliding_windows
from nanoserve.sliding_window.block_manager import NULL_BLOCK, SlidingWindowBlockManager

__all__ = ["NULL_BLOCK", "SlidingWindowBlockManager", "frees_blocks", "window_block_manager"]


def frees_blocks(config: Config) -> int:
    """The window behind which blocks can be freed: the largest layer's, when every layer (the draft
    model's too) is windowed; else 0."""
    windows = sliding_windows(config.hf_config)
    if config.draft_hf_config is not None:
        windows += sliding_windows(config.draft_hf_config)
    return max(windows) if all(windows) else 0


def window_block_manager(
        config: Config,
        block_manager_class: type[SlidingWindowBlockManager] = SlidingWindowBlockManager,
) -> Callable[..., SlidingWindowBlockManager] | None:
    """The class of both pools (the device's and the swap pool), with the window, when every layer
    is windowed (block_manager_class: a subclass with chapters, nanoserve/chapters.py); else None (a
    hybrid model: the core's BlockManager)."""
    window = frees_blocks(config)
    if not window:
        return None
    if config.kv_offload_config is not None:
        raise ValueError("kv_offloading_size: the prefix cache's host tier is not built for a "
                         "sliding window (its hits would have to follow the window's rule); set "
                         "kv_offloading_size=0")
    if config.kv_transfer_config is not None:
        raise ValueError("kv_transfer_config: disaggregated prefill moves whole prompts' blocks, "
                         "not built for blocks freed behind a sliding window "
                         "(disable_sliding_window=True runs full attention instead)")
    return partial(block_manager_class, sliding_window=window,
                   max_num_batched_tokens=config.max_num_batched_tokens)
