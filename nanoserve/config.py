import os
from dataclasses import Field, dataclass, field, fields
from numbers import Integral, Real

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig

from nanoserve.chapter_configs import (
    SWITCHES,
    BeamSearchConfig,
    KVOffloadConfig,
    LogprobsConfig,
    LoRAConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    SlidingWindowConfig,
    StructuredOutputsConfig,
)
from nanoserve.kv_transfer_config import KVTransferConfig
from nanoserve.speculative_config import SpeculativeConfig
from nanoserve.utils.backends import (
    build_cpu_kernels,
    pick_attention_backend,
    pick_elementwise_backend,
)
from nanoserve.utils.default_model import resolve_model
from nanoserve.utils.records import check_limits


def has_tokenizer(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, f))
               for f in ("tokenizer.json", "tokenizer_config.json"))


def kv_sizes(c: PretrainedConfig) -> tuple[int, int, int]:
    """(vocab_size, num_key_value_heads, head_dim): what a draft model must share with its
    target."""
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.vocab_size, c.num_key_value_heads, head_dim


def check_tensor_parallel_shapes(c: PretrainedConfig, n: int, field: str = "") -> None:
    """Tensor parallelism gives every rank an equal share of each layer: n ranks must divide the
    heads and the MLP's width. `field` names the model in the error when it is not the target (the
    draft's)."""
    prefix = f"{field}: " if field else ""
    for name in ("num_attention_heads", "intermediate_size"):
        if getattr(c, name) % n:
            raise ValueError(f"{prefix}tensor_parallel_size ({n}) must divide {name} "
                             f"({getattr(c, name)})")
    if c.num_key_value_heads % n and n % c.num_key_value_heads:
        raise ValueError(f"{prefix}tensor_parallel_size ({n}) and num_key_value_heads "
                         f"({c.num_key_value_heads}) must divide one another (fewer KV heads than "
                         "ranks are replicated)")


def sliding_windows(c: PretrainedConfig) -> list[int]:
    """Each layer's attention window (0: the whole context), as transformers 5 decides:
    c.sliding_window for the layers its layer_types calls "sliding_attention" (Qwen2: those from
    max_window_layers on), or for all (Mistral)."""
    window, types = getattr(c, "sliding_window", None), getattr(c, "layer_types", None)
    return [window if window is not None and t == "sliding_attention" else 0
            for t in types or ["sliding_attention"] * c.num_hidden_layers]


# The range of each numeric option of the core's (utils/records.py's check_limits reads the rows;
# the chapters' records, chapter_configs.py, check their own).
LIMITS = (
    ("max_num_seqs", Integral, lambda v: v >= 1, ">= 1"),
    ("max_num_batched_tokens", Integral, lambda v: v >= 1, ">= 1"),
    ("max_model_len", Integral, lambda v: v >= 1, ">= 1"),
    ("block_size", Integral, lambda v: v >= 1, ">= 1"),
    ("num_kvcache_blocks", Integral, lambda v: v >= 1, ">= 1"),  # or None: sized from memory
    ("gpu_memory_utilization", Real, lambda v: 0 < v <= 1, "in (0, 1]"),
    ("cpu_kvcache_space", Real, lambda v: v > 0, "> 0 (GiB)"),
)
CHOICES = (
    ("dtype", ("float32", "bfloat16", "float16")),
    ("kv_cache_dtype", ("auto", "fp8")),
)
# kv_cache_dtype="fp8" is e4m3 (vLLM's "fp8", i.e. "fp8_e4m3"): 3 mantissa bits, finite up to +-448.
# vLLM scales K and V by a per-layer k_scale/v_scale that is 1.0 unless the checkpoint was
# calibrated; nanoserve loads no calibrated checkpoints, so the scale is always 1.0 and left out.
# Values past +-448 saturate (docs/benchmarks.md).
FP8_KV_DTYPE = torch.float8_e4m3fn


