"""The prefix cache's second tier (vLLM's --kv-offloading-size, SGLang's hierarchical cache): a
cached block the device pool evicts keeps its KV in host memory, under the same hash; a prompt whose
prefix the device misses finds the rest here and copies it back into fresh device blocks instead of
recomputing it (docs/kv_offload.md).

The chapter is four subclasses of the core's parts, each inert unless config.kv_offload_config is
set. HostTierBlockManager keeps the device pool's side (an evicted cached block moves down, a prefix
the device misses is looked up here); HostTierScheduler hands the step's copies to its plan (a
HostTierSchedulerOutput); HostTierExecutor runs them before the forward, one block at a time (a
failed copy costs only its block); HostTierEngineCore gives every rank its host pool
(host_kv_pool.py, under "kv_offloading_size") and the tier its books (HostKVTier: which hash each
host block holds, least recently used first). After a step it fails exactly the requests a failed
load left without KV, and forgets the host blocks whose copies failed.
"""
from collections import OrderedDict
from dataclasses import dataclass, field

from nanoserve.config import Config
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.core import EngineCore
from nanoserve.engine.model_runner import Executor, ModelRunner
from nanoserve.engine.output_processor import EngineCoreOutput
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.sequence import Sequence
from nanoserve.engine.stats import SchedulerStats
from nanoserve.host_kv_pool import allocate_host_pool, copy_host_blocks


@dataclass
class HostTierSchedulerOutput(SchedulerOutput):
    """The plan with the host tier's copies: out to the host (device block, host block) and back in
    (host, device); the executor writes those that failed, with why (a failed load's device block
    holds no valid KV)."""

    blocks_to_offload: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_load: list[tuple[int, int]] = field(default_factory=list)
    failed_offloads: dict[tuple[int, int], Exception] = field(default_factory=dict)
    failed_loads: dict[tuple[int, int], Exception] = field(default_factory=dict)


class HostKVTier:
    """The host tier's books: num_blocks host blocks, each either free or holding one block's KV
    under its hash. Inclusive: a block copied back keeps its host copy, so evicting it again costs
    no copy."""

    def __init__(self, num_blocks: int, stats: SchedulerStats):
        self.num_blocks = num_blocks
        # hash -> (host block, tokens): LRU first
        self.cached: OrderedDict[int, tuple[int, list[int]]] = OrderedDict()
        self.free_block_ids = list(range(num_blocks))
        # Host blocks this step's copies read or write (and hits the step may still load): none is
        # reused before the step's copies have run, so a copy never reads a block another copy of
        # the same step overwrites.
        self.pinned: set[int] = set()
        self.blocks_to_offload: list[tuple[int, int]] = []
        self.blocks_to_load: list[tuple[int, int]] = []
        self.stats = stats

    def offload(self, block_id: int, block_hash: int, token_ids: list[int]) -> None:
        """The device is about to reuse block_id, cached under block_hash: copy its KV to a host
        block."""
        if block_hash in self.cached:
            # already here (loaded from here, or offloaded before): its KV is the same
            self.cached.move_to_end(block_hash)
            return
        host_id = self._free_host_block()
        if host_id is None:
            # every host block is in this step's copies: the KV is dropped, as without a tier
            return
        self.cached[block_hash] = (host_id, list(token_ids))
        self.pinned.add(host_id)
        self.blocks_to_offload.append((block_id, host_id))
        self.stats.num_offloaded_blocks += 1

    def _free_host_block(self) -> int | None:
        """A free host block, else the least recently used one outside this step's copies (LRU
        eviction)."""
        if self.free_block_ids:
            return self.free_block_ids.pop()
        victim = next((h for h, (host_id, _) in self.cached.items() if host_id not in self.pinned),
                      None)
        return None if victim is None else self.cached.pop(victim)[0]

    def lookup(self, block_hash: int, token_ids: list[int]) -> bool:
        """Is the block here, verified token by token? A hit stays put until the step's copies are
        taken."""
        entry = self.cached.get(block_hash)
        if entry is None or entry[1] != token_ids:
            return False
        self.pinned.add(entry[0])
        return True

    def load(self, block_hash: int, block_id: int) -> None:
        """Copy the host block cached under block_hash into device block block_id (a hit: most
        recently used)."""
        self.cached.move_to_end(block_hash)
        self.blocks_to_load.append((self.cached[block_hash][0], block_id))
        self.stats.num_loaded_blocks += 1
        self.stats.num_host_cached_tokens += len(self.cached[block_hash][1])

    def forget_failed(self, out: HostTierSchedulerOutput) -> None:
        """A host block whose copy failed, out or back in, is not trusted: its entry goes (the copy
        was all that a failed offload cost)."""
        for host_id in [h for _, h in out.failed_offloads] + [h for h, _ in out.failed_loads]:
            block_hash = next((bh for bh, (h, _) in self.cached.items() if h == host_id), None)
            if block_hash is not None:
                del self.cached[block_hash]
                self.free_block_ids.append(host_id)

    def take_copies(self, out: HostTierSchedulerOutput) -> None:
        """The step's copies join its plan, out to the host (device, host) and back in (host,
        device); the books reset."""
        out.blocks_to_offload, out.blocks_to_load = self.blocks_to_offload, self.blocks_to_load
        self.blocks_to_offload, self.blocks_to_load, self.pinned = [], [], set()


