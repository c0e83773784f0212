"""Async scheduling (async_scheduling=True), as vLLM's async scheduling does it: a batch queue. The
engine plans step N+1 and builds its inputs while step N's forward runs (on the GPU, or in a thread
on CPU), then waits for N and takes its output in.

Planning N+1 before N's token is known works because the core already counts a token a step is
sampling as a placeholder (Sequence.num_output_placeholders, in len(seq)): N+1 computes it at the
right position, and this chapter writes N's sampled id, still on the device, into N+1's input row
just before its forward (no wait for the host). A sequence whose newest token a feature needs to
plan with (a grammar's mask, drafts) sits N+1 out. With P pipeline stages, P steps are in flight,
each admitting at most 1/P of the requests (docs/parallelism.md).
"""
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from nanoserve.config import Config
from nanoserve.engine.core import EngineCore
from nanoserve.engine.model_runner import ModelInput, to_device
from nanoserve.engine.output_processor import EngineCoreOutput
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.sequence import Sequence, num_seats
from nanoserve.persistent_batch import BatchModelInput


class LaunchedStep(Future):
    """A step launched on the GPU (or run already, on CPU). Its sampled ids are copied to the host
    right behind its kernels: a copy asked for later would queue behind the next step's. result()
    waits for that copy only."""

    def __init__(self, sampled: torch.Tensor):
        super().__init__()
        self.ids = sampled.to("cpu", non_blocking=True)
        self.copied = torch.cuda.Event() if sampled.is_cuda else None
        if self.copied is not None:
            self.copied.record()

    def result(self, timeout: float | None = None) -> torch.Tensor:
        if self.copied is not None:
            self.copied.synchronize()
        return self.ids


class AsyncScheduler(Scheduler):
    """The scheduler's part (vLLM's AsyncScheduler): a request whose newest token is still in flight
    sits the planned step out when that token is needed to plan it, and with P pipeline stages each
    step admits at most 1/P of the requests. Without async scheduling no token is ever in flight
    when a step is planned."""

    def __init__(self, config: Config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        # batches the stages hold at once (1 without stages); 0: no async scheduling
        self.depth = config.parallel_config.pipeline_parallel_size * bool(
            config.scheduler_config.async_scheduling)

    def can_schedule(self, group: list[Sequence]) -> bool:
        """A group whose newest token is in flight waits for it when planning needs that token (a
        grammar's next mask, drafts proposed from it), or with pipeline stages, where its batch
        could not enter the first stage before the one in flight left the last (V1's
        scheduled_req_ids; docs/parallelism.md)."""
        in_flight = [s for s in group if s.num_output_placeholders]
        if in_flight and (self.depth > 1 or any(map(self.needs_newest_token, in_flight))):
            return False
        return super().can_schedule(group)

    def needs_newest_token(self, seq: Sequence) -> bool:
        """Is seq's newest token needed to plan its next step? Not by the core; a chapter that plans
        from it says so."""
        return False

    def can_admit(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """With P pipeline stages in flight a step admits at most 1/P of the requests (counting this
        step's so far), leaving some for the others."""
        if self.depth > 1:
            share = -(-sum(map(num_seats, [*self.running, *self.waiting])) // self.depth)
            if num_seats(seq) > share - sum(map(num_seats, out.seqs)):
                return False
        return super().can_admit(seq, out)


class BatchQueueEngineCore(EngineCore):
    """The EngineCore with vLLM's batch queue: (plan, future) of the steps in flight
    (num_batches_in_flight). On CPU or with stages a thread runs the forwards (not with a draft
    model: it reads what planning changes). Without async scheduling it is the core's EngineCore."""

    def __init__(self, config: Config, **parts):
        super().__init__(config, **parts)
        self.async_scheduling = config.scheduler_config.async_scheduling
        self.batch_queue: deque[tuple[SchedulerOutput, Future]] = deque()
        self.forward_thread = None
        depth = config.parallel_config.pipeline_parallel_size  # batches the stages hold at once
        if (self.async_scheduling and (config.device == "cpu" or depth > 1)
                and config.draft_hf_config is None):
            self.forward_thread = ThreadPoolExecutor(1, thread_name_prefix="nanoserve-forward")
        # The last step's sampled ids, still a device tensor, and who sampled them: the next step's
        # placeholders.
        self.prev_sampled: tuple[dict[int, int], torch.Tensor] | None = None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self.batch_queue)

    def step(self) -> list[EngineCoreOutput]:
        return self.step_with_batch_queue() if self.async_scheduling else super().step()

    def step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """Plan step N+1 and launch it while step N's forward runs, then wait for N and take in its
        output."""
        in_flight = len(self.batch_queue)
        if not self.scheduler.is_finished() and in_flight < self.config.num_batches_in_flight:
            out = self.scheduler.schedule()
            inputs = self.input_builder.prepare_inputs(out)
            self.batch_queue.append((out, self._submit(out, inputs)))
            if len(self.batch_queue) < self.config.num_batches_in_flight:
                return []  # go plan the next step while this one runs
        if not self.batch_queue:
            return []
        out, future = self.batch_queue.popleft()
        try:
            token_ids = future.result().tolist()
        except Exception as error:
            return self.fail(out.seqs + out.preempted, error)
        return self._update_from_output(out, token_ids)

    def _submit(self, out: SchedulerOutput, inputs: ModelInput | None) -> Future:
        """Start a step's forward; its future gives the sampled ids (a CPU tensor)."""
        # (the stages' executor launches and finishes apart)
        if self.config.parallel_config.pipeline_parallel_size > 1:
            return self.executor.submit(self.forward_thread, out, inputs)
        # (taken now: the step runs what the engine had when it was planned)
        execute = self.executor.execute_model
        if self.forward_thread is not None:
            return self.forward_thread.submit(self._execute, execute, out, inputs)
        try:
            return LaunchedStep(self._execute(execute, out, inputs))
        except Exception as error:
            # failed at launch: the step fails when its turn comes, as on CPU
            future = Future()
            future.set_exception(error)
            return future

    def _execute(self, execute_model, out: SchedulerOutput,
                 inputs: ModelInput | None) -> torch.Tensor:
        """The executor's execute_model, keeping the sampled ids (on the device) for the next step's
        placeholders."""
        if inputs is not None:
            self.fill_placeholders(inputs)
        sampled = execute_model(out, inputs)
        self.prev_sampled = None if inputs is None else (
            {seq_id: row for row, seq_id in enumerate(inputs.sample_seq_ids)}, sampled)
        return sampled

    @torch.inference_mode()
    def fill_placeholders(self, inputs: BatchModelInput) -> None:
        """Before the forward: write the previous step's sampled ids, still on the device, into this
        step's placeholder rows of input_ids. Steps run one at a time, in planning order."""
        prev, self.prev_sampled = self.prev_sampled, None
        if prev is None:
            return
        prev_rows, prev_tokens = prev
        # A placeholder the previous step has no token for: that step failed, and so did the
        # request.
        rows = [(row, prev_rows[i])
                for row, i in inputs.placeholders if i in prev_rows]
        if rows:
            # Pinned and non-blocking, as every input of a step: a blocking copy would hold the host
            # until the step in flight ends, and the GPU would sit idle while this one launches.
            dst, src = (to_device(x, torch.int64, inputs.input_ids.device) for x in zip(*rows))
            inputs.input_ids[dst] = prev_tokens[src]

    def fail_all(self, error: BaseException) -> list[EngineCoreOutput]:
        self.batch_queue.clear()
        return super().fail_all(error)

    def shutdown(self) -> None:
        if self.forward_thread is not None:
            self.forward_thread.shutdown()
        super().shutdown()
