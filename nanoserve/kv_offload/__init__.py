"""The prefix cache's second tier (vLLM's --kv-offloading-size, SGLang's hierarchical cache): a cached block the
device pool evicts keeps its KV in host memory, under the same hash; a prompt whose prefix the device misses finds
the rest here and copies it back into fresh device blocks instead of recomputing it (docs/kv_offload.md).

It plugs in at one seam, kv_cache_tier (engine/seams.py): the BlockManager calls `offload` when it hands out a free
block that is still cached, `lookup` and `load` on a prefix miss. This file keeps the host tier's books (which hash
each host block holds, least recently used first); the KV itself lives in each rank's ModelRunner.offload_kv_cache,
and the copies ride in the step's plan (SchedulerOutput.blocks_to_offload, blocks_to_load), run before the forward.
An after_step hook, `forget_failed`, drops the host blocks whose copies failed.
"""
from collections import OrderedDict

from nanoserve.engine.core import EngineCore
from nanoserve.engine.scheduler_output import SchedulerOutput, SchedulerStats


class HostKVTier:
    """The host tier's books: num_blocks host blocks, each either free or holding one block's KV under its hash.
    Inclusive: a block copied back keeps its host copy, so evicting it again costs no copy."""

    def __init__(self, num_blocks: int, stats: SchedulerStats):
        self.num_blocks = num_blocks
        self.cached: OrderedDict[int, tuple[int, list[int]]] = OrderedDict()  # hash -> (host block, tokens): LRU first
        self.free_block_ids = list(range(num_blocks))
        # Host blocks this step's copies read or write (and hits the step may still load): none is reused before
        # the step's copies have run, so a copy never reads a block another copy of the same step overwrites.
        self.pinned: set[int] = set()
        self.blocks_to_offload: list[tuple[int, int]] = []
        self.blocks_to_load: list[tuple[int, int]] = []
        self.stats = stats

    def offload(self, block_id: int, block_hash: int, token_ids: list[int]) -> None:
        """The device is about to reuse block_id, cached under block_hash: copy its KV to a host block."""
        if block_hash in self.cached:  # already here (loaded from here, or offloaded before): its KV is the same
            self.cached.move_to_end(block_hash)
            return
        host_id = self._free_host_block()
        if host_id is None:  # every host block is in this step's copies: the KV is dropped, as without a tier
            return
        self.cached[block_hash] = (host_id, list(token_ids))
        self.pinned.add(host_id)
        self.blocks_to_offload.append((block_id, host_id))
        self.stats.num_offloaded_blocks += 1

    def _free_host_block(self) -> int | None:
        """A free host block, else the least recently used one outside this step's copies (LRU eviction)."""
        if self.free_block_ids:
            return self.free_block_ids.pop()
        victim = next((h for h, (host_id, _) in self.cached.items() if host_id not in self.pinned), None)
        return None if victim is None else self.cached.pop(victim)[0]

    def lookup(self, block_hash: int, token_ids: list[int]) -> bool:
        """Is the block here, verified token by token? A hit stays put until the step's copies are taken."""
        entry = self.cached.get(block_hash)
        if entry is None or entry[1] != token_ids:
            return False
        self.pinned.add(entry[0])
        return True

    def load(self, block_hash: int, block_id: int) -> None:
        """Copy the host block cached under block_hash into device block block_id (a hit: most recently used)."""
        self.cached.move_to_end(block_hash)
        self.blocks_to_load.append((self.cached[block_hash][0], block_id))
        self.stats.num_loaded_blocks += 1
        self.stats.num_host_cached_tokens += len(self.cached[block_hash][1])

    def forget_failed(self, out: SchedulerOutput, updated: dict) -> list:
        """An after_step hook: a host block whose copy failed, out or back in, is not trusted; its entry goes (the
        copy was all that a failed offload cost). The core has failed the requests a failed load left without KV."""
        for host_id in [h for _, h in out.failed_offloads] + [h for h, _ in out.failed_loads]:
            block_hash = next((bh for bh, (h, _) in self.cached.items() if h == host_id), None)
            if block_hash is not None:
                del self.cached[block_hash]
                self.free_block_ids.append(host_id)
        return []

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's copies, for its plan: out to the host (device, host) and back in (host, device)."""
        copies = self.blocks_to_offload, self.blocks_to_load
        self.blocks_to_offload, self.blocks_to_load, self.pinned = [], [], set()
        return copies


def plug_in(engine: EngineCore) -> HostKVTier:
    """Give the engine a host tier as large as its model runner's offload pool (kv_offloading_size GiB)."""
    tier = HostKVTier(engine.model_runner.num_offload_blocks, engine.scheduler.stats)
    engine.seams.kv_cache_tier = tier
    engine.seams.after_step.append(tier.forget_failed)
    return tier