def copy_tier_blocks(runner: ModelRunner, mapping: list[tuple[int, int]], offloading: bool,
                     lost_blocks: set[int]) -> dict[tuple[int, int], Exception]:
    """On a rank (ModelRunner.apply): the host tier's copies, one block at a time, so that one that
    fails costs only its own block: the tier holds copies of cache entries. A host block whose
    offload failed holds nothing to load until an offload fills it. Returns the copies that failed,
    with why."""
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
            failed[src_id, dst_id] = RuntimeError(f"kv_offloading: copying KV {way} host memory "
                                                  f"failed: {error}")
            if offloading:
                lost_blocks.add(dst_id)
        else:
            if offloading:
                lost_blocks.discard(dst_id)
    return failed




class HostTierBlockManager(BlockManager):
    """The device pool with the tier below it: evict = move down, miss = look one tier down."""

    host_tier: HostKVTier | None = None  # the tier's books (HostTierEngineCore); None: off

    def evict_cached_block(self, block_id: int) -> None:
        """A cached block handed out for new tokens: its KV is copied to a host block first."""
        block = self.blocks[block_id]
        if self.host_tier is not None and self.hash_to_block_id.get(block.hash) == block_id:
            self.host_tier.offload(block_id, block.hash, block.token_ids)
        super().evict_cached_block(block_id)

    def allocate(self, seq: Sequence, max_new_tokens: int | None = None) -> bool:
        """The blocks the host tier holds past the device's cached prefix count as cached too: each
        gets a fresh device block, loaded before the step's forward, in the prefix cache at once."""
        if self.host_tier is None:
            return super().allocate(seq, max_new_tokens)
        num_device_hits = len(self._cached_prefix(seq))
        host_hashes = self._host_hits(seq, num_device_hits)
        num_host_tokens = len(host_hashes) * self.block_size
        if max_new_tokens is not None:  # (a hit costs no budget)
            max_new_tokens += num_host_tokens
        if not super().allocate(seq, max_new_tokens):
            return False
        for i, block_hash in enumerate(host_hashes, num_device_hits):
            self.cache_block(seq.block_table[i], block_hash, seq.block(i))
            self.host_tier.load(block_hash, seq.block_table[i])
        seq.num_cached_tokens = seq.num_computed_tokens = seq.num_computed_tokens + num_host_tokens
        return True

    def num_offloaded_blocks(self) -> tuple[int, int]:
        if self.host_tier is None:
            return super().num_offloaded_blocks()
        return len(self.host_tier.cached), self.host_tier.num_blocks

    def _host_hits(self, seq: Sequence, start: int) -> list[int]:
        """Hashes of the blocks the host tier holds from block `start` on, in a row."""
        hashes = []
        for i, block_hash in enumerate(self.prefix_hashes(seq)[start:], start):
            if not self.host_tier.lookup(block_hash, seq.block(i)):
                break
            hashes.append(block_hash)
        return hashes


