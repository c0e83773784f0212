"""Tensor and pipeline parallelism's executor (vLLM's MultiprocExecutor): rank 0's ModelRunner, in
the engine's process, and the worker processes of ranks 1..N-1 (N = P x T), each with a ModelRunner
of its own. It is the core's Executor (engine/model_runner.py) with each call sent to every rank:
build_engine's executor class when P x T > 1.

With tensor parallelism every rank holds 1/T of each layer, and a stage's ranks meet in the
collectives inside the forward (torch.distributed: gloo on CPU, NCCL on CUDA); with pipeline
parallelism each stage holds 1/P of the layers and passes its activations on (parallel/pipeline.py).
Only rank 0 schedules and samples. Each step it sends every worker, through a pipe, the ModelRunner
method to call and its arguments (the step's input tensors), torch.save'd so that the worker can
load them straight onto its own device. An idle worker blocks on its pipe; once rank 0 closes it,
the worker ends.
"""
import gc
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
from nanoserve.engine.model_runner import Executor, ModelInput, ModelRunner
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.parallel.pipeline import PipelineStageModel, receive_logits
from nanoserve.parallel.torchrun import (
    connect_ranks,
    env_rank,
    launched_by_torchrun,
    start_watching,
)
from nanoserve.utils.distributed import destroy_stage_groups, init_stage_groups

# A collective waiting this long for a rank that hangs raises (one whose peer has died raises at
# once); it must exceed how far the ranks can drift apart, e.g. in loading their weights.
TIMEOUT = timedelta(seconds=120)


def world_size(config: Config) -> int:
    return config.parallel_config.world_size


def init_process_group(config: Config, rank: int, init_method: str) -> None:
    """Join the group as `rank` of P x T, meeting at init_method: tcp://127.0.0.1:port when spawned
    here, env:// under torchrun (parallel/torchrun.py), which also says how many ranks share this
    machine and which one we are."""
    n = world_size(config)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", n))
    if config.device == "cuda":
        torch.cuda.set_device(local_rank)  # one GPU per rank
    else:
        # the ranks share the CPU's cores: N processes with a thread per core would fight over them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_size))
    dist.init_process_group("nccl" if config.device == "cuda" else "gloo", init_method=init_method,
                            rank=rank, world_size=n, timeout=TIMEOUT)
    parallel = config.parallel_config
    init_stage_groups(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)


def worker_main(config: Config, rank: int, port: int, conn: Connection,
                runner_class: type[ModelRunner]) -> None:
    """A spawned worker's life: join the group, then serve."""
    init_process_group(config, rank, f"tcp://127.0.0.1:{port}")
    run_worker(config, rank, conn, runner_class)


def make_runner(config: Config, rank: int, runner_class: type[ModelRunner]) -> ModelRunner:
    """This rank's ModelRunner (the engine's class: the core's, or the chapters'): with pipeline
    stages, its stage's part of the model."""
    stages = config.parallel_config.pipeline_parallel_size > 1
    return runner_class(config, rank, PipelineStageModel if stages else None)


def run_worker(config: Config, rank: int, conn: Connection,
               runner_class: type[ModelRunner]) -> None:
    """Build this rank's part of the model, then run what rank 0 sends until it closes the
    connection; exit."""
    runner = make_runner(config, rank, runner_class)
    # as LLM.generate: the model and torch are left out of full collections (until the process ends)
    gc.freeze()
    try:
        while message := conn.recv_bytes():  # b"": rank 0 is shutting down
            method, args = torch.load(io.BytesIO(message), map_location=runner.device,
                                      weights_only=False)
            getattr(runner, method)(*args)
    except Exception as error:
        # EOFError: rank 0 died; else a failed send/recv or collective: another rank did
        print(f"nanoserve worker rank {rank}: {type(error).__name__}: {error or 'rank 0 is gone'}; "
              "exiting",
              file=sys.stderr, flush=True)
        os._exit(1)
    destroy_stage_groups()
    # skip the interpreter's teardown (seconds, with torch loaded): nothing is left to do
    os._exit(0)


def shutdown(procs: list[mp.Process], conns: list[Connection], num_threads: int,
             reaping: threading.Lock, closing: threading.Event | None = None) -> None:
    """Say goodbye on every pipe (each worker leaves its loop), wait a little, kill what is left,
    leave the group."""
    if closing is not None:  # torchrun: the watch on the workers' connections stands down
        closing.set()
    for conn in conns:
        try:
            conn.send_bytes(b"")  # goodbye: an EOF alone would mean that rank 0 died
        except OSError:  # that worker is gone already
            pass
        conn.close()
    with reaping:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    destroy_stage_groups()
    torch.set_num_threads(num_threads)  # as before init_process_group


