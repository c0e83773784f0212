"""The chapters: nanoserve's LLM and AsyncLLM, the core's with every feature plugged in (`nanoserve.LLM`).

`build_engine(config)` is the one place that builds an engine from its config: it picks each part's class (the
core's, or a chapter's subclass of it: the scheduler designs, the window's block manager, the persistent batch, the
ranks' executor, async scheduling's engine; chapters that meet on one class meet here, as PrioritySwapScheduler),
then hands the other features their seams (engine/seams.py). A feature the config asks for is plugged in here, its
module imported only then; a feature a request asks for (structured outputs, beam search) joins with its first
request. A plain request asks for none, so it runs the core alone (tests/test_reading_guide.py checks that).
"""
import weakref
from functools import partial

from nanoserve import async_llm, llm
from nanoserve.beam_search_params import BeamSearchParams
from nanoserve.config import Config, sliding_windows
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.core import EngineCore
from nanoserve.engine.output_processor import RequestState
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.scheduler_output import SchedulerOutput
from nanoserve.engine.seams import Seams
from nanoserve.lora_request import LoRARequest
from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import RequestOutputKind
from nanoserve.scheduling.priority import PriorityScheduler, check_priority
from nanoserve.scheduling.swap import SwapScheduler
from nanoserve.scheduling.swap import plug_in as plug_in_swap
from nanoserve.step_records import StepRecord, step_recorder


class PrioritySwapScheduler(PriorityScheduler, SwapScheduler):
    """Where priority meets swap: the queues are sorted by priority, preemption swaps when the host pool has
    room, and an urgent newcomer takes blocks from less urgent running requests only while nobody is swapped
    out (a swapped victim would come back before the newcomer and take its blocks back)."""

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        if not self.swapped:
            super()._preempt_for_priority(out)


def scheduler_class(config: Config) -> type[Scheduler]:
    """The core's Scheduler, or the subclass of the scheduler designs the config asks for (scheduling/)."""
    scheduling = config.scheduler_config
    priority = scheduling.scheduling_policy == "priority"
    swap = scheduling.preemption_mode == "swap"
    if priority:
        return PrioritySwapScheduler if swap else PriorityScheduler
    return SwapScheduler if swap else Scheduler


def build_engine(config: Config) -> EngineCore:
    """The engine config asks for: each part the core's class or a chapter's subclass of it, chosen here."""
    from nanoserve.parallel.torchrun import launched_by_torchrun

    seams, parts = Seams(), {"scheduler_class": scheduler_class(config)}
    if config.parallel_config.world_size > 1 or launched_by_torchrun():
        from nanoserve.parallel.executor import MultiprocExecutor  # the ranks: parallel/

        parts["executor_class"] = MultiprocExecutor
    if any(sliding_windows(config.hf_config)):  # blocks freed behind the window: sliding_window/
        from nanoserve.sliding_window import window_block_manager

        if (block_manager_class := window_block_manager(config)) is not None:
            parts["block_manager_class"] = block_manager_class
    scheduling = config.scheduler_config
    if scheduling.scheduling_policy == "priority":  # generate(..., priority=[...]): priority.py
        seams.request_checks["priority"] = check_priority
    if config.device.startswith("cuda") or scheduling.async_scheduling:  # persistent_batch.py
        from nanoserve.persistent_batch import InputBatch

        parts["input_builder_class"] = InputBatch
    engine_class = EngineCore
    if scheduling.async_scheduling:  # vLLM's batch queue: scheduling/async_scheduling.py
        from nanoserve.scheduling.async_scheduling import BatchQueueEngineCore as engine_class
    if config.kv_offload_config is not None or config.kv_transfer_config is not None:
        engine_class = kv_parts(parts, engine_class)  # TEMPORARY: until the composites
    engine = engine_class(config, seams, **parts)
    try:  # a chapter that cannot plug in (a host pool too small for a block, ...) ends the engine's workers now
        if scheduling.preemption_mode == "swap":  # the swap pool, in the device pool's class
            plug_in_swap(engine, parts.get("block_manager_class", BlockManager))
        plug_in_chapters(engine)
    except BaseException:
        engine.shutdown()
        raise
    return engine


def kv_parts(parts: dict, engine_class: type) -> type:
    """TEMPORARY wiring of kv_offload/ and kv_transfer/ (replaced by chapters.py's composites)."""
    from dataclasses import dataclass

    from nanoserve import kv_offload as o
    from nanoserve import kv_transfer as t
    from nanoserve.engine.model_runner import Executor

    out = dataclass(type("Out", (t.KVTransferSchedulerOutput, o.HostTierSchedulerOutput), {}))
    parts["scheduler_class"] = type("S", (t.KVTransferScheduler, o.HostTierScheduler,
                                          parts["scheduler_class"]), {"output_class": out})
    parts["block_manager_class"] = type("B", (t.KVTransferBlockManager, o.HostTierBlockManager,
                                              parts.get("block_manager_class", BlockManager)), {})
    parts["executor_class"] = type("X", (t.KVTransferExecutor, o.HostTierExecutor,
                                         parts.get("executor_class", Executor)), {})
    return type("E", (t.KVTransferEngineCore, o.HostTierEngineCore, engine_class), {})