@dataclass
class Config:
    """The core's engine settings, named as in vLLM's `LLM(...)` so workshop code ports, and each
    chapter's record (chapter_configs.py), as vLLM's VllmConfig holds them: None where a switched
    chapter is off."""

    model: str
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    max_model_len: int = 4096
    # tokens per KV block; None: 256 with flash-attn (its minimum), else 16
    block_size: int | None = None
    # "flash_attn", "triton", "cpu" or "torch"; "auto": the first that runs here
    attention_backend: str = "auto"
    num_kvcache_blocks: int | None = None  # force the KV pool size; None sizes it from memory
    gpu_memory_utilization: float = 0.9  # CUDA: share of GPU memory the engine may fill
    cpu_kvcache_space: float = 2.0  # CPU: GiB of RAM for the KV cache (like VLLM_CPU_KVCACHE_SPACE)
    enable_prefix_caching: bool = True
    # vLLM V1: a token budget per step; long prompts are cut into chunks
    enable_chunked_prefill: bool = False
    enforce_eager: bool = False  # True disables CUDA graphs
    # RMSNorm, SwiGLU, RoPE: "cpu", "triton", "compile" or "torch"; "auto": fused
    elementwise_backend: str = "auto"
    dtype: str = "auto"  # "auto": bfloat16 on CUDA, float32 on CPU
    # "auto": the model's dtype; "fp8": e4m3, half of bfloat16's bytes (vLLM's name)
    kv_cache_dtype: str = "auto"
    device: str = "auto"  # "auto": CUDA when available, else CPU
    seed: int = 0
    # The chapters' records. Speculative decoding's and disaggregated prefill's are given whole,
    # as in vLLM (`speculative_config={...}`, `--speculative-config JSON`): a dict becomes a record.
    # docs/speculative.md; None: no speculation
    speculative_config: dict | SpeculativeConfig | None = None
    # disaggregated prefill (docs/disaggregated.md)
    kv_transfer_config: dict | KVTransferConfig | None = None
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora_config: LoRAConfig | None = None  # None: enable_lora=False
    kv_offload_config: KVOffloadConfig | None = None  # None: kv_offloading_size=0
    sliding_window_config: SlidingWindowConfig = field(default_factory=SlidingWindowConfig)
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    # The chapters a request asks for (off unless asked: nanoserve serve asks for them)
    logprobs_config: LogprobsConfig | None = None  # None: max_logprobs=0
    structured_outputs_config: StructuredOutputsConfig | None = None  # None: not enabled
    beam_search_config: BeamSearchConfig | None = None  # None: enable_beam_search=False
    hf_config: PretrainedConfig = field(init=False, repr=False)
    # draft_model's
    draft_hf_config: PretrainedConfig | None = field(init=False, repr=False, default=None)
    eos_token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._read_model()
        self._resolve_auto()
        self._validate()

    def _read_model(self) -> None:
        """config.json (and generation_config.json): the architecture, the context cap, the EOS
        ids."""
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"model: {self.model!r} is not a model folder (no config.json found "
                             "in it)")
        self.hf_config = AutoConfig.from_pretrained(self.model)
        self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)
        window = getattr(self.hf_config, "sliding_window", None)
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                   or window < 1):
            raise ValueError("sliding_window (the model's config.json) must be an integer >= 1, "
                             f"got {window!r}")
        # disable_sliding_window: then attention sees the window's tokens at most
        if window is not None and self.sliding_window_config.disable_sliding_window:
            self.max_model_len = min(self.max_model_len, window)
            self.hf_config.sliding_window = None
        eos = self.hf_config.eos_token_id
        if os.path.isfile(os.path.join(self.model, "generation_config.json")):
            # what HF generate stops on
            eos = GenerationConfig.from_pretrained(self.model).eos_token_id or eos
        self.eos_token_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def _resolve_auto(self) -> None:
        """Turn each "auto" (or None) into what runs on this machine."""
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device == "cuda" else "float32"
        if self.scheduler_config.async_scheduling is None:
            self.scheduler_config.async_scheduling = self.device == "cuda"
        build_cpu_kernels(self.attention_backend, self.elementwise_backend, self.device, self.dtype)
        self.attention_backend = pick_attention_backend(self.attention_backend, self.device,
                                                        self.dtype, self.kv_cache_dtype)
        self.elementwise_backend = pick_elementwise_backend(self.elementwise_backend, self.device,
                                                            self.dtype)
        # The PyTorch attention copies each sequence's KV out block by block, padding to whole
        # blocks, so small blocks waste less (16 is vLLM's default); flash-attn's paged kernels
        # need 256. The Triton kernels find a token's block with shifts and masks: any power of two
        # from 16 up.
        if self.block_size is None:
            self.block_size = 256 if self.attention_backend == "flash_attn" else 16

    def _validate(self) -> None:
        """The limits table, the choices, then what depends on several options or on the model."""
        check_limits(self, LIMITS, CHOICES, may_be_none=("num_kvcache_blocks",))
        if self.attention_backend == "flash_attn" and self.block_size % 256:
            raise ValueError("block_size must be a multiple of 256 for flash-attn, "
                             f"got {self.block_size}")
        bs = self.block_size
        if self.attention_backend == "triton" and (bs < 16 or bs & (bs - 1)):
            raise ValueError("block_size must be a power of two >= 16 for the Triton kernels, "
                             f"got {self.block_size}")
        if self.kv_offload_config is not None and not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size needs enable_prefix_caching=True: the host tier "
                             "finds blocks by hash")
        # Without chunked prefill a prompt is computed in one step, so it must fit the token budget.
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}), or set enable_chunked_prefill=True"
            )
        n = self.parallel_config.tensor_parallel_size
        check_tensor_parallel_shapes(self.hf_config, n)
        if n > 1 and self.device == "cuda" and n > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size ({n}) exceeds the {torch.cuda.device_count()} "
                             "CUDA devices")
        self._validate_pipeline()
        if self.speculative_config is not None:
            self._validate_speculative_config()
        if self.kv_transfer_config is not None:
            # its own keys; the chapter checks what it needs of the engine
            self.kv_transfer_config = KVTransferConfig.from_dict(self.kv_transfer_config)
        if dist.is_initialized():
            # the layers take their rank from it (layers/linear.py): it must be ours
            raise ValueError("torch.distributed is already initialized in this process (by an LLM "
                             "with tensor_parallel_size > 1 that is still alive?): delete that LLM "
                             "first")

    def _validate_pipeline(self) -> None:
        """Every stage needs a layer; torchrun must have started P x T ranks; on one machine every
        rank needs a GPU."""
        parallel, num_layers = self.parallel_config, self.hf_config.num_hidden_layers
        p, t = parallel.pipeline_parallel_size, parallel.tensor_parallel_size
        if p > num_layers:
            raise ValueError(f"pipeline_parallel_size ({p}) exceeds the model's {num_layers} "
                             "layers (num_hidden_layers): every stage needs at least one")
        world = parallel.world_size
        if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", world)) != world:
            # parallel/torchrun.py
            raise ValueError(f"torchrun started WORLD_SIZE={os.environ['WORLD_SIZE']} processes, "
                             f"but pipeline_parallel_size x tensor_parallel_size is {p} x {t}")
        if (p > 1 and self.device == "cuda" and world > torch.cuda.device_count()
                and "RANK" not in os.environ):
            raise ValueError(f"pipeline_parallel_size x tensor_parallel_size ({p} x {t}) "
                             f"exceeds the {torch.cuda.device_count()} CUDA devices")
        if p > 1:
            # a CUDA graph would replay a stage's send/recv with stale shapes: stages run eagerly
            self.enforce_eager = True

    def _validate_speculative_config(self) -> None:
        """Its own keys (speculative_config.py), then the draft model's fit with the target."""
        spec = self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        if spec.method == "draft_model":
            self._read_draft_model(spec.model)

    def _read_draft_model(self, path: str) -> None:
        """The draft model proposes token ids of the target's vocabulary, and its layers become more
        layers of the target's KV cache (the same blocks): the same tokenizer, KV heads and head
        size; split as the target is."""
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"speculative_config.model: {path!r} is not a model folder (no "
                             "config.json found in it)")
        draft = self.draft_hf_config = AutoConfig.from_pretrained(path)
        for name, mine, theirs in zip(("vocab_size", "num_key_value_heads", "head_dim"),
                                      *map(kv_sizes, (draft, self.hf_config))):
            if mine != theirs:
                raise ValueError(f"speculative_config.model: the draft's {name} ({mine}) differs "
                                 f"from the target's ({theirs}); it must share the tokenizer and "
                                 "fit the same KV cache blocks")
        vocabs = [AutoTokenizer.from_pretrained(p).get_vocab()
                  for p in (path, self.model) if has_tokenizer(p)]
        if len(vocabs) == 2 and vocabs[0] != vocabs[1]:
            raise ValueError("speculative_config.model: the draft's tokenizer differs from the "
                             "target's")
        parallel = self.parallel_config
        check_tensor_parallel_shapes(draft, parallel.tensor_parallel_size,
                                     "speculative_config.model")
        if parallel.pipeline_parallel_size > 1:
            raise ValueError("speculative_config.method='draft_model' needs "
                             "pipeline_parallel_size=1: the draft runs whole before the target's "
                             "forward, so its layers would have to live on one stage (not built)")
        # it computes every position too
        self.max_model_len = min(self.max_model_len, draft.max_position_embeddings)

    @property
    def num_batches_in_flight(self) -> int:
        """The batch queue's size with async_scheduling: two (plan one step while the other runs),
        or one per pipeline stage (each stage busy with its own batch); 1 without it: one step at a
        time."""
        if not self.scheduler_config.async_scheduling:
            return 1
        return max(2, self.parallel_config.pipeline_parallel_size)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """What the KV cache stores: the model's dtype, or float8 e4m3 with kv_cache_dtype="fp8"."""
        return FP8_KV_DTYPE if self.kv_cache_dtype == "fp8" else self.torch_dtype


