"""Several machines: the engine started by torchrun (PyTorch's launcher) instead of spawning its own
workers.

`torchrun --nnodes N --nproc-per-node M --node-rank R --master-addr HOST --master-port PORT
-m nanoserve.serving MODEL --pipeline-parallel-size P --tensor-parallel-size T` starts M processes
on each of N machines, with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in their
environment (N x M must be P x T). Every process builds the same Config; in the Executor they part
ways: rank 0 goes on to run the scheduler and the API, every other rank builds its part of the model
and serves as a worker (executor.run_worker) until rank 0 closes its connection, then exits.

Steps travel as they do to spawned workers (parallel/executor.py), over a TCP connection per worker
instead of a pipe: multiprocessing.connection gives both the same send_bytes/recv_bytes. Rank 0
listens on MASTER_ADDR at a free port, which a broadcast tells the others once the group has met.
The ranks trust one another and their network, as torch.distributed does: keep them on a private
network.
"""
import logging
import os
import threading
from multiprocessing.connection import Client, Connection, Listener, wait

import torch.distributed as dist

logger = logging.getLogger(__name__)


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a group a launcher started (torchrun sets these; so can a
    batch system)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def env_rank() -> int:
    return int(os.environ["RANK"])


def connect_ranks(rank: int, world_size: int) -> list[Connection]:
    """Once the group has met: on rank 0 a connection to each worker, in rank order; on a worker,
    one to rank 0."""
    listener = Listener((os.environ["MASTER_ADDR"], 0)) if rank == 0 else None
    address = [listener.address if listener else None]
    dist.broadcast_object_list(address, src=0)
    if listener is None:
        conn = Client(tuple(address[0]))
        conn.send_bytes(str(rank).encode())  # who is calling: workers connect in any order
        return [conn]
    conns = {}
    with listener:
        while len(conns) < world_size - 1:
            conn = listener.accept()
            conns[int(conn.recv_bytes())] = conn
    return [conns[r] for r in range(1, world_size)]


def watch_workers(conns: list[Connection], closing: threading.Event) -> None:
    """Rank 0's guard, in a daemon thread. A worker never writes to rank 0, so its connection turns
    readable only when the worker has ended: unless rank 0 is shutting down, no step can run any
    more. Rank 0 then exits with an error at once (torchrun reports the failure; the other workers
    see their connection close and exit too), rather than serve requests that would fail, or wait
    for a step to notice."""
    try:
        ended = wait(conns)
    except (OSError, ValueError):  # the connections were closed under us: shutting down
        return
    if not closing.is_set():
        rank = conns.index(ended[0]) + 1
        logger.error("worker rank %d has exited (its node died?): this engine cannot run; exiting",
                     rank)
        os._exit(1)


def start_watching(conns: list[Connection]) -> threading.Event:
    """Start watch_workers; set the event returned before closing the connections on purpose."""
    closing = threading.Event()
    threading.Thread(target=watch_workers, args=(conns, closing), name="nanoserve-watch",
                     daemon=True).start()
    return closing