def plug_in_chapters(engine: EngineCore) -> None:
    """The chapters the config asks for, once the engine is built, and those a request may ask for."""
    config, seams = engine.config, engine.seams
    if config.speculative_config is not None:  # speculative decoding: spec_decode/
        from nanoserve.spec_decode import plug_in

        plug_in(engine)
    if config.lora_config is not None:  # LoRA adapters: lora/
        from nanoserve.lora import LoRAManager

        LoRAManager.plug_in(engine)
    if config.observability_config.trace:  # step records: step_records.py (the dashboard: its own)
        step_recorder(engine, keep=True)
    # (A weak reference: the engine owns its seams, and a strong one back would keep `del llm` from freeing it,
    # and from stopping tensor-parallel workers, at once.)
    weak = weakref.proxy(engine)
    seams.request_checks["structured_outputs"] = lambda spec: None  # (SamplingParams checked it; compiled at add)
    seams.request_options["structured_outputs"] = lambda request: structured_output_manager(weak).add_request(request)
    for name in ("logprobs", "prompt_logprobs"):  # logprobs.py: plugged in with the first request that asks
        seams.request_checks[name] = partial(check_num_logprobs, name, config.hf_config.vocab_size)
        seams.request_options[name] = lambda request: logprobs_feature(weak)


def check_num_logprobs(name: str, vocab_size: int, k: int) -> None:
    if k > vocab_size:
        raise ValueError(f"{name}: got {k}, the vocabulary has {vocab_size} tokens")


def logprobs_feature(engine: EngineCore) -> None:
    """The logprobs chapter (logprobs.py), plugged into the engine's seams with the first request that asks."""
    if "logprobs" not in engine.seams.features:
        from nanoserve.logprobs import plug_in

        plug_in(engine)


def structured_output_manager(engine: EngineCore):
    """The engine's StructuredOutputManager, plugged into its seams with the first structured request."""
    if "structured_outputs" not in engine.seams.features:
        from nanoserve.structured_output.manager import StructuredOutputManager

        StructuredOutputManager.plug_in(engine)
    return engine.seams.features["structured_outputs"]


def beam_search_feature(engine: EngineCore):
    """The engine's BeamScheduler, plugged into its seams with the first beam search."""
    if "beam_search" not in engine.seams.features:
        from nanoserve.beam_search.scheduler import BeamScheduler

        BeamScheduler.plug_in(engine)
    return engine.seams.features["beam_search"]


class LLM(llm.LLM):
    __doc__ = llm.LLM.__doc__
    build_engine = staticmethod(build_engine)

    @property
    def trace(self) -> list[StepRecord] | None:
        """With LLM(..., trace=True): one StepRecord per engine step so far (step_records.py); else None."""
        recorder = self.engine.seams.features.get("step_records")
        return None if recorder is None else recorder.trace

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: llm.Params = None,
             use_tqdm: bool = True,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate (an API
        convenience over generate, so it lives here rather than in the core's LLM)."""
        if self.tokenizer is None:
            raise ValueError("chat: this model folder has no tokenizer, so it has no chat template")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        texts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                 for c in conversations]
        # The template already holds any special tokens (BOS): do not let encode add them twice.
        prompts = [{"prompt": t, "prompt_token_ids": self.tokenizer.encode(t, add_special_tokens=False)}
                   for t in texts]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def beam_search(self, prompts: llm.Prompt | list[llm.Prompt], params: BeamSearchParams,
                    use_tqdm: bool = True) -> list[RequestOutput]:
        """One output per prompt with params.beam_width sequences, best first, each with its cumulative_logprob
        (beam_search/scheduler.py; the search follows transformers' generate(num_beams=...))."""
        prompts = llm.prompt_list(prompts)
        token_ids = [llm.prompt_token_ids(self.tokenizer, p) for p in prompts]
        beams = beam_search_feature(self.engine)
        for ids in token_ids:  # all checked before any request is queued
            beams.check_request(ids, params)
        return self._add_and_run(prompts, token_ids, [params.beam_width] * len(prompts), use_tqdm,
                                 lambda request_id, i: beams.add_request(request_id, token_ids[i], params))


class AsyncLLM(async_llm.AsyncLLM):
    __doc__ = async_llm.AsyncLLM.__doc__
    build_engine = staticmethod(build_engine)

    async def beam_search(self, prompt: llm.Prompt, params: BeamSearchParams, request_id: str | None = None):
        """vLLM's EngineClient.beam_search: one RequestOutput, once the search is done, with the beam_width best
        sequences, best first (as LLM.beam_search)."""
        token_ids = llm.prompt_token_ids(self.tokenizer, prompt)
        request_id = str(next(self.request_ids)) if request_id is None else request_id
        beams = beam_search_feature(self.engine_core)
        beams.check_request(token_ids, params)
        state = RequestState(request_id, llm.prompt_text(prompt), token_ids, RequestOutputKind.FINAL_ONLY,
                             params.beam_width)
        add = lambda: beams.add_request(request_id, token_ids, params)  # noqa: E731 (runs in the engine thread)
        async for output in self._stream(state, ("add", request_id, add)):
            yield output

    def check_beam_request(self, prompt_token_ids: list[int], params: BeamSearchParams) -> None:
        """What beam_search would refuse, as a ValueError, before anything is queued (the server asks first)."""
        beam_search_feature(self.engine_core).check_request(prompt_token_ids, params)

