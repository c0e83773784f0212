"""The executor (vLLM's name) owns the ranks: rank 0's ModelRunner, in the engine's process, and with tensor or
pipeline parallelism the worker processes of ranks 1..N-1 (N = P x T), each with a ModelRunner of its own.

With tensor parallelism every rank holds 1/T of each layer, and a stage's ranks meet in the collectives inside the
forward (torch.distributed: gloo on CPU, NCCL on CUDA); with pipeline parallelism each stage holds 1/P of the layers
and passes its activations on (models/pipeline.py). Only rank 0 schedules and samples. Each step it sends every
worker, through a pipe, the ModelRunner method to call and its arguments (the step's input tensors), torch.save'd
so that the worker can load them straight onto its own device. An idle worker blocks on its pipe; once rank 0
closes it, the worker ends.
"""
import io
import os
import socket
import sys
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
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
from nanoserve.engine.torchrun import connect_ranks, env_rank, launched_by_torchrun, start_watching
from nanoserve.layers.attention import AttentionMetadata
from nanoserve.models.pipeline import receive_logits
from nanoserve.utils.distributed import destroy_stage_groups, init_stage_groups

# A collective waiting this long for a rank that hangs raises (one whose peer has died raises at once); it must
# exceed how far the ranks can drift apart, e.g. in loading their weights.
TIMEOUT = timedelta(seconds=120)


def world_size(config: Config) -> int:
    return config.pipeline_parallel_size * config.tensor_parallel_size


def init_process_group(config: Config, rank: int, init_method: str) -> None:
    """Join the group as `rank` of P x T, meeting at init_method: tcp://127.0.0.1:port when spawned here, env://
    under torchrun (engine/torchrun.py), which also says how many ranks share this machine and which one we are."""
    n = world_size(config)
    local_rank, local_size = int(os.environ.get("LOCAL_RANK", rank)), int(os.environ.get("LOCAL_WORLD_SIZE", n))
    if config.device == "cuda":
        torch.cuda.set_device(local_rank)  # one GPU per rank
    else:  # the ranks share the CPU's cores: N processes with a thread per core would fight over them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_size))
    dist.init_process_group("nccl" if config.device == "cuda" else "gloo", init_method=init_method,
                            rank=rank, world_size=n, timeout=TIMEOUT)
    init_stage_groups(config.tensor_parallel_size, config.pipeline_parallel_size)


def worker_main(config: Config, rank: int, port: int, conn: Connection) -> None:
    """A spawned worker's life: join the group, then serve."""
    init_process_group(config, rank, f"tcp://127.0.0.1:{port}")
    run_worker(config, rank, conn)


def run_worker(config: Config, rank: int, conn: Connection) -> None:
    """Build this rank's part of the model, then run what rank 0 sends until it closes the connection; exit."""
    runner = ModelRunner(config, rank)
    try:
        while message := conn.recv_bytes():  # b"": rank 0 is shutting down
            method, args = torch.load(io.BytesIO(message), map_location=runner.device, weights_only=False)
            getattr(runner, method)(*args)
    except Exception as error:  # EOFError: rank 0 died; else a failed send/recv or collective: another rank did
        print(f"nanoserve worker rank {rank}: {type(error).__name__}: {error or 'rank 0 is gone'}; exiting",
              file=sys.stderr, flush=True)
        os._exit(1)
    destroy_stage_groups()
    os._exit(0)  # skip the interpreter's teardown (seconds, with torch loaded): nothing is left to do


def shutdown(procs: list[mp.Process], conns: list[Connection], num_threads: int,
             closing: threading.Event | None = None) -> None:
    """Say goodbye on every pipe (each worker leaves its loop), wait a little, kill what is left, leave the group."""
    if closing is not None:  # torchrun: the watch on the workers' connections stands down
        closing.set()
    for conn in conns:
        try:
            conn.send_bytes(b"")  # goodbye: an EOF alone would mean that rank 0 died
        except OSError:  # that worker is gone already
            pass
        conn.close()
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    destroy_stage_groups()
    torch.set_num_threads(num_threads)  # as before init_process_group


