"""The chapters: nanoserve's LLM and AsyncLLM, the core's with every feature plugged in
(`nanoserve.LLM`).

A chapter is a subclass of each core class it changes, overriding methods the core already has, and
each does nothing of its own unless its config asks for it. They meet here, in one composite class
per part of the engine (`ChaptersScheduler` ...), whose bases list them in the order their overrides
run (each calls `super()`, down to the core's). `build_engine(config)` builds the core's classes
alone when the config asks for no chapter, as for a plain request (tests/test_reading_guide.py
checks that it runs the core alone), else the composites. A request asking for a chapter the
engine was built without (logprobs without max_logprobs, ...) is refused, naming the option.
"""
from dataclasses import dataclass

from nanoserve import async_llm, llm
from nanoserve.beam_search.scheduler import (
    BEAM_SEARCH_OFF,
    BeamEngineCore,
    BeamExecutor,
    BeamInputBuilder,
    BeamScheduler,
    BeamSchedulerOutput,
)
from nanoserve.beam_search_params import BeamSearchParams
from nanoserve.config import Config
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.core import EngineCore
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.output_processor import RequestState
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.sequence import Sequence
from nanoserve.kv_offload import (
    HostTierBlockManager,
    HostTierEngineCore,
    HostTierExecutor,
    HostTierScheduler,
    HostTierSchedulerOutput,
)
from nanoserve.kv_transfer import (
    KVTransferBlockManager,
    KVTransferEngineCore,
    KVTransferExecutor,
    KVTransferScheduler,
    KVTransferSchedulerOutput,
)
from nanoserve.logprobs import (
    LogprobsBlockManager,
    LogprobsEngineCore,
    LogprobsInputBuilder,
    LogprobsModelInput,
    LogprobsModelRunner,
)
from nanoserve.lora.engine import LoRAEngineCore, LoRAExecutor, LoRAModelRunner, LoRAScheduler
from nanoserve.lora_request import LoRARequest
from nanoserve.outputs import RequestOutput
from nanoserve.parallel.executor import MultiprocExecutor
from nanoserve.parallel.torchrun import launched_by_torchrun
from nanoserve.persistent_batch import BatchModelInput, InputBatch
from nanoserve.sampling_params import RequestOutputKind
from nanoserve.scheduling.async_scheduling import AsyncScheduler, BatchQueueEngineCore
from nanoserve.scheduling.priority import PriorityEngineCore, PriorityScheduler
from nanoserve.scheduling.swap import (
    SwapEngineCore,
    SwapExecutor,
    SwapScheduler,
    SwapSchedulerOutput,
)
from nanoserve.sliding_window import SlidingWindowBlockManager, frees_blocks, window_block_manager
from nanoserve.spec_decode import (
    SpecDecodeEngineCore,
    SpecDecodeExecutor,
    SpecDecodeInputBuilder,
    SpecDecodeModelInput,
    SpecDecodeModelRunner,
    SpecDecodeScheduler,
    SpecDecodeSchedulerOutput,
)
from nanoserve.spec_decode.proposer import propose_drafts
from nanoserve.step_records import StepRecord, StepRecordsEngineCore
from nanoserve.structured_output.manager import (
    StructuredOutputsEngineCore,
    StructuredOutputsScheduler,
)


# ---- the composites: each part's chapters, in the order their overrides run ----------------------
@dataclass
class ChaptersSchedulerOutput(BeamSchedulerOutput, SpecDecodeSchedulerOutput,
                              KVTransferSchedulerOutput, HostTierSchedulerOutput,
                              SwapSchedulerOutput, SchedulerOutput):
    """The plan with every chapter's fields."""


