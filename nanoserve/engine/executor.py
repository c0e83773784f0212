"""The executor (vLLM's name) owns the ranks: rank 0's ModelRunner, in the engine's process, and with tensor
parallelism the worker processes of ranks 1..N-1, each with a ModelRunner of its own.

Every rank holds 1/N of each layer, and the ranks meet in the collectives inside the forward (torch.distributed:
gloo on CPU, NCCL on CUDA). Only rank 0 schedules and samples. Each step it sends every worker, through a pipe,
the ModelRunner method to call and its arguments (the step's input tensors), torch.save'd so that the worker can
load them straight onto its own device. An idle worker blocks on its pipe; once rank 0 closes it, the worker ends.
"""
import io
import os
import socket
import weakref
from datetime import timedelta
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanoserve.config import Config
from nanoserve.engine.input_batch import InputBuilder, ModelInput
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.scheduler_output import SchedulerOutput
from nanoserve.engine.spec_decode.draft_model_proposer import DraftModelProposer

# A collective waiting this long for a rank that hangs raises (one whose peer has died raises at once); it must
# exceed how far the ranks can drift apart, e.g. in loading their weights.
TIMEOUT = timedelta(seconds=120)


def init_process_group(config: Config, rank: int, port: int) -> None:
    n = config.tensor_parallel_size
    if config.device == "cuda":
        torch.cuda.set_device(rank)  # one GPU per rank
    else:  # the ranks share the CPU's cores: N processes with a thread per core would fight over them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    dist.init_process_group("nccl" if config.device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=n, timeout=TIMEOUT)


def worker_main(config: Config, rank: int, port: int, conn: Connection) -> None:
    """A worker's life: join the group, build its slice of the model, then run what rank 0 sends."""
    init_process_group(config, rank, port)
    runner = ModelRunner(config, rank)
    try:
        while True:
            method, args = torch.load(io.BytesIO(conn.recv_bytes()), map_location=runner.device, weights_only=False)
            getattr(runner, method)(*args)
    except EOFError:  # rank 0 closed the pipe: shutting down, or gone
        dist.destroy_process_group()
        os._exit(0)  # skip the interpreter's teardown (seconds, with torch loaded): nothing is left to do


def shutdown(procs: list[mp.Process], conns: list[Connection], num_threads: int) -> None:
    """Close the pipes (each worker leaves its loop), wait a little, kill what is left, leave the group."""
    for conn in conns:
        conn.close()
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.set_num_threads(num_threads)  # as before init_process_group


class Executor:
    """Rank 0's handle on every rank: builds its own ModelRunner (`model_runner`) and, with
    tensor_parallel_size > 1, starts ranks 1..N-1 (spawn) first; runs each step on all of them; stops them."""

    def __init__(self, config: Config):
        self.procs: list[mp.Process] = []
        self.conns: list[Connection] = []
        self.shutdown = lambda: None  # with one rank there is nothing to stop
        self.beam_logits: torch.Tensor | None = None  # the last step's ModelInput.beam_rows, raw
        if config.tensor_parallel_size > 1:
            self._start_workers(config)
        try:
            self.model_runner = ModelRunner(config)
        except BaseException:
            self.shutdown()  # don't leave the workers waiting for a rank 0 that will never come
            raise
        self.drafter = None  # speculative decoding with a draft model (rank 0 only: tensor_parallel_size 1)
        if self.model_runner.draft_model is not None:
            self.drafter = DraftModelProposer(self.model_runner.draft_model, InputBuilder.from_config(config))

    def _start_workers(self, config: Config) -> None:
        with socket.socket() as s:  # a free port for the group to meet on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        for rank in range(1, config.tensor_parallel_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker_main, args=(config, rank, port, reader), daemon=True)
            proc.start()
            reader.close()  # the worker has its copy: once it dies, writing fails instead of filling a buffer
            self.procs.append(proc)
            self.conns.append(writer)
        # On `del llm`, garbage collection or interpreter exit; it holds no reference to self.
        self.shutdown = weakref.finalize(self, shutdown, self.procs, self.conns, torch.get_num_threads())
        init_process_group(config, 0, port)

    def execute_model(self, out: SchedulerOutput, inputs: ModelInput | None) -> torch.Tensor:
        """One step on every rank: the KV block copies, then the forward, each rank on its slice; rank 0 fills
        in the placeholders first and samples after. Returns a token id per sampling row, as a device tensor
        (no wait for it here)."""
        if out.blocks_to_swap_out or out.blocks_to_swap_in or out.blocks_to_copy:  # (TP: no message otherwise)
            self.call("swap_blocks", out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy)
        if self.drafter is not None:  # it computes its drafts in the slots just copied or reserved
            inputs = self.drafter.propose(out, inputs)
        self.model_runner.fill_placeholders(inputs)
        if inputs is None:
            return torch.empty(0, dtype=torch.int64)
        logits = self.call("run_model", inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_rows)
        self.beam_logits = logits[inputs.beam_rows]  # beam searches score these raw rows themselves
        return self.model_runner.sample(logits, inputs)

    def call(self, method: str, *args):
        """model_runner.method(*args), after sending every worker the same call for its own runner."""
        if not self.conns:
            return getattr(self.model_runner, method)(*args)
        buf = io.BytesIO()
        torch.save((method, args), buf)
        try:
            for conn in self.conns:
                conn.send_bytes(buf.getbuffer())
            return getattr(self.model_runner, method)(*args)
        except (OSError, RuntimeError):  # a broken pipe or a failed collective: most often a dead worker
            self.check(timeout=1.0)  # if so, say which (giving a dying one a second to be reaped)
            raise

    def check(self, timeout: float = 0.0) -> None:
        """Raise a clear error if a worker has exited (waiting up to timeout for one), after stopping the rest."""
        ended = wait([proc.sentinel for proc in self.procs], timeout)
        for rank, proc in enumerate(self.procs, start=1):
            if proc.sentinel in ended:
                proc.join()
                self.shutdown()
                raise RuntimeError(f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code "
                                   f"{proc.exitcode}: this LLM cannot run any more; create a new one")
