"""Host pools of KV blocks, for the chapters that keep KV in host memory: swap (scheduling/swap.py)
and the host tier (kv_offload/). Each runs on every rank (`executor.call("apply", ...)`,
ModelRunner.apply): every rank holds its own shard of the KV, so every rank has its own pools, in
`runner.kv_pools` by the option's name.

A pool is block first, [blocks, 2, layers, block_size, kv_heads, head_dim]: a block's KV, K and V of
every layer, is one piece of host memory, so a block's copy is one transfer, not 2 x layers small
ones. On CUDA the pool is page-locked and the copies run on a side stream (copy_host_blocks),
without the host waiting for them."""
import torch

from nanoserve.engine.model_runner import ModelRunner


def allocate_host_pool(runner: ModelRunner, name: str, gib: float) -> int:
    """runner.kv_pools[name]: KV blocks in `gib` GiB of host memory, block first, page-locked on
    CUDA, for a chapter named by its option (swap_space, kv_offloading_size). Returns how many."""
    num_blocks = runner.fewest_on_any_rank(int(gib * 2**30) // runner.block_bytes())
    if num_blocks < 1:
        raise ValueError(f"{name} ({gib} GiB) is too small for one KV block "
                         f"({runner.block_bytes()} bytes)")
    kv_cache = runner.kv_cache
    shape = (num_blocks, *kv_cache.shape[:2], *kv_cache.shape[3:])
    runner.kv_pools[name] = torch.zeros(shape, dtype=kv_cache.dtype,
                                        pin_memory=runner.device.type == "cuda")
    return num_blocks


def copy_host_blocks(runner: ModelRunner, mapping: list[tuple[int, int]], src: str,
                     dst: str) -> None:
    """Copy KV blocks (source, destination) between "device" (the KV cache) and a host pool, by its
    name. On CUDA on a side stream, through events: it starts once the work queued so far has
    written the KV, and the work queued next (the forward that reads or overwrites these blocks)
    waits for it; the host does not."""
    pools = [None if name == "device" else runner.kv_pools[name] for name in (src, dst)]
    if runner.device.type != "cuda":
        return runner.copy_blocks(mapping, *pools)
    compute, side = torch.cuda.current_stream(runner.device), torch.cuda.Stream(runner.device)
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        runner.copy_blocks(mapping, *pools)
    compute.wait_stream(side)