class MultiprocExecutor(Executor):
    """Rank 0's handle on every rank: starts ranks 1..N-1 (spawn, or joins torchrun's), then builds
    its own ModelRunner (`model_runner`); runs each step on all of them; stops them. With one rank
    (P x T = 1, no torchrun) it is the core's Executor."""

    def __init__(self, config: Config, model_runner_class: type[ModelRunner] = ModelRunner):
        self.procs: list[mp.Process] = []
        self.conns: list[Connection] = []
        # why this engine cannot run any more, once a step has failed
        self.failed: str | None = None
        stages = config.parallel_config.pipeline_parallel_size > 1
        # Pipeline stages: rank 0 takes the logits and samples in this thread (`submit`), behind the
        # launches; it ends with the Executor (a dead engine's next step then fails in its launch,
        # saying why).
        self.receiver = ThreadPoolExecutor(1, "nanoserve-logits") if stages else None
        # With pipeline stages the launch thread and the logits thread may both see a dead worker
        # and stop the rest: one reaps at a time (a second waitpid on the same pid gets ECHILD, and
        # the exit code would read None).
        self.reaping = threading.Lock()
        if world_size(config) == 1 and not launched_by_torchrun():
            super().__init__(config, model_runner_class)
            return
        self.config, self.runner_class = config, model_runner_class
        self.shutdown = lambda: None
        try:
            if launched_by_torchrun():
                self._join_torchrun(config)
            else:
                self._start_workers(config)
            self.model_runner = make_runner(config, 0, model_runner_class)
        except BaseException as error:
            # A rank died, a collective timed out, a check failed after init_process_group: end the
            # workers (don't leave them waiting for a rank 0 that will never come) and leave the
            # process group now, not when the garbage collector gets to this half-built executor
            # (the traceback keeps it alive): the next LLM in this process must find
            # torch.distributed free.
            dead = self.dead_workers()
            self.shutdown()
            if dead:
                error.add_note(f"nanoserve: {dead} while the engine started")
            raise

    def _start_workers(self, config: Config) -> None:
        with socket.socket() as s:  # a free port for the group to meet on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # On `del llm`, garbage collection, interpreter exit or a failed start or step; it holds no
        # reference to self.
        self.shutdown = weakref.finalize(self, shutdown, self.procs, self.conns,
                                         torch.get_num_threads(), self.reaping)
        ctx = mp.get_context("spawn")
        for rank in range(1, world_size(config)):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker_main,
                               args=(config, rank, port, reader, self.runner_class), daemon=True)
            proc.start()
            # the worker has its copy: once it dies, writing fails instead of filling a buffer
            reader.close()
            self.procs.append(proc)
            self.conns.append(writer)
        init_process_group(config, 0, f"tcp://127.0.0.1:{port}")

    def _join_torchrun(self, config: Config) -> None:
        """Under torchrun the workers are the other ranks it started: rank 0 connects to them; a
        worker serves here and never returns (parallel/torchrun.py)."""
        rank = env_rank()
        init_process_group(config, rank, "env://")
        self.conns = connect_ranks(rank, world_size(config))
        if rank != 0:
            run_worker(config, rank, self.conns[0], self.runner_class)
        closing = start_watching(self.conns)
        self.shutdown = weakref.finalize(self, shutdown, [], self.conns, torch.get_num_threads(),
                                         self.reaping, closing)

    def submit(self, thread: ThreadPoolExecutor, out: SchedulerOutput,
               inputs: ModelInput | None) -> Future:
        """execute_model in the background for async scheduling's batch queue, with pipeline stages;
        the future gives the sampled ids. The launches run in `thread` and the finishes in a thread
        of their own, so that rank 0's stage starts step N+1 while the later stages still run step N
        (its logits not back yet)."""
        launched = thread.submit(self.launch, out, inputs)
        return self.receiver.submit(lambda: self.finish(out, *launched.result()))

    def finish(self, out: SchedulerOutput, inputs: ModelInput | None,
               logits: torch.Tensor | None) -> torch.Tensor:
        """With pipeline stages rank 0 computed no logits: the last stage sends them."""
        if inputs is not None and logits is None:
            try:
                logits = receive_logits(len(inputs.logits_rows), self.config.hf_config.vocab_size,
                                        self.config.torch_dtype, self.model_runner.device)
            except RuntimeError as error:  # most often a dead worker: say which
                self.fail(error)
        return super().finish(out, inputs, logits)

    def call(self, method: str, *args):
        """model_runner.method(*args), after sending every worker the same call for its own
        runner."""
        if self.failed is not None:
            raise RuntimeError(f"{self.failed}: this LLM cannot run any more; create a new one")
        if not self.conns:
            return getattr(self.model_runner, method)(*args)
        buf = io.BytesIO()
        torch.save((method, args), buf)
        try:
            for conn in self.conns:
                conn.send_bytes(buf.getbuffer())
            return getattr(self.model_runner, method)(*args)
        except BaseException as error:
            # a broken pipe or a failed collective (most often a dead worker), or else
            self.fail(error)

    def fail(self, error: BaseException):
        """A step failed on rank 0 (a dead worker, a collective's timeout, a bug): the ranks no
        longer agree on where they are, so the engine ends here: its workers, its process group (for
        the next LLM). Raises, saying which worker died if one did (giving a dying one a second to
        be reaped)."""
        self.check(timeout=1.0)
        first_line = (str(error).strip() or "?").splitlines()[0]
        self.failed = f"a step failed ({type(error).__name__}: {first_line})"
        self.shutdown()
        raise error

    def dead_workers(self, timeout: float = 0.0) -> str | None:
        """Which worker has exited (waiting up to timeout for one), and how; None while all live."""
        ended = wait([proc.sentinel for proc in self.procs], timeout)
        with self.reaping:
            for rank, proc in enumerate(self.procs, start=1):
                if proc.sentinel in ended:
                    proc.join()
                    return f"worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
        return None

    def check(self, timeout: float = 0.0) -> None:
        """Raise a clear error if a worker has exited (waiting up to timeout for one), after
        stopping the rest."""
        if (dead := self.dead_workers(timeout)) is not None:
            self.failed = dead
            self.shutdown()
            raise RuntimeError(f"{dead}: this LLM cannot run any more; create a new one")


def parameter_shapes(runner: ModelRunner) -> list[dict[str, tuple[int, ...]]] | None:
    """Every rank's parameter shapes, gathered on rank 0 (a debug call:
    `executor.call("apply", parameter_shapes)`)."""
    shapes = {name: tuple(p.shape) for name, p in runner.model.named_parameters()}
    gathered = [{} for _ in range(dist.get_world_size())] if runner.rank == 0 else None
    dist.gather_object(shapes, gathered, dst=0)
    return gathered