# The chapters' records Config holds that `LLM(...)` takes by their fields' flat names (vLLM's
# EngineArgs -> VllmConfig), and the option that switches each on (None: always held, its defaults
# the core's own).
CHAPTER_RECORDS = {
    "parallel_config": (ParallelConfig, None),
    "scheduler_config": (SchedulerConfig, None),
    "lora_config": (LoRAConfig, "enable_lora"),
    "kv_offload_config": (KVOffloadConfig, "kv_offloading_size"),
    "sliding_window_config": (SlidingWindowConfig, None),
    "observability_config": (ObservabilityConfig, None),
    "logprobs_config": (LogprobsConfig, "max_logprobs"),
    "structured_outputs_config": (StructuredOutputsConfig, "enable_structured_outputs"),
    "beam_search_config": (BeamSearchConfig, "enable_beam_search"),
}


def core_option_fields() -> list[Field]:
    """Config's own options: its fields but the model, the chapters' records and what it derives."""
    return [f for f in fields(Config)
            if f.init and f.name != "model" and f.name not in CHAPTER_RECORDS]


def option_defaults() -> dict[str, object]:
    """Every option `LLM(model, **options)` takes, by its flat name, with its default: the core's
    fields, each chapter record's, and the switches (chapter_configs.SWITCHES)."""
    records = [f for cls, _ in CHAPTER_RECORDS.values() for f in fields(cls)]
    defaults = {f.name: f.default for f in core_option_fields() + records}
    return defaults | dict.fromkeys(SWITCHES, False)


def make_config(model: str | None, options: dict) -> Config:
    """`LLM(model, **options)` and `AsyncLLM(model, **options)`: the flat options, checked, each
    chapter's gathered into its record."""
    names = option_defaults()
    if unknown := set(options) - set(names):
        raise ValueError(f"unknown option(s) {sorted(unknown)}; options are {sorted(names)}")
    core = {name: value for name, value in options.items() if name not in SWITCHES}
    records = {}
    for name, (cls, switch) in CHAPTER_RECORDS.items():
        mine = {f.name: core.pop(f.name) for f in fields(cls) if f.name in core}
        records[name] = cls(**mine) if switch is None or options.get(switch) else None
    return Config(resolve_model(model), **core, **records)