class ChaptersScheduler(SpecDecodeScheduler, BeamScheduler, StructuredOutputsScheduler,
                        KVTransferScheduler, HostTierScheduler, AsyncScheduler, PriorityScheduler,
                        SwapScheduler, LoRAScheduler, Scheduler):
    """(Beam search's after speculative decoding's: it drops the drafts proposed for a beam.)"""

    output_class = ChaptersSchedulerOutput

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """Where priority meets swap: an urgent newcomer takes blocks from less urgent running
        requests only while nobody is swapped out (a swapped victim would come back before the
        newcomer and take its blocks back)."""
        if not self.swapped:
            super()._preempt_for_priority(out)

    def propose_drafts(self) -> None:
        """Where speculative decoding meets structured outputs: a grammar keeps the drafts it
        allows."""
        manager = self.structured_output_manager
        propose_drafts(self.running, self.speculative_config,
                       None if manager is None else manager.grammar)


class ChaptersBlockManager(LogprobsBlockManager, KVTransferBlockManager, HostTierBlockManager,
                           BlockManager):
    """(Disaggregated prefill's allocate calls super() first: the KV it receives continues the
    prefix that the device and the host tier hold.)"""


class ChaptersWindowBlockManager(LogprobsBlockManager, SlidingWindowBlockManager):
    """The window's block manager (every layer windowed) with the chapters that meet a window:
    logprobs' (the host tier and disaggregated prefill refuse one: window_block_manager)."""


@dataclass
class ChaptersModelInput(SpecDecodeModelInput, LogprobsModelInput, BatchModelInput):
    """The batch with every chapter's fields."""


class ChaptersInputBuilder(SpecDecodeInputBuilder, BeamInputBuilder, LogprobsInputBuilder,
                           InputBatch):
    input_class = ChaptersModelInput


class ChaptersModelRunner(LogprobsModelRunner, SpecDecodeModelRunner, LoRAModelRunner,
                          ModelRunner):
    pass


class ChaptersExecutor(SpecDecodeExecutor, KVTransferExecutor, HostTierExecutor, SwapExecutor,
                       LoRAExecutor, MultiprocExecutor, BeamExecutor):
    """(Beam search's after the ranks': with pipeline stages those receive the logits it reads.)"""


class ChaptersEngineCore(LoRAEngineCore, StepRecordsEngineCore, BeamEngineCore,
                         LogprobsEngineCore, SpecDecodeEngineCore, StructuredOutputsEngineCore,
                         KVTransferEngineCore, HostTierEngineCore, SwapEngineCore,
                         PriorityEngineCore, BatchQueueEngineCore):
    """(The records' core records a step once every chapter after it took it in; LoRA's comes
    first so that it forgets an ended request's adapter only once the step is recorded.)"""

    def seqs_holding(self, block_ids: set[int]) -> list[Sequence]:
        """Where the host tier meets swap and async scheduling: a step planned since the one whose
        loads failed may have swapped a holder of their blocks out, the bad KV with it; its
        swap-outs name the holder's blocks in the swap pool."""
        moved = {host for planned, _ in self.batch_queue
                 for device, host in planned.blocks_to_swap_out if device in block_ids}
        return super().seqs_holding(block_ids) + [
            seq for seq in self.scheduler.swapped if not moved.isdisjoint(seq.block_table)]


def asks_for_chapters(config: Config) -> bool:
    """Does the config turn on any chapter (else the engine is the core's classes alone)?"""
    scheduling = config.scheduler_config
    return any((scheduling.scheduling_policy != "fcfs", scheduling.preemption_mode != "recompute",
                scheduling.async_scheduling, config.device.startswith("cuda"),
                config.parallel_config.world_size > 1, launched_by_torchrun(), frees_blocks(config),
                config.lora_config, config.speculative_config, config.kv_offload_config,
                config.kv_transfer_config, config.observability_config.records_steps,
                config.logprobs_config, config.structured_outputs_config,
                config.beam_search_config))


