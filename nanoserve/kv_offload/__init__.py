"""The prefix cache's second tier (vLLM's --kv-offloading-size, SGLang's hierarchical cache): a cached block the
device pool evicts keeps its KV in host memory, under the same hash; a prompt whose prefix the device misses finds
the rest here and copies it back into fresh device blocks instead of recomputing it (docs/kv_offload.md).

It plugs in at the kv_cache_tier seam (engine/seams.py): the BlockManager calls `offload` when it hands out a free
block that is still cached, `lookup` and `load` on a prefix miss. This file keeps the host tier's books (which hash
each host block holds, least recently used first); the KV itself lives in each rank's host pool (host_kv_pool.py, under
"kv_offloading_size"), and the copies ride in the step's plan (SchedulerOutput.blocks_to_offload, blocks_to_load,
taken in at the after_schedule seam), run before the forward (move_kv), one block at a time: a failed copy costs
only its block.
A failed load fails exactly the requests holding its block (before_update); `forget_failed` (after_step) drops the
host blocks whose copies failed.
"""
import weakref
from collections import OrderedDict

from nanoserve.engine.core import EngineCore
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.output_processor import EngineCoreOutput
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.engine.stats import SchedulerStats
from nanoserve.host_kv_pool import allocate_host_pool, copy_host_blocks


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
        self.lost_blocks: set[int] = set()  # host blocks whose offload failed: they hold no KV until one succeeds
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

    def take_copies(self, out: SchedulerOutput) -> None:
        """The after_schedule seam: the step's copies join its plan, out to the host (device, host) and back in
        (host, device); the books reset."""
        out.blocks_to_offload, out.blocks_to_load = self.blocks_to_offload, self.blocks_to_load
        self.blocks_to_offload, self.blocks_to_load, self.pinned = [], [], set()

    def move(self, out: SchedulerOutput, executor, way: str) -> None:
        """The move_kv seam: the step's offloads (out), then its loads (in), on every rank; the ones that failed
        go back with the plan (rank 0's say: a worker whose copy fails raises, as on any failure)."""
        if way == "out" and out.blocks_to_offload:
            out.failed_offloads = executor.call("apply", copy_tier_blocks, out.blocks_to_offload, True,
                                                self.lost_blocks)
        elif way == "in" and out.blocks_to_load:
            out.failed_loads = executor.call("apply", copy_tier_blocks, out.blocks_to_load, False, self.lost_blocks)


def copy_tier_blocks(runner: ModelRunner, mapping: list[tuple[int, int]], offloading: bool,
                     lost_blocks: set[int]) -> dict[tuple[int, int], Exception]:
    """On a rank (ModelRunner.apply): the host tier's copies, one block at a time, so that one that fails costs
    only its own block: the tier holds copies of cache entries. A host block whose offload failed holds nothing
    to load until an offload fills it. Returns the copies that failed, with why."""
    failed = {}
    src, dst = ("device", "kv_offloading_size") if offloading else ("kv_offloading_size", "device")
    for src_id, dst_id in mapping:
        try:
            if not offloading and src_id in lost_blocks:
                raise RuntimeError(f"host block {src_id} holds no KV: copying it out failed")
            copy_host_blocks(runner, [(src_id, dst_id)], src, dst)
        except Exception as error:
            if runner.rank != 0:
                raise
            way = "out to" if offloading else "back from"
            failed[src_id, dst_id] = RuntimeError(f"kv_offloading: copying KV {way} host memory failed: {error}")
            if offloading:
                lost_blocks.add(dst_id)
        else:
            if offloading:
                lost_blocks.discard(dst_id)
    return failed


def fail_invalid_blocks(engine: EngineCore, out: SchedulerOutput) -> list[EngineCoreOutput]:
    """The before_update seam: some of the step's loads failed, so the blocks they were to fill hold no valid KV.
    They leave the prefix cache, and exactly the requests whose sequences hold them fail."""
    if not out.failed_loads:
        return []
    invalid = {block_id for _, block_id in out.failed_loads}
    engine.block_manager.uncache(invalid)
    seqs = [seq for seq in engine.scheduler.running if not invalid.isdisjoint(seq.block_table)]
    # Async scheduling: a step planned since may have swapped a holder out (the swap chapter), its bad KV with it.
    swapped_out = {host for planned, _ in getattr(engine, "batch_queue", ()) for device, host in
                   planned.blocks_to_swap_out if device in invalid}
    seqs += [seq for seq in engine.scheduler.queues().get("swapped", ())
             if not swapped_out.isdisjoint(seq.block_table)]
    return engine.fail(seqs, next(iter(out.failed_loads.values())))


def plug_in(engine: EngineCore) -> HostKVTier:
    """Give every rank a host pool of kv_offloading_size GiB (not shared with the swap pool: docs/kv_offload.md
    says why) and the engine a host tier with its books."""
    num_blocks = engine.executor.call("apply", allocate_host_pool, "kv_offloading_size",
                                      engine.config.kv_offload_config.kv_offloading_size)
    tier = HostKVTier(num_blocks, engine.scheduler.stats)
    weak = weakref.proxy(engine)  # (the engine owns its seams: a strong reference back would keep it alive)
    engine.seams.kv_cache_tier = tier
    engine.seams.after_schedule.append(tier.take_copies)
    engine.seams.move_kv.append(tier.move)
    engine.seams.before_update.append(lambda out: fail_invalid_blocks(weak, out))
    engine.seams.after_step.append(tier.forget_failed)
    return tier
