from collections import Counter
from collections.abc import Callable
from itertools import count

from transformers import AutoTokenizer

from nanoserve.config import Config, has_tokenizer
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.model_runner import Executor, InputBuilder, ModelRunner
from nanoserve.engine.output_processor import EngineCoreOutput
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.sequence import Request, Sequence
from nanoserve.lora_request import LoRARequest
from nanoserve.sampling_params import FEATURE_OPTIONS, SamplingParams


class EngineCore:
    """The engine (vLLM V1's EngineCore): owns the requests, the scheduler, the KV blocks and the
    executor (the model). `step()` = schedule -> run the model -> update; the offline LLM calls it
    in a loop, AsyncLLM from a thread. A chapter is a subclass of each part it changes (this
    one's too), built by nanoserve/chapters.py; without any, this is the whole engine."""

    def __init__(self, config: Config, *,
                 executor_class: type[Executor] = Executor,
                 block_manager_class: Callable[..., BlockManager] = BlockManager,
                 scheduler_class: type[Scheduler] = Scheduler,
                 input_builder_class: type[InputBuilder] = InputBuilder,
                 model_runner_class: type[ModelRunner] = ModelRunner):
        self.config = config
        self.executor = executor_class(config, model_runner_class)
        try:  # a failed start ends the executor's workers and process group now (parallel/)
            self.model_runner = self.executor.model_runner  # rank 0's: the model and its KV cache
            self.input_builder = input_builder_class.from_config(config)
            self.block_manager = block_manager_class(
                self.model_runner.num_kvcache_blocks, config.block_size,
                config.enable_prefix_caching)
            self.scheduler = scheduler_class(config, self.block_manager)
            self.tokenizer = (AutoTokenizer.from_pretrained(config.model)
                              if has_tokenizer(config.model) else None)
        except BaseException:
            self.executor.shutdown()
            raise
        self.requests: dict[str, Request] = {}
        self.seq_ids = count()

    # ---- requests ----------------------------------------------------------------------------
    def check_request(self, token_ids: list[int], params: SamplingParams, priority: int = 0,
                      lora_request: LoRARequest | None = None) -> None:
        """Reject what could never run, before any work starts, instead of failing or looping
        later."""
        if not token_ids:
            raise ValueError("prompt: must contain at least one token")
        config = self.config
        vocab_size, max_len = config.hf_config.vocab_size, config.max_model_len
        for name, ids in (("prompt", token_ids), ("stop_token_ids", params.stop_token_ids)):
            if bad := [t for t in ids if not 0 <= t < vocab_size]:  # (past the logits: a crash)
                raise ValueError(f"{name}: token ids must be in [0, vocab_size={vocab_size}), "
                                 f"got {bad[:5]}")
        options = {"priority": priority or None, "lora_request": lora_request}
        for name in FEATURE_OPTIONS:  # what a feature serves: one must be plugged in, and checks it
            value = options[name] if name in options else getattr(params, name)
            if value is not None:
                self.check_option(name, value)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: this model folder has no tokenizer, so there is no text to "
                             "find stop strings in")
        if len(token_ids) + params.max_tokens > max_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds max_model_len ({max_len})")
        if params.n > config.max_num_seqs:  # a request's sequences run together
            raise ValueError(f"n ({params.n}) exceeds max_num_seqs ({config.max_num_seqs})")
        self.block_manager.check_fits(len(token_ids), params.max_tokens, params.n)

    def check_option(self, name: str, value: object) -> None:
        """A request sets an option a chapter serves (FEATURE_OPTIONS): the core serves none, so it
        refuses it, saying which option of the engine's turns the chapter on."""
        raise ValueError(f"{name}: this engine has no feature plugged in for it; "
                         f"{FEATURE_OPTIONS[name]}")

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> None:
        self.check_request(prompt_token_ids, sampling_params, priority, lora_request)
        request = Request(request_id, prompt_token_ids, sampling_params,
                          block_size=self.config.block_size, seq_ids=self.seq_ids,
                          tokenizer=self.tokenizer)
        self.add(request)

    def add(self, request: Request) -> None:
        """Queue a checked request (a feature may build its own: beam search); its first sequence
        waits."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.scheduler.add(request.first_seq)  # the others fork from it once its prompt is done

    def abort_request(self, request_id: str) -> bool:
        """Drop a request and free its blocks. False if there is no such request (it may have
        finished)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            self.scheduler.finish(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- a step ------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model, take in its output: one step, the forward in between."""
        out = self.scheduler.schedule()
        try:
            inputs = self.input_builder.prepare_inputs(out)
            token_ids = self.executor.execute_model(out, inputs).tolist()
        except Exception as error:
            return self.fail(out.seqs + out.preempted, error)
        return self._update_from_output(out, token_ids)

    def _update_from_output(self, out: SchedulerOutput,
                            token_ids: list[int]) -> list[EngineCoreOutput]:
        """Append the sampled tokens (the scheduler finishes sequences on EOS, stop tokens,
        max_tokens); then detokenize them and look for stop strings; drop the requests that are
        done."""
        updated = Counter(self.scheduler.postprocess(out, token_ids))  # a sequence once per token
        outputs = [self._output(self.requests[seq.request_id], seq, n)
                   for seq, n in updated.items()]
        for request_id in {output.request_id for output in outputs if output.finished}:
            if request_id in self.requests and self.requests[request_id].is_finished:
                del self.requests[request_id]
        return outputs

    def _output(self, request: Request, seq: Sequence, num_new: int) -> EngineCoreOutput:
        """seq's num_new newest tokens (more than 1 with lookahead tokens) as text; a stop string in
        that text finishes seq there, and the tokens after it are dropped."""
        start, token_id = len(seq.token_ids) - num_new, seq.token_ids[-1]
        params = request.sampling_params
        stopped = seq.finish_reason == "stop" and token_id in params.stop_token_ids
        stop_reason = token_id if stopped else None
        detokenizer, new_text, finished = request.detokenizers[seq.index], "", seq.is_finished
        if detokenizer is not None:
            for i, token_id in enumerate(seq.token_ids[start:], start + 1):
                stop = detokenizer.update(token_id, finished and i == len(seq.token_ids))
                if stop is not None:
                    del seq.token_ids[i:]
                    self.scheduler.finish(seq)
                    seq.finish_reason, stop_reason, finished = "stop", stop, True
                    break
            new_text = detokenizer.get_delta(finished)
        return EngineCoreOutput(
            request_id=request.request_id, new_token_ids=seq.token_ids[start:], new_text=new_text,
            finished=finished, finish_reason=seq.finish_reason, stop_reason=stop_reason,
            num_cached_tokens=request.first_seq.num_cached_tokens, index=seq.index)

    def fail(self, seqs: list[Sequence], error: BaseException) -> list[EngineCoreOutput]:
        """A step raised: exactly its requests fail (each caller gets the error) and free their
        blocks."""
        failed = {seq.request_id for seq in seqs if seq.request_id in self.requests}
        for request_id in failed:
            self.abort_request(request_id)
        return [EngineCoreOutput(request_id, [], finished=True, error=error)
                for request_id in failed]

    def fail_all(self, error: BaseException) -> list[EngineCoreOutput]:
        """A bug outside the forward (AsyncLLM's busy loop): everyone fails rather than wait
        forever."""
        return self.fail([seq for request in self.requests.values() for seq in request.seqs], error)

    def shutdown(self) -> None:
        self.executor.shutdown()