class HostTierScheduler(Scheduler):
    """Plans into a HostTierSchedulerOutput; the copies the plan made join it."""

    output_class = HostTierSchedulerOutput

    def __init__(self, config: Config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.kv_offloading = config.kv_offload_config is not None

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        if self.kv_offloading:  # (a HostTierBlockManager's books)
            self.block_manager.host_tier.take_copies(out)
        return out


class HostTierExecutor(Executor):
    """Runs the tier's copies on every rank before the forward: offloads with the copies that read
    the device pool, loads with those that write it. Those that failed go back with the plan (rank
    0's say: a worker whose copy fails raises, as on any failure)."""

    def __init__(self, config: Config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.kv_offloading = config.kv_offload_config is not None
        self.lost_blocks: set[int] = set()  # host blocks whose offload failed: no KV till one works

    def copy_kv_out(self, out: HostTierSchedulerOutput) -> None:
        if self.kv_offloading and out.blocks_to_offload:
            out.failed_offloads = self.call("apply", copy_tier_blocks, out.blocks_to_offload, True,
                                            self.lost_blocks)
        super().copy_kv_out(out)

    def copy_kv_in(self, out: HostTierSchedulerOutput) -> None:
        if self.kv_offloading and out.blocks_to_load:
            out.failed_loads = self.call("apply", copy_tier_blocks, out.blocks_to_load, False,
                                         self.lost_blocks)
        super().copy_kv_in(out)


class HostTierEngineCore(EngineCore):
    """Gives every rank a host pool of kv_offloading_size GiB (not shared with the swap pool:
    docs/kv_offload.md says why) and the block manager the tier's books; after a step, fails the
    requests its failed loads left without KV."""

    def __init__(self, config: Config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.host_tier: HostKVTier | None = None
        if config.kv_offload_config is None:
            return
        try:  # a host pool too small for a block ends the engine's workers now
            num_blocks = self.executor.call("apply", allocate_host_pool, "kv_offloading_size",
                                            config.kv_offload_config.kv_offloading_size)
        except BaseException:
            self.shutdown()
            raise
        self.host_tier = HostKVTier(num_blocks, self.scheduler.stats)
        self.block_manager.host_tier = self.host_tier

    def _update_from_output(self, out: HostTierSchedulerOutput,
                            token_ids: list[int]) -> list[EngineCoreOutput]:
        if self.host_tier is None:
            return super()._update_from_output(out, token_ids)
        failed = self.fail_invalid_blocks(out)
        self.host_tier.forget_failed(out)
        return failed + super()._update_from_output(out, token_ids)

    def fail_invalid_blocks(self, out: HostTierSchedulerOutput) -> list[EngineCoreOutput]:
        """Some of the step's loads failed, so the blocks they were to fill hold no valid KV. They
        leave the prefix cache, and exactly the requests whose sequences hold them fail."""
        if not out.failed_loads:
            return []
        invalid = {block_id for _, block_id in out.failed_loads}
        self.block_manager.uncache(invalid)
        return self.fail(self.seqs_holding(invalid), next(iter(out.failed_loads.values())))

    def seqs_holding(self, block_ids: set[int]) -> list[Sequence]:
        """The sequences whose KV is in these device blocks: the running ones holding them (where
        swap and async scheduling meet the tier, chapters.py adds those swapped out since)."""
        return [seq for seq in self.scheduler.running if not block_ids.isdisjoint(seq.block_table)]
