"""The transport: two engines joined by a torch.distributed process group of their own, and what
they say on it.

The rendezvous is torchrun's: the producer (rank 0) hosts a TCPStore at kv_ip:kv_port (torchrun's
MASTER_ADDR and MASTER_PORT), the consumer (rank 1) connects to it, and both build a process group
of two from it: gloo on CPU, NCCL on CUDA. The group is made directly from the store, never as the
default group, so tensor parallelism's `init_process_group` in the same process is untouched. Every
tensor goes point to point (`send`/`recv`).

The consumer pulls (as vLLM's NIXL connector reads from the prefill instance): it sends the chained
hashes of the prompt blocks it lacks, and the producer answers with the KV of the leading ones its
KVStore still holds. Each side runs one thread on the group, so the messages of two pulls never
interleave:

    consumer -> producer   [n]            int64: how many hashes follow (0: a heartbeat, no more)
    consumer -> producer   [n]            int64: the block hashes, in prompt order
    producer -> consumer   [1]            int64: m, how many of them it has, from the first on
    producer -> consumer   [m, 2, L, ...] the KV of those m blocks (keys and values, every layer)

When the pair breaks (the peer died), every pull waiting fails at once, and so does every new one
until the pair is joined again: each side goes back to the rendezvous, so a restarted producer or
consumer is joined with no restart of the other (vLLM's connectors do not reconnect).
"""
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from nanoserve.kv_transfer_config import KVTransferConfig

logger = logging.getLogger("nanoserve.kv_transfer")
PRODUCER, CONSUMER = 0, 1
CONNECT_TIMEOUT = timedelta(hours=1)  # the peer may start much later (a join waits, then again)
HEARTBEAT = 1.0  # seconds: an idle consumer says it is there, and learns so if the producer is not
RETRY_DELAY = 0.5  # seconds between a broken pair and the next rendezvous


def as_int64(hashes: list[int]) -> torch.Tensor:
    """xxhash's unsigned 64-bit hashes as an int64 tensor (the same bits), and back with
    `as_hashes`."""
    return torch.from_numpy(np.array(hashes, dtype=np.uint64).view(np.int64))


def as_hashes(tensor: torch.Tensor) -> list[int]:
    return tensor.numpy().view(np.uint64).tolist()


def connect(config: KVTransferConfig) -> dist.TCPStore:
    """The rendezvous: the producer hosts the TCPStore (once, for its whole life), the consumer
    connects to it (waiting until it is up)."""
    return dist.TCPStore(config.kv_ip, config.kv_port, is_master=config.kv_rank == PRODUCER,
                         timeout=CONNECT_TIMEOUT, wait_for_workers=False)


def take_number(store: dist.Store, config: KVTransferConfig, last: int = 0) -> int:
    """The number a new pair meets under, so that it never reads the keys of one that broke: each
    joining consumer takes the next one; the producer, after the pair numbered `last`, waits for a
    consumer and takes the newest."""
    if config.kv_rank == PRODUCER:
        store.wait([f"joined/{last + 1}"])
        return store.add("joins", 0)
    number = store.add("joins", 1)
    store.set(f"joined/{number}", "")
    return number


