"""The transport: two engines joined by a torch.distributed process group of their own, and what they say on it.

The rendezvous is torchrun's: the producer (rank 0) hosts a TCPStore at kv_ip:kv_port (torchrun's MASTER_ADDR and
MASTER_PORT), the consumer (rank 1) connects to it, and both build a process group of two from it: gloo on CPU,
NCCL on CUDA. The group is made directly from the store, never as the default group, so tensor parallelism's
`init_process_group` in the same process is untouched. Every tensor goes point to point (`send`/`recv`).

The consumer pulls (as vLLM's NIXL connector reads from the prefill instance): it sends the chained hashes of the
prompt blocks it lacks, and the producer answers with the KV of the leading ones its KVStore still holds. Each side
runs one thread on the group, so the messages of two pulls never interleave:

    consumer -> producer   [n]            int64: how many hashes follow (-1: the consumer leaves)
    consumer -> producer   [n]            int64: the block hashes, in prompt order
    producer -> consumer   [1]            int64: m, how many of them it has, from the first on
    producer -> consumer   [m, 2, L, ...] the KV of those m blocks (keys and values, every layer)
"""
import threading
from collections import OrderedDict
from concurrent.futures import Future
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from nanoserve.kv_transfer_config import KVTransferConfig

PRODUCER, CONSUMER = 0, 1
CONNECT_TIMEOUT = timedelta(hours=1)  # the peer may start much later; the group waits idle between pulls too


def as_int64(hashes: list[int]) -> torch.Tensor:
    """xxhash's unsigned 64-bit hashes as an int64 tensor (the same bits), and back with `as_hashes`."""
    return torch.from_numpy(np.array(hashes, dtype=np.uint64).view(np.int64))


def as_hashes(tensor: torch.Tensor) -> list[int]:
    return tensor.numpy().view(np.uint64).tolist()


def join(config: KVTransferConfig, device: torch.device) -> dist.ProcessGroup:
    """This engine's end of the pair: blocks until the peer has joined too (call it off the engine's thread)."""
    store = dist.TCPStore(config.kv_ip, config.kv_port, 2, is_master=config.kv_rank == PRODUCER,
                          timeout=CONNECT_TIMEOUT)
    store = dist.PrefixStore("nanoserve-kv-transfer", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = CONNECT_TIMEOUT
        return dist.ProcessGroupNCCL(store, config.kv_rank, 2, options)
    return dist.ProcessGroupGloo(store, config.kv_rank, 2, CONNECT_TIMEOUT)


class KVStore:
    """The producer's KV of computed prompt blocks, by chained hash, kept for the consumer to pull: at most
    kv_buffer_size bytes, the oldest dropped first. Copies, so the producer frees its blocks as usual."""

    def __init__(self, capacity_bytes: float):
        self.capacity = capacity_bytes
        self.blocks: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.num_bytes = 0
        self.lock = threading.Lock()  # the engine thread puts, the pipe's thread takes

    def put(self, block_hash: int, kv: torch.Tensor) -> None:
        size = kv.numel() * kv.element_size()
        with self.lock:
            if block_hash in self.blocks:
                self.blocks.move_to_end(block_hash)
                return
            self.blocks[block_hash] = kv
            self.num_bytes += size
            while self.num_bytes > self.capacity:
                _, old = self.blocks.popitem(last=False)
                self.num_bytes -= old.numel() * old.element_size()

    def leading(self, hashes: list[int]) -> list[torch.Tensor]:
        """The KV of hashes[0], hashes[1], ... up to the first one not held (a prompt's KV is used from its start)."""
        with self.lock:
            found = []
            for block_hash in hashes:
                if block_hash not in self.blocks:
                    break
                self.blocks.move_to_end(block_hash)
                found.append(self.blocks[block_hash])
            return found


class KVPipe:
    """One end of the pair, its thread joining the group first. The producer's thread answers pulls from its
    KVStore; the consumer's runs the pulls `pull` queues. Once the group fails (the peer died), every pull fails."""

    def __init__(self, config: KVTransferConfig, block_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, store: KVStore | None = None):
        self.config, self.block_shape, self.dtype = config, block_shape, dtype
        self.device = device  # where the group's tensors live: the GPU for NCCL, the host for gloo
        self.store = store
        self.group: dist.ProcessGroup | None = None
        self.error: Exception | None = None  # why the pipe is down, for good
        self.num_sent_blocks = 0
        self.pulls: list[tuple[list[int], Future]] = []
        self.wakeup = threading.Condition()
        role = "producer" if config.is_producer else "consumer"
        self.thread = threading.Thread(target=self._run, name=f"nanoserve-kv-{role}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.group = join(self.config, self.device)
            self._serve() if self.config.is_producer else self._run_pulls()
        except Exception as error:  # the peer died or the group broke: later pulls fail at once
            with self.wakeup:
                self.error = RuntimeError(f"the KV transfer pipe to {self.config.kv_ip}:{self.config.kv_port} "
                                          f"is down: {error}")
                pending, self.pulls = self.pulls, []
            for _, future in pending:
                if not future.done():
                    future.set_exception(self.error)

    # ---- the producer's side ------------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            count = self._recv(torch.empty(1, dtype=torch.int64))
            if int(count) < 0:  # the consumer left
                return
            hashes = as_hashes(self._recv(torch.empty(int(count), dtype=torch.int64)).cpu())
            found = self.store.leading(hashes)
            self._send(torch.tensor([len(found)]))
            if found:
                self._send(torch.stack(found))
                self.num_sent_blocks += len(found)

    # ---- the consumer's side ------------------------------------------------------------------------
    def pull(self, hashes: list[int]) -> Future:
        """Ask the producer for these blocks; the future gives the KV of the leading ones it had, one tensor each."""
        future = Future()
        with self.wakeup:
            if self.error is not None:
                future.set_exception(self.error)
            else:
                self.pulls.append((hashes, future))
                self.wakeup.notify()
        return future

    def _run_pulls(self) -> None:
        while True:
            with self.wakeup:
                while not self.pulls:
                    self.wakeup.wait()
                hashes, future = self.pulls.pop(0)
            if hashes is None:  # close()
                self._send(torch.tensor([-1]))
                return
            self._send(torch.tensor([len(hashes)]))
            self._send(as_int64(hashes))
            count = int(self._recv(torch.empty(1, dtype=torch.int64)))
            kv = self._recv(torch.empty(count, *self.block_shape, dtype=self.dtype)) if count else None
            if not future.done():  # (a consumer that gave up waiting has computed the prompt itself)
                future.set_result([] if kv is None else list(kv.cpu().unbind(0)))

    def close(self) -> None:
        """The consumer tells the producer it leaves (after the pulls queued before)."""
        if not self.config.is_producer:
            with self.wakeup:
                self.pulls.append((None, Future()))
                self.wakeup.notify()

    def _send(self, tensor: torch.Tensor) -> None:
        self.group.send([tensor.to(self.device)], 1 - self.config.kv_rank, 0).wait()

    def _recv(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to(self.device)
        self.group.recv([tensor], 1 - self.config.kv_rank, 0).wait()
        return tensor
