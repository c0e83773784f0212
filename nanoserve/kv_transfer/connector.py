"""P2pConnector: a KV connector for a pair of engines, with vLLM's KVConnectorBase_V1 methods; the
chapter's subclasses of the core's parts (kv_transfer/__init__.py) call them where vLLM's scheduler
and worker do.

The producer (prefill) side: a request with kv_transfer_params {"do_remote_decode": true} computes
its prompt as any other; in the step that completes the prompt, `build_connector_meta` names its
blocks and their chained hashes, and once the step is done `wait_for_save` copies their KV into
the KVStore (pipe.py), so the blocks are freed as usual (vLLM's request_finished, which holds a
finished request's blocks until they are sent, is not needed).

The consumer (decode) side: a request with {"do_remote_prefill": true} asks the producer, as soon as
it is added, for the prompt blocks it does not hold itself (by chained hash: cached blocks are never
sent again). It waits in the queue until they came (`has_remote_kvs`: vLLM's
WAITING_FOR_REMOTE_KVS); once it has its blocks, `update_state_after_alloc` counts all of the prompt
but its last token as computed (`get_num_new_matched_tokens`), notes which received block goes into
which of its fresh blocks, and `start_load_kv` writes them in before the forward. Its first step
computes the prompt's last token only. A transfer that fails or takes longer than transfer_timeout
is no error: the consumer computes the prompt itself (stats.num_failed_transfers counts it).
"""
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from nanoserve.engine.core import EngineCore
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.engine.sequence import Request, Sequence, compute_hash
from nanoserve.kv_transfer.pipe import KVPipe, KVStore
from nanoserve.kv_transfer_config import KVTransferConfig
from nanoserve.utils.math import cdiv

logger = logging.getLogger("nanoserve.kv_transfer")
PARAMS = ("do_remote_decode", "do_remote_prefill", "remote_host", "remote_port")


@dataclass
class KVTransferStats:
    """What the dashboard shows of the pair at work."""

    num_saved_blocks: int = 0  # producer: prompt blocks whose KV went into the KVStore
    num_received_blocks: int = 0  # consumer: blocks whose KV came from the producer
    # consumer: prompt tokens counted as computed thanks to them (not recomputed)
    num_received_tokens: int = 0
    # consumer: prompts it computed itself (the producer failed or was too slow)
    num_failed_transfers: int = 0


@dataclass
class Pull:
    """A consumer request's blocks on their way: those from block `first` on (the ones before are
    cached here)."""

    future: Future
    first: int
    deadline: float


@dataclass
class ConnectorMetadata:
    """One step's work for the worker side (KVTransferSchedulerOutput.kv_connector_metadata)."""

    # (received KV, device block)
    loads: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    saves: list[tuple[int, int]] = field(default_factory=list)  # (chained hash, device block)


