"""The seams: every place a feature plugs into the core, in one file.

The core (nanoserve/llm.py, this package, models/, layers/) is a complete engine with none of them, and never
imports a feature. A feature (a chapter: speculative decoding, beam search, structured outputs, step records,
tensor and pipeline parallelism, ...) imports the core and adds itself here; nanoserve/chapters.py is the one
place that builds an engine's seams from its config. With every list empty, as for a plain request, the core
runs no feature code.
"""
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from nanoserve.engine.output_processor import EngineCoreOutput
from nanoserve.engine.scheduler_output import SchedulerOutput
from nanoserve.engine.sequence import Request, Sequence
from nanoserve.layers.sampler import LogitsProcessor
from nanoserve.lora_request import LoRARequest

# (the step's plan, each sequence that got tokens -> how many) -> outputs of the requests the hook finished
AfterStep = Callable[[SchedulerOutput, dict[Sequence, int]], list[EngineCoreOutput]]



class KVCacheTier(Protocol):
    """A second tier for the prefix cache, below the device pool (kv_offload/: host memory). The BlockManager
    calls it; the tier records the block copies it wants, and the scheduler takes them into the step's plan."""

    def offload(self, block_id: int, block_hash: int, token_ids: list[int]) -> None:
        """The device is about to reuse block_id, a free block still cached under block_hash: keep its KV."""

    def lookup(self, block_hash: int, token_ids: list[int]) -> bool:
        """Does the tier hold this block (a prefix the device missed)? A hit is kept for this step's copies."""

    def load(self, block_hash: int, block_id: int) -> None:
        """Copy the block held under block_hash into the fresh device block block_id, before the forward."""

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's (device, tier) copies out and (tier, device) copies in, in the order made; the books reset."""

class KVConnector(Protocol):
    """The scheduler's side of a KV connector (vLLM's KVConnectorBase_V1; kv_transfer/: disaggregated prefill):
    prompt KV another engine computed is loaded instead of computed. Its worker side (vLLM's start_load_kv and
    wait_for_save) rides the before_forward and after_step seams, whole blocks at a time."""

    def update_state_after_alloc(self, seq: Sequence) -> None:
        """seq got its blocks, num_computed_tokens of them cached: the connector counts more of its prompt as
        computed (vLLM's get_num_new_matched_tokens) and notes the KV to load into its blocks, this step."""

    def build_connector_meta(self, out: SchedulerOutput) -> object:
        """The step's loads and saves, carried in its plan to the worker side (out.kv_connector_metadata)."""


@dataclass
class Seams:
    # 1. Requests (EngineCore.add_request): a SamplingParams field -> who sets a request up for it, before any
    #    step (structured_outputs: compile the grammar). A request setting a field nobody serves is refused.
    request_options: dict[str, Callable[[Request], None]] = field(default_factory=dict)
    # 2. Scheduling (Scheduler._sits_out): sequences that cannot be planned before their newest token is known,
    #    with async scheduling (a grammar's next mask, drafts proposed from that token).
    needs_newest_token: list[Callable[[Sequence], bool]] = field(default_factory=list)
    # 3. Sampling (layers/sampler.py): logits processors, applied in order to the rows the sampler draws from
    #    (a grammar's mask of allowed tokens). The InputBuilder asks each for its step's state on the host.
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    # 4. Drawing (ModelRunner.sample): picks each row's tokens instead of the sampler's draw (speculative
    #    decoding's verification of the lookahead tokens). (sampler, logits, inputs) -> token ids.
    sample: Callable | None = None
    # 5. Before the forward (Executor.launch): fills the step's lookahead slots on the device (a draft model's
    #    proposals). (plan, inputs, run_draft) -> the inputs to run.
    propose: Callable | None = None
    # 6. After the step (EngineCore._update_from_output), in order: hooks that take the step's tokens in (a grammar
    #    accepts them), pick tokens themselves (beam search), or propose the next step's lookahead tokens.
    after_step: list[AfterStep] = field(default_factory=list)
    # 7. Observers, last: read each step (step records, the dashboard); None when an abort changed the queues.
    observers: list[Callable[[SchedulerOutput | None, list[Sequence]], None]] = field(default_factory=list)
    # 8. Admission (Scheduler._next_waiting): (waiting sequence, the running ones) -> may it join them? One that may
    #    not is skipped this step and keeps its place; those behind it may go (seed 001's curr_loras: LoRA's
    #    max_loras). Swapped requests need no check: none is admitted while any is swapped out.
    admits: list[Callable[[Sequence, list[Sequence]], bool]] = field(default_factory=list)
    # 9. Adapters: a request's lora_request (a record, carried on its sequences; its id roots their block hashes,
    #    block_manager.hash_root) is checked here before anything is queued (EngineCore.check_request: the LoRA
    #    feature reads the adapter, a ValueError names what is wrong). None: a lora_request is refused.
    check_lora_request: Callable[[LoRARequest], None] | None = None
    # 10. Before the forward (Executor.launch), on the process that plans: (plan, inputs) -> None, e.g. LoRA's slot
    #    loads and rows, which it runs on every rank through executor.call("apply", fn, ...) (ModelRunner.apply).
    before_forward: list[Callable[[SchedulerOutput, object], None]] = field(default_factory=list)
    # 11. The executor's class: runs each step on every rank (tensor and pipeline parallelism). None: this
    #    process's ModelRunner alone (engine/executor.py).
    executor_class: type | None = None
    # 12. The prefix cache's second tier (BlockManager): where a cached block's KV goes when the device pool evicts
    #    it, and where a prefix the device misses is looked for (kv_offload/). None: evicted KV is dropped.
    kv_cache_tier: KVCacheTier | None = None
    # 13. KV from another engine (disaggregated prefill: kv_transfer/): a prompt's KV loaded instead of computed
    #    (BlockManager.allocate), and kept for the other engine after the forward (Executor.launch). None: none.
    kv_connector: KVConnector | None = None
    # The features plugged in, by name ("beam_search", "step_records", ...): one that joins with its first
    # request, or that a front end reads (llm.trace), finds its object here.
    features: dict[str, object] = field(default_factory=dict)