def join(store: dist.Store, config: KVTransferConfig, device: torch.device,
         number: int) -> dist.ProcessGroup:
    """This engine's end of pair `number`: blocks until the peer has joined too (call it off the
    engine's thread)."""
    store = dist.PrefixStore(f"nanoserve-kv-transfer/{number}", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = CONNECT_TIMEOUT
        return dist.ProcessGroupNCCL(store, config.kv_rank, 2, options)
    return dist.ProcessGroupGloo(store, config.kv_rank, 2, CONNECT_TIMEOUT)


class KVStore:
    """The producer's KV of computed prompt blocks, by chained hash, kept for the consumer to pull:
    at most kv_buffer_size bytes, the oldest dropped first. Copies, so the producer frees its blocks
    as usual."""

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
        """The KV of hashes[0], hashes[1], ... up to the first one not held (a prompt's KV is used
        from its start)."""
        with self.lock:
            found = []
            for block_hash in hashes:
                if block_hash not in self.blocks:
                    break
                self.blocks.move_to_end(block_hash)
                found.append(self.blocks[block_hash])
            return found


class KVPipe:
    """One end of the pair, its thread joining the group first. The producer's thread answers pulls
    from its KVStore; the consumer's runs the pulls `pull` queues. While the pair is broken (the
    peer died), every pull fails at once; the thread meanwhile joins a new pair, with the peer that
    comes back."""

    def __init__(self, config: KVTransferConfig, block_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, store: KVStore | None = None):
        self.config, self.block_shape, self.dtype = config, block_shape, dtype
        self.device = device  # where the group's tensors live: the GPU for NCCL, the host for gloo
        self.store = store
        self.group: dist.ProcessGroup | None = None
        self.error: Exception | None = None  # why the pair is broken, until it is joined again
        self.num_joins = 0  # pairs joined so far (more than one: the peer came back)
        self.num_sent_blocks = 0
        self.pulls: list[tuple[list[int], Future]] = []  # the one in flight first, till answered
        self.wakeup = threading.Condition()
        role = "producer" if config.is_producer else "consumer"
        self.thread = threading.Thread(target=self._run, name=f"nanoserve-kv-{role}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        """Join, work, and when the pair breaks fail what waits and join again, for as long as the
        process lives."""
        rendezvous, number = None, 0
        while True:
            try:
                if rendezvous is None or not self.config.is_producer:  # (a new producer, new store)
                    rendezvous = connect(self.config)
                number = take_number(rendezvous, self.config, number)
                self.group = join(rendezvous, self.config, self.device, number)
                with self.wakeup:
                    self.error = None
                    self.num_joins += 1
                logger.info("the KV transfer pipe to %s:%d is up (pair %d)", self.config.kv_ip,
                            self.config.kv_port, number)
                self._serve() if self.config.is_producer else self._run_pulls()
            except Exception as error:  # the peer died or the group broke
                self._fail(error)
                time.sleep(RETRY_DELAY)

    def _fail(self, error: Exception) -> None:
        """Every pull waiting, the one in flight too, fails now; new ones fail in `pull` until the
        next join."""
        with self.wakeup:
            self.error = RuntimeError(f"the KV transfer pipe to {self.config.kv_ip}:"
                                      f"{self.config.kv_port} is down: {error}")
            pending, self.pulls = self.pulls, []
        logger.warning("%s; joining again when the peer comes back", self.error)
        for _, future in pending:
            future.set_exception(self.error)

    # ---- the producer's side ---------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            count = int(self._recv(torch.empty(1, dtype=torch.int64)))
            if count == 0:  # a heartbeat
                continue
            hashes = as_hashes(self._recv(torch.empty(count, dtype=torch.int64)).cpu())
            found = self.store.leading(hashes)
            self._send(torch.tensor([len(found)]))
            if found:
                self._send(torch.stack(found))
                self.num_sent_blocks += len(found)

    # ---- the consumer's side ---------------------------------------------------------------------
    def pull(self, hashes: list[int]) -> Future:
        """Ask the producer for these blocks; the future gives the KV of the leading ones it had,
        one tensor each. (Before the first join, pulls wait for it; while the pair is broken, they
        fail at once.)"""
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
                self.wakeup.wait_for(lambda: self.pulls, timeout=HEARTBEAT)
                pull = self.pulls[0] if self.pulls else None  # (it stays queued: a break fails it)
            if pull is None:  # idle: gloo tells of a dead producer only when the pair is used
                self._send(torch.tensor([0]))
                continue
            hashes, future = pull
            self._send(torch.tensor([len(hashes)]))
            self._send(as_int64(hashes))
            count = int(self._recv(torch.empty(1, dtype=torch.int64)))
            kv = None
            if count:
                kv = self._recv(torch.empty(count, *self.block_shape, dtype=self.dtype))
            # (a consumer that gave up waiting computed the prompt itself: the answer is dropped)
            future.set_result([] if kv is None else list(kv.cpu().unbind(0)))
            with self.wakeup:
                self.pulls.pop(0)

    def _send(self, tensor: torch.Tensor) -> None:
        self.group.send([tensor.to(self.device)], 1 - self.config.kv_rank, 0).wait()

    def _recv(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to(self.device)
        self.group.recv([tensor], 1 - self.config.kv_rank, 0).wait()
        return tensor
