import queue
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import count

import torch
from transformers import AutoTokenizer

from nanoserve.config import Config, has_tokenizer
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.executor import Executor
from nanoserve.engine.input_batch import InputBuilder, ModelInput
from nanoserve.engine.output_processor import EngineCoreOutput
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.seams import Seams
from nanoserve.engine.sequence import Request, Sequence
from nanoserve.lora_request import LoRARequest
from nanoserve.sampling_params import FEATURE_FIELDS, SamplingParams
from nanoserve.utils.math import cdiv


class LaunchedStep(Future):
    """A step launched on the GPU (or run already, on CPU). Its sampled ids are copied to the host right behind
    its kernels: a copy asked for later would queue behind the next step's. result() waits for that copy only."""

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


class EngineCore:
    """The engine (vLLM V1's EngineCore): owns the requests, the scheduler, the KV blocks and the executor
    (the model). `step()` = schedule -> run the model -> update; the offline LLM calls it in a loop, AsyncLLM
    runs `run_busy_loop` in a thread. With async_scheduling, `step_with_batch_queue` takes its place. Features
    plug in through `seams` (engine/seams.py); without any, this is the whole engine."""

    def __init__(self, config: Config, seams: Seams | None = None):
        self.config = config
        self.seams = Seams() if seams is None else seams
        self.executor = (self.seams.executor_class or Executor)(config, self.seams)
        try:  # a failed start ends the executor's workers and process group now (parallel/executor.py)
            self.model_runner = self.executor.model_runner  # rank 0's: the model and its KV cache, to read
            self.input_builder = InputBuilder.from_config(config, self.seams.logits_processors)
            self.block_manager = BlockManager(self.model_runner.num_kvcache_blocks, config.block_size,
                                              config.enable_prefix_caching, self.seams)
            swap_pool = (BlockManager(self.model_runner.num_host_blocks, config.block_size,
                                      enable_prefix_caching=False)
                         if config.preemption_mode == "swap" else None)  # a second allocator, over the host pool
            self.scheduler = Scheduler(config, self.block_manager, swap_pool, self.seams)
            self.tokenizer = AutoTokenizer.from_pretrained(config.model) if has_tokenizer(config.model) else None
        except BaseException:
            self.executor.shutdown()
            raise
        self.requests: dict[str, Request] = {}
        self.seq_ids = count()
        # Async scheduling: the batch queue holds the (plan, future) of the steps in flight (num_batches_in_flight).
        # On CPU or with stages a thread runs the forwards (not a draft model's: it reads what planning changes).
        self.batch_queue: deque[tuple[SchedulerOutput, Future]] | None = None
        self.forward_thread = None
        if config.async_scheduling:
            self.batch_queue = deque()
            if (config.device == "cpu" or config.pipeline_parallel_size > 1) and config.draft_hf_config is None:
                self.forward_thread = ThreadPoolExecutor(1, thread_name_prefix="nanoserve-forward")

    # ---- requests ---------------------------------------------------------------------------------
    def check_request(self, token_ids: list[int], params: SamplingParams, priority: int = 0,
                      lora_request: LoRARequest | None = None) -> None:
        """Reject what could never run, before any work starts, instead of failing or looping later."""
        if not token_ids:
            raise ValueError("prompt: must contain at least one token")
        vocab_size = self.config.hf_config.vocab_size
        for name, ids in (("prompt", token_ids), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:  # (an id past the logits would crash the step that masks or matches it)
                raise ValueError(f"{name}: token ids must be in [0, vocab_size={vocab_size}), got {bad[:5]}")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > vocab_size:
                raise ValueError(f"{name}: got {getattr(params, name)}, the vocabulary has {vocab_size} tokens")
        for name in FEATURE_FIELDS:  # options a feature serves: one must be plugged in
            if getattr(params, name) is not None and name not in self.seams.request_options:
                raise ValueError(f"{name}: this engine has no feature plugged in for it (nanoserve.LLM has)")
        if lora_request is not None:  # the seam: the LoRA feature reads the adapter (needs enable_lora=True)
            if self.seams.check_lora_request is None:
                raise ValueError("lora_request: this engine serves no adapters; pass enable_lora=True")
            self.seams.check_lora_request(lora_request)
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority: got {priority}, but it needs scheduling_policy='priority'")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: this model folder has no tokenizer, so there is no text to find stop strings in")
        max_len = self.config.max_model_len
        if len(token_ids) + params.max_tokens > max_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds max_model_len ({max_len})")
        if params.n > self.config.max_num_seqs:  # a request's sequences run together
            raise ValueError(f"n ({params.n}) exceeds max_num_seqs ({self.config.max_num_seqs})")
        # The prompt's full blocks are shared; each of the n sequences fills the rest on its own.
        bs = self.config.block_size
        num_blocks = len(token_ids) // bs + params.n * cdiv(len(token_ids) % bs + params.max_tokens, bs)
        if num_blocks > self.block_manager.num_blocks:
            raise ValueError(f"prompt + max_tokens needs {num_blocks} KV blocks but num_kvcache_blocks is "
                             f"{self.block_manager.num_blocks} (block_size {self.config.block_size})")

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                    priority: int = 0, lora_request: LoRARequest | None = None) -> None:
        self.check_request(prompt_token_ids, sampling_params, priority, lora_request)
        request = Request(request_id, prompt_token_ids, sampling_params, block_size=self.config.block_size,
                          seq_ids=self.seq_ids, tokenizer=self.tokenizer, priority=priority, lora_request=lora_request)
        for name, set_up in self.seams.request_options.items():  # e.g. compile its grammar, off the step path
            if getattr(sampling_params, name) is not None:
                set_up(request)
        self.add(request)

    def add(self, request: Request) -> None:
        """Queue a checked request (a feature may build its own: beam search); its first sequence waits."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.scheduler.add(request.first_seq)  # the others fork from it once its prompt is done

    def abort_request(self, request_id: str) -> bool:
        """Drop a request and free its blocks. False if there is no such request (it may have finished)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            self.scheduler.finish(seq)
        for observe in self.seams.observers:  # the queues and blocks changed between steps
            observe(None, [])
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self.batch_queue)

    # ---- steps ------------------------------------------------------------------------------------
    def step_fn(self) -> list[EngineCoreOutput]:
        """The step the loops call (a method, not a stored bound method: that would keep the engine in a
        reference cycle, and `del llm` would not free it, nor stop tensor-parallel workers, at once)."""
        return self.step() if self.batch_queue is None else self.step_with_batch_queue()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model, take in its output: one step, the forward in between."""
        out = self.scheduler.schedule()
        try:
            token_ids = self.executor.execute_model(out, self.input_builder.prepare_inputs(out)).tolist()
        except Exception as error:
            return self._fail(out.seqs + out.preempted, error)
        return self._update_from_output(out, token_ids)

    def step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """Async scheduling (vLLM's batch queue): plan step N+1 and build its inputs while step N's forward
        runs (on the GPU, or in the executor thread on CPU), then wait for N and take in its output. Planning
        N+1 counts the token N is sampling as a placeholder; the model runner takes it from N's sampled ids
        when N+1 runs."""
        if not self.scheduler.is_finished() and len(self.batch_queue) < self.config.num_batches_in_flight:
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
            return self._fail(out.seqs + out.preempted, error)
        return self._update_from_output(out, token_ids)

    def _submit(self, out: SchedulerOutput, inputs: ModelInput | None) -> Future:
        """Start a step's forward; its future gives the sampled ids (a CPU tensor)."""
        if self.forward_thread is not None:
            return self.executor.submit(self.forward_thread, out, inputs)
        try:
            return LaunchedStep(self.executor.execute_model(out, inputs))
        except Exception as error:  # failed at launch: the step fails when its turn comes, as on CPU
            future = Future()
            future.set_exception(error)
            return future

    def _update_from_output(self, out: SchedulerOutput, token_ids: list[int]) -> list[EngineCoreOutput]:
        """Fail the requests a failed load from the KV tier left without KV (only them), append the sampled tokens
        (the scheduler finishes sequences on EOS, stop tokens, max_tokens), let the features' after_step seams act,
        then detokenize each new token and look for stop strings; drop the requests that are done."""
        failed = self._fail_invalid_blocks(out) if out.failed_loads else []
        updated = Counter(self.scheduler.postprocess(out, token_ids))  # a sequence once per token it got
        outputs = failed + [output for after_step in self.seams.after_step for output in after_step(out, updated)]
        outputs += [self._output(self.requests[seq.request_id], seq, n) for seq, n in updated.items()]
        for request_id in {output.request_id for output in outputs}:
            if request_id in self.requests and self.requests[request_id].is_finished:
                del self.requests[request_id]
        for observe in self.seams.observers:
            observe(out, list(updated))
        return outputs

    def _output(self, request: Request, seq: Sequence, num_new: int) -> EngineCoreOutput:
        """seq's num_new newest tokens (more than 1 with lookahead tokens) as text; a stop string in that
        text finishes seq there, and the tokens after it are dropped."""
        start, token_id, params = len(seq.token_ids) - num_new, seq.token_ids[-1], request.sampling_params
        stop_reason = token_id if seq.finish_reason == "stop" and token_id in params.stop_token_ids else None
        detokenizer, new_text = request.detokenizers[seq.index], ""
        if detokenizer is not None:
            for i, token_id in enumerate(seq.token_ids[start:], start + 1):
                stop = detokenizer.update(token_id, seq.is_finished and i == len(seq.token_ids))
                if stop is not None:
                    del seq.token_ids[i:]
                    self.scheduler.finish(seq)
                    seq.finish_reason, stop_reason = "stop", stop
                    break
            new_text = detokenizer.get_delta(seq.is_finished)
        # (The model runner wrote the tokens' logprobs when it sampled them; a later step may be ahead.)
        first = start - seq.num_prompt_tokens
        logprobs = None if seq.logprobs is None else seq.logprobs[first : seq.num_completion_tokens]
        return EngineCoreOutput(
            request_id=request.request_id, new_token_ids=seq.token_ids[start:], new_text=new_text,
            finished=seq.is_finished, finish_reason=seq.finish_reason, stop_reason=stop_reason,
            num_cached_tokens=request.first_seq.num_cached_tokens, new_logprobs=logprobs,
            prompt_logprobs=request.first_seq.prompt_logprobs, index=seq.index)

    def _fail(self, seqs: list[Sequence], error: BaseException) -> list[EngineCoreOutput]:
        """A step raised: exactly its requests fail (each caller gets the error) and free their blocks."""
        failed = {seq.request_id for seq in seqs if seq.request_id in self.requests}
        for request_id in failed:
            self.abort_request(request_id)
        return [EngineCoreOutput(request_id, [], finished=True, error=error) for request_id in failed]

    def _fail_invalid_blocks(self, out: SchedulerOutput) -> list[EngineCoreOutput]:
        """Some of the step's loads from the prefix cache's second tier failed: the blocks they were to fill hold
        no valid KV. They leave the prefix cache, and exactly the requests whose sequences hold them fail."""
        invalid = {block_id for _, block_id in out.failed_loads}
        self.block_manager.uncache(invalid)
        seqs = [seq for seq in self.scheduler.running if not invalid.isdisjoint(seq.block_table)]
        # Async scheduling: a step planned since may have swapped a holder out, its bad KV with it.
        swapped_out = {host for planned, _ in self.batch_queue or () for device, host in planned.blocks_to_swap_out
                       if device in invalid}
        seqs += [seq for seq in self.scheduler.swapped if not swapped_out.isdisjoint(seq.block_table)]
        return self._fail(seqs, next(iter(out.failed_loads.values())))

    # ---- the busy loop (vLLM's EngineCoreProc.run_busy_loop), in AsyncLLM's background thread ---------
    def run_busy_loop(self, input_queue: queue.Queue, output_queue) -> None:
        """Take in ("add", request_id, add) (add() queues the request here: engine.add_request with its
        arguments, or a feature's own), ("abort", request_id), ("shutdown", None); step while there is work;
        put each step's outputs on output_queue."""
        while True:
            # Idle, get() sleeps until a request comes (no spinning); busy, it takes only what has come.
            while not self.has_unfinished_requests() or not input_queue.empty():
                kind, request_id, *args = input_queue.get()
                if kind == "shutdown":
                    return
                if kind == "abort" and self.abort_request(request_id):  # tell whoever waits for it
                    output_queue.put_nowait([EngineCoreOutput(request_id, [], finished=True, finish_reason="abort")])
                elif kind == "add":
                    add: Callable[[], None] = args[0]
                    try:
                        add()
                    except ValueError as error:  # a bad request: its caller hears why, the others go on
                        output_queue.put_nowait([EngineCoreOutput(request_id, [], finished=True, error=error)])
            try:
                outputs = self.step_fn()
            except Exception as error:  # a bug outside the forward: fail everyone rather than leave them waiting
                if self.batch_queue:
                    self.batch_queue.clear()
                outputs = self._fail([seq for request in self.requests.values() for seq in request.seqs], error)
            if outputs:
                output_queue.put_nowait(outputs)

    def shutdown(self) -> None:
        if self.forward_thread is not None:
            self.forward_thread.shutdown()