class Executor:
    """Rank 0's handle on every rank: builds its own ModelRunner (`model_runner`) and, with
    more than one rank, starts ranks 1..N-1 (spawn) first; runs each step on all of them; stops them."""

    def __init__(self, config: Config):
        self.procs: list[mp.Process] = []
        self.conns: list[Connection] = []
        self.shutdown = lambda: None  # with one rank there is nothing to stop
        self.beam_logits: torch.Tensor | None = None  # the last step's ModelInput.beam_rows, raw
        self.config = config
        # Pipeline stages: rank 0 takes the logits and samples in this thread (`submit`), behind the launches;
        # it ends with the Executor (a dead engine's next step then fails in its launch, saying why).
        self.receiver = ThreadPoolExecutor(1, "nanoserve-logits") if config.pipeline_parallel_size > 1 else None
        if launched_by_torchrun():
            self._join_torchrun(config)
        elif world_size(config) > 1:
            self._start_workers(config)
        try:
            self.model_runner = ModelRunner(config)
        except BaseException:
            self.shutdown()  # don't leave the workers waiting for a rank 0 that will never come
            raise
        self.drafter = None  # speculative decoding with a draft model: its forwards run on every rank
        if self.model_runner.draft_model is not None:
            self.drafter = DraftModelProposer(InputBuilder.from_config(config))

    def _start_workers(self, config: Config) -> None:
        with socket.socket() as s:  # a free port for the group to meet on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        for rank in range(1, world_size(config)):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker_main, args=(config, rank, port, reader), daemon=True)
            proc.start()
            reader.close()  # the worker has its copy: once it dies, writing fails instead of filling a buffer
            self.procs.append(proc)
            self.conns.append(writer)
        # On `del llm`, garbage collection or interpreter exit; it holds no reference to self.
        self.shutdown = weakref.finalize(self, shutdown, self.procs, self.conns, torch.get_num_threads())
        init_process_group(config, 0, f"tcp://127.0.0.1:{port}")

    def _join_torchrun(self, config: Config) -> None:
        """Under torchrun the workers are the other ranks it started: rank 0 connects to them; a worker serves
        here and never returns (engine/torchrun.py)."""
        rank = env_rank()
        init_process_group(config, rank, "env://")
        self.conns = connect_ranks(rank, world_size(config))
        if rank != 0:
            run_worker(config, rank, self.conns[0])
        closing = start_watching(self.conns)
        self.shutdown = weakref.finalize(self, shutdown, [], self.conns, torch.get_num_threads(), closing)

    def execute_model(self, out: SchedulerOutput, inputs: ModelInput | None) -> torch.Tensor:
        """One step on every rank: the KV block copies, then the forward, each rank on its part; rank 0 fills
        in the placeholders first and samples after. Returns a token id per sampling row, as a device tensor
        (no wait for it here)."""
        return self.finish(*self.launch(out, inputs))

    def submit(self, thread: ThreadPoolExecutor, out: SchedulerOutput, inputs: ModelInput | None) -> Future:
        """execute_model in the background (the batch queue's); the future gives the sampled ids. With pipeline
        stages the launches run in `thread` and the finishes in a thread of their own, so that rank 0's stage
        starts step N+1 while the later stages still run step N (its logits not back yet)."""
        if self.receiver is None:
            return thread.submit(self.execute_model, out, inputs)
        launched = thread.submit(self.launch, out, inputs)
        return self.receiver.submit(lambda: self.finish(*launched.result()))

    def launch(self, out: SchedulerOutput, inputs: ModelInput | None) -> tuple[ModelInput | None, torch.Tensor | None]:
        """Every rank's part of a step up to the logits. Returns the inputs run (with a draft model's drafts) and
        the logits if rank 0 computed them (one stage)."""
        if out.blocks_to_swap_out or out.blocks_to_swap_in or out.blocks_to_copy:  # (TP: no message otherwise)
            self.call("swap_blocks", out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy)
        # The draft computes its drafts in the slots just copied or reserved. (Async scheduling: no step of a
        # speculating engine has placeholders, so it sees every token: accounting.py's waits_for_drafts.)
        if self.drafter is not None:
            inputs = self.drafter.propose(out, inputs, self.run_draft)
        self.model_runner.fill_placeholders(inputs)
        if inputs is None:
            return None, None
        return inputs, self.call("run_model", inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_rows)

    def run_draft(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  rows: torch.Tensor) -> torch.Tensor | None:
        """One forward of the draft model on every rank (speculative decoding); its logits of `rows` on rank 0.
        The proposer gets it each step rather than keeping it: a reference back to self would outlive `del llm`."""
        return self.call("run_model", input_ids, positions, meta, rows, True)  # draft=True

    def finish(self, inputs: ModelInput | None, logits: torch.Tensor | None) -> torch.Tensor:
        """The step's sampled ids, from its logits: with pipeline stages, those the last stage sends."""
        if inputs is None:
            return torch.empty(0, dtype=torch.int64)
        if logits is None:
            try:
                logits = receive_logits(len(inputs.logits_rows), self.config.hf_config.vocab_size,
                                        self.config.torch_dtype, self.model_runner.device)
            except RuntimeError:  # most often a dead worker: say which
                self.check(timeout=1.0)
                raise
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
                raise RuntimeError(f"worker rank {rank} (pid {proc.pid}) exited with code "
                                   f"{proc.exitcode}: this LLM cannot run any more; create a new one")
