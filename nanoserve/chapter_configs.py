"""The chapters' options, each chapter's in its own record beside the core's Config, as vLLM's
VllmConfig holds a LoRAConfig, a ParallelConfig, a SchedulerConfig beside its ModelConfig:
`config.lora_config.max_loras`.

`LLM(model, **options)` and `nanoserve serve`'s flags keep vLLM's flat names (`max_loras=4`,
`--max-loras 4`); config.make_config gathers each record's fields from them. Speculative decoding's
and disaggregated prefill's records, which vLLM too takes whole (`speculative_config={...}`), have
their own modules.

A leaf module (no torch), like speculative_config.py, so that config.py can import it.
"""
import importlib.util
import os
from dataclasses import dataclass
from numbers import Integral, Real

from nanoserve.utils.records import check_limits


@dataclass
class ParallelConfig:
    """How the model is split over ranks (vLLM's ParallelConfig, docs/parallelism.md). Config always
    holds one: 1 x 1 is the core's single process."""

    tensor_parallel_size: int = 1  # ranks that each hold 1/N of every layer: N processes, N GPUs
    pipeline_parallel_size: int = 1  # stages that each hold 1/P of the layers, T ranks each

    def __post_init__(self) -> None:
        check_limits(self, (("tensor_parallel_size", Integral, lambda v: v >= 1, ">= 1"),
                            ("pipeline_parallel_size", Integral, lambda v: v >= 1, ">= 1")))

    @property
    def world_size(self) -> int:
        """The ranks in all (vLLM's name): P stages of T ranks."""
        return self.pipeline_parallel_size * self.tensor_parallel_size


@dataclass
class SchedulerConfig:
    """The scheduler designs beside the core's first come, first served with recompute
    (nanoserve/scheduling/). vLLM's SchedulerConfig holds the policy and async scheduling; V0's
    CacheConfig held swap_space. Config always holds one: its defaults are the core's scheduler."""

    scheduling_policy: str = "fcfs"  # "fcfs", or "priority": lower `priority` first (V0)
    preemption_mode: str = "recompute"  # "recompute" drops a preempted KV; "swap" moves it to host
    swap_space: float = 4.0  # GiB of host memory for swapped-out KV blocks (preemption_mode="swap")
    # (None: on with CUDA, where it hides the host's time behind the GPU's, as vLLM's default; off
    # on CPU, whose plain step the reading guide follows. Config decides it, knowing the device.)
    async_scheduling: bool | None = None  # plan step N+1 while step N runs; None: on with CUDA

    def __post_init__(self) -> None:
        check_limits(self, (("swap_space", Real, lambda v: v >= 0, ">= 0 (GiB)"),),
                     (("scheduling_policy", ("fcfs", "priority")),
                      ("preemption_mode", ("recompute", "swap"))))
        if self.preemption_mode == "swap" and self.swap_space == 0:
            raise ValueError("preemption_mode='swap' needs swap_space > 0: with no host memory "
                             "nothing can be swapped")


@dataclass
class LoRAConfig:
    """LoRA adapters, many in one batch (vLLM's LoRAConfig, nanoserve/lora/). Config holds one only
    with enable_lora=True, as vLLM does."""

    max_loras: int = 1  # adapters one step may use: their A and B weights fill as many slots
    max_lora_rank: int = 16  # the largest rank an adapter may have (the slots' size)
    max_cpu_loras: int | None = None  # adapters kept read in host memory (an LRU); None: max_loras

    def __post_init__(self) -> None:
        check_limits(self, (("max_loras", Integral, lambda v: v >= 1, ">= 1"),
                            ("max_lora_rank", Integral, lambda v: v >= 1, ">= 1"),
                            ("max_cpu_loras", Integral, lambda v: v >= 1, ">= 1")),
                     may_be_none=("max_cpu_loras",))
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:  # the host cache holds at least the slots' adapters
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")


@dataclass
class KVOffloadConfig:
    """The prefix cache's host tier (nanoserve/kv_offload/; vLLM's kv_offloading_size): cached
    blocks evicted from the device pool wait in host memory. Config holds one only with size > 0."""

    kv_offloading_size: float = 0.0  # GiB of host memory for evicted cached blocks; 0: off

    def __post_init__(self) -> None:
        check_limits(self, (("kv_offloading_size", Real, lambda v: v >= 0, ">= 0 (GiB)"),))
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        if self.kv_offloading_size > total:
            raise ValueError(f"kv_offloading_size ({self.kv_offloading_size} GiB) exceeds this "
                             f"host's memory ({total:.1f} GiB)")


@dataclass
class SlidingWindowConfig:
    """Attention windows (nanoserve/sliding_window/): the model's config.json turns them on, this
    record can turn them off (vLLM keeps the flag on its ModelConfig). Config always holds one."""

    disable_sliding_window: bool = False  # full attention, max_model_len capped at the window


@dataclass
class ObservabilityConfig:
    """What the engine records about itself (vLLM's ObservabilityConfig): step records
    (step_records.py). Config always holds one."""

    trace: bool = False  # record every step in llm.trace (tools/trace.py prints and plots it)
    step_records: bool = False  # record every step for listeners, keeping none (serve --dashboard)

    @property
    def records_steps(self) -> bool:
        """Does the engine make step records (StepRecordsEngineCore)? trace keeps them too."""
        return self.trace or self.step_records


# The chapters a request asks for. vLLM serves them on every engine; nanoserve's LLM(...) builds
# them only when asked, so that a plain engine runs the core alone. `nanoserve serve` asks for all
# three (serving/cli.py's SERVE_DEFAULTS), so the OpenAI API serves them as vLLM's does.
@dataclass
class LogprobsConfig:
    """Logprobs (nanoserve/logprobs.py; SamplingParams.logprobs and prompt_logprobs). vLLM keeps
    max_logprobs on its ModelConfig, default 20; nanoserve's default is 0, the chapter off (a
    request that asks is refused, naming the option). Config holds one only with max_logprobs > 0.
    """

    max_logprobs: int = 0  # the most logprobs / prompt_logprobs a request may ask; 0: none (off)

    def __post_init__(self) -> None:
        check_limits(self, (("max_logprobs", Integral, lambda v: v >= 0, ">= 0 (0: off)"),))


@dataclass
class StructuredOutputsConfig:
    """Structured outputs (nanoserve/structured_output/; SamplingParams.structured_outputs), with
    xgrammar, the one backend here (vLLM's StructuredOutputsConfig picks among several: its
    `backend`). Config holds one only with enable_structured_outputs=True."""

    def __post_init__(self) -> None:
        if importlib.util.find_spec("xgrammar") is None:  # (an optional extra)
            raise ValueError("enable_structured_outputs needs xgrammar: "
                             "pip install 'nanoserve[structured]'")


@dataclass
class BeamSearchConfig:
    """Beam search (nanoserve/beam_search/; LLM.beam_search). vLLM has no such option: its beam
    search runs in the front end, as plain requests; nanoserve's runs in the engine, which picks
    each step's beams itself. Config holds one only with enable_beam_search=True."""


# The flat options that turn on a record that is otherwise None, with their help (vLLM's
# enable_lora: LoRAConfig has no field for it, its presence is the switch).
SWITCHES = {
    "enable_lora": "serve LoRA adapters (generate(..., lora_request=...); nanoserve/lora/)",
    "enable_structured_outputs": "serve SamplingParams.structured_outputs (a JSON schema, regex, "
    "choice or grammar; nanoserve/structured_output/, needs xgrammar)",
    "enable_beam_search": "serve beam search (LLM.beam_search, the server's use_beam_search; "
    "nanoserve/beam_search/)",
}