def build_engine(config: Config) -> EngineCore:
    """The engine the config asks for: the core's classes, or the chapters' composites."""
    if not asks_for_chapters(config):
        return EngineCore(config)
    # (the window's block manager frees blocks behind the window: sliding_window/)
    block_manager_class = (window_block_manager(config, ChaptersWindowBlockManager)
                           or ChaptersBlockManager)
    return ChaptersEngineCore(
        config, executor_class=ChaptersExecutor, block_manager_class=block_manager_class,
        scheduler_class=ChaptersScheduler, input_builder_class=ChaptersInputBuilder,
        model_runner_class=ChaptersModelRunner)


def beam_search_feature(engine: EngineCore) -> BeamEngineCore:
    """The engine as beam search's; the core's alone (no chapter asked for) has none: a ValueError
    naming the option, before anything is queued (BeamEngineCore.check_beam_request says it for
    a composite built without it)."""
    if not isinstance(engine, BeamEngineCore):
        raise ValueError(BEAM_SEARCH_OFF)
    return engine


class LLM(llm.LLM):
    __doc__ = llm.LLM.__doc__
    build_engine = staticmethod(build_engine)

    @property
    def trace(self) -> list[StepRecord] | None:
        """With LLM(..., trace=True): one StepRecord per engine step so far (step_records.py); else
        None."""
        engine = self.engine
        if isinstance(engine, StepRecordsEngineCore) and engine.step_recorder is not None:
            return engine.step_recorder.trace
        return None

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: llm.Params = None,
             use_tqdm: bool = True,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate
        (an API convenience over generate, so it lives here rather than in the core's LLM)."""
        if self.tokenizer is None:
            raise ValueError("chat: this model folder has no tokenizer, so it has no chat template")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        texts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                 for c in conversations]
        # The template already holds any special tokens (BOS): do not let encode add them twice.
        prompts = [{"prompt": t,
                    "prompt_token_ids": self.tokenizer.encode(t, add_special_tokens=False)}
                   for t in texts]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def beam_search(self, prompts: llm.Prompt | list[llm.Prompt], params: BeamSearchParams,
                    use_tqdm: bool = True) -> list[RequestOutput]:
        """One output per prompt with params.beam_width sequences, best first, each with its
        cumulative_logprob (beam_search/scheduler.py; the search follows transformers'
        generate(num_beams=...))."""
        prompts = llm.prompt_list(prompts)
        token_ids = [llm.prompt_token_ids(self.tokenizer, p) for p in prompts]
        beams = beam_search_feature(self.engine)
        for ids in token_ids:  # all checked before any request is queued
            beams.check_beam_request(ids, params)
        return self._add_and_run(
            prompts, token_ids, [params.beam_width] * len(prompts), use_tqdm,
            lambda request_id, i: beams.add_beam_request(request_id, token_ids[i], params))


class AsyncLLM(async_llm.AsyncLLM):
    __doc__ = async_llm.AsyncLLM.__doc__
    build_engine = staticmethod(build_engine)

    async def beam_search(self, prompt: llm.Prompt, params: BeamSearchParams,
                          request_id: str | None = None):
        """vLLM's EngineClient.beam_search: one RequestOutput, once the search is done, with the
        beam_width best sequences, best first (as LLM.beam_search)."""
        token_ids = llm.prompt_token_ids(self.tokenizer, prompt)
        request_id = str(next(self.request_ids)) if request_id is None else request_id
        beams = beam_search_feature(self.engine_core)
        beams.check_beam_request(token_ids, params)
        state = RequestState(request_id, llm.prompt_text(prompt), token_ids,
                             RequestOutputKind.FINAL_ONLY, params.beam_width)

        def add() -> None:  # (runs in the engine thread)
            beams.add_beam_request(request_id, token_ids, params)
        async for output in self._stream(state, ("add", request_id, add)):
            yield output

    def check_beam_request(self, prompt_token_ids: list[int], params: BeamSearchParams) -> None:
        """What beam_search would refuse, as a ValueError, before anything is queued (the server
        asks first)."""
        beam_search_feature(self.engine_core).check_beam_request(prompt_token_ids, params)