def prompt_block_hashes(seq: Sequence, block_size: int) -> list[int]:
    """The chained hash of each of seq's prompt blocks, the last one too even if partly full (its
    hash covers only its tokens, so it names that partial block's KV exactly)."""
    hashes = seq.block_hashes[: seq.num_prompt_tokens // block_size]
    tail = seq.prompt_token_ids[len(hashes) * block_size :]
    return (hashes + [compute_hash(tail,
                                   hashes[-1] if hashes else seq.hash_root)]) if tail else hashes


def check_params(params: object, config: KVTransferConfig) -> None:
    """A request's kv_transfer_params: a ValueError naming the key, before it is queued."""
    if not isinstance(params, dict) or set(params) - set(PARAMS):
        raise ValueError(f"kv_transfer_params: must be a dict with keys among {list(PARAMS)}, "
                         f"got {params!r}")
    wanted = "do_remote_decode" if config.is_producer else "do_remote_prefill"
    for key in ("do_remote_decode", "do_remote_prefill"):
        if params.get(key) and key != wanted:
            raise ValueError(f"kv_transfer_params.{key}: this engine's kv_role is {config.kv_role}")
    for key, mine in (("remote_host", config.kv_ip), ("remote_port", config.kv_port)):
        if params.get(key) is not None and params[key] != mine:
            raise ValueError(f"kv_transfer_params.{key}: this engine is joined "
                             f"to {config.kv_ip}:{config.kv_port}, not {params[key]!r}")


class P2pConnector:
    """Both sides of the connector, for one engine of the pair (its kv_role says which runs)."""

    def __init__(self, engine: EngineCore, config: KVTransferConfig):
        self.config, self.block_size = config, engine.config.block_size
        self.block_manager, self.requests = engine.block_manager, engine.requests
        # [2, layers, blocks + 1, block_size, kv_heads, head_dim]
        self.kv_cache = engine.model_runner.kv_cache
        self.stats = KVTransferStats()
        self.store = KVStore(config.kv_buffer_size) if config.is_producer else None
        device = self.kv_cache.device
        block_shape = (self.kv_cache.shape[0], self.kv_cache.shape[1], *self.kv_cache.shape[3:])
        self.pipe = KVPipe(config, block_shape, self.kv_cache.dtype, device, self.store)
        self.pulls: dict[str, Pull] = {}  # consumer: request id -> its blocks on their way
        # request id -> (first block, its KV)
        self.received: dict[str, tuple[int, list[torch.Tensor]]] = {}
        self.meta = ConnectorMetadata()  # the step being planned

    # ---- requests ------------------------------------------------------------------------------
    def check_request(self, params: object) -> None:
        """A request's kv_transfer_params, before it is queued."""
        check_params(params, self.config)

    def add_request(self, request: Request) -> None:
        """A consumer's request, just queued, asks for the prompt blocks it lacks, at once."""
        params = request.sampling_params.kv_transfer_params
        seq = request.first_seq
        # (a prompt_logprobs request computes its prompt)
        if not params.get("do_remote_prefill") or seq.sampling_params.prompt_logprobs is not None:
            return
        hashes = prompt_block_hashes(seq, self.block_size)[: cdiv(len(seq) - 1, self.block_size)]
        first = self._num_cached_blocks(seq, hashes)
        if first < len(hashes):
            self.pulls[request.request_id] = Pull(self.pipe.pull(hashes[first:]), first,
                                                  time.monotonic() + self.config.transfer_timeout)

    def _num_cached_blocks(self, seq: Sequence, hashes: list[int]) -> int:
        """How many of seq's first blocks this engine's prefix cache holds (as
        BlockManager._cached_prefix)."""
        for i, block_hash in enumerate(hashes):
            if self.block_manager.cached_block_id(block_hash, seq.block(i)) is None:
                return i
        return len(hashes)

    def has_remote_kvs(self, seq: Sequence, idle: bool) -> bool:
        """A consumer's request waits in the queue, keeping its place, until its blocks came or its
        time ran out (idle: the engine runs nobody else)."""
        pull = self.pulls.get(seq.request_id)
        if pull is None or pull.future.done():
            return True
        if time.monotonic() < pull.deadline:
            if idle:  # nothing else to step for: wait here a little, not spin through empty steps
                try:
                    pull.future.exception(timeout=min(0.05, pull.deadline - time.monotonic()))
                except TimeoutError:
                    pass
            return pull.future.done()
        self._give_up(seq.request_id, TimeoutError(f"no KV after {self.config.transfer_timeout} s"))
        return True

    def _give_up(self, request_id: str, error: BaseException) -> None:
        del self.pulls[request_id]
        self.stats.num_failed_transfers += 1
        logger.warning("request %s: the prompt's KV transfer failed (%s); computing the prompt "
                       "here", request_id, error)

    # ---- the scheduler's side --------------------------------------------------------------------
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        """All of the prompt but its last token, if the received blocks reach from the cached ones
        to there."""
        pull = self.pulls.get(seq.request_id)
        if (pull is None or not pull.future.done()
                or seq is not self.requests[seq.request_id].first_seq):
            return 0
        if pull.future.exception() is not None:
            self._give_up(seq.request_id, pull.future.exception())
            return 0
        del self.pulls[seq.request_id]
        blocks = pull.future.result()
        start = pull.first * self.block_size
        if num_computed_tokens < start:
            # cached blocks were evicted meanwhile: the rest is recomputed from there
            return 0
        end = min(start + len(blocks) * self.block_size, seq.num_prompt_tokens - 1)
        if end <= num_computed_tokens:
            return 0
        self.received[seq.request_id] = (pull.first, blocks)
        return end - num_computed_tokens

    def update_state_after_alloc(self, seq: Sequence) -> None:
        """seq got its blocks (KVTransferBlockManager.allocate): the received ones go into them
        before this step's forward, and count as computed; the full ones join the prefix cache at
        once (as the host tier's loads: their copies run before any forward reads them)."""
        num_local = seq.num_computed_tokens
        num_external = self.get_num_new_matched_tokens(seq, num_local)
        if not num_external:
            return
        first, blocks = self.received.pop(seq.request_id)
        loads = range(num_local // self.block_size, cdiv(num_local + num_external, self.block_size))
        self.meta.loads += [(blocks[i - first], seq.block_table[i]) for i in loads]
        self.block_manager.hash_blocks(seq, num_local, num_local + num_external)
        seq.num_computed_tokens = seq.num_cached_tokens = num_local + num_external
        self.stats.num_received_blocks += len(loads)
        self.stats.num_received_tokens += num_external

    def build_connector_meta(self, out: SchedulerOutput) -> ConnectorMetadata:
        """The planned step's work for the worker side: its loads (noted as requests got their
        blocks) and, on the producer, the blocks of every prompt that this step completes, to save
        after it."""
        meta, self.meta = self.meta, ConnectorMetadata()
        for row in out.rows:
            seq, params = row.seq, row.seq.sampling_params.kv_transfer_params
            ends_prompt = row.start + row.num_tokens == seq.num_prompt_tokens
            if params and params.get("do_remote_decode") and ends_prompt:
                hashes = prompt_block_hashes(seq, self.block_size)
                meta.saves += zip(hashes, seq.block_table)
        for request_id in [r for r in self.pulls if r not in self.requests]:
            # aborted while waiting
            del self.pulls[request_id]
        return meta

    # ---- the worker's side --------------------------------------------------------------------
    def start_load_kv(self, meta: ConnectorMetadata) -> None:
        """Before the forward, with the copies that write the device pool: the received KV into its
        blocks."""
        for kv, block_id in meta.loads:
            self.kv_cache[:, :, block_id] = kv.to(self.kv_cache.device)

    def wait_for_save(self, meta: ConnectorMetadata) -> None:
        """After a step that succeeded: the KV of the prompts it completed, into the KVStore. Their
        blocks may be free by now, but none is written before the next step is planned."""
        for block_hash, block_id in meta.saves:
            self.store.put(block_hash, self.kv_cache[:, :, block_id].to("cpu", copy=True))
            self.stats.num_saved_blocks += 1
