"""A step on the model. The InputBuilder turns its plan (SchedulerOutput) into the tensors the model
and the sampler take (ModelInput), on the host with plain loops over the batch's tokens, as
nano-vllm's prepare_prefill/prepare_decode do (where host time matters, the persistent input batch,
persistent_batch.py, builds the same arrays from rows kept between steps; tests/test_input_batch.py
needs no model). The ModelRunner runs the forward and samples; the Executor runs the step on it."""
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from nanoserve.config import Config
from nanoserve.engine.cuda_graph import CUDAGraphs, profile_num_blocks
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.engine.sequence import Sequence
from nanoserve.layers.attention import Attention, AttentionMetadata
from nanoserve.layers.sampler import Sampler
from nanoserve.layers.sampling_metadata import LogitsProcessor, PenaltyMetadata, SamplingMetadata
from nanoserve.layers.selector import attention_backend, use_elementwise_backend
from nanoserve.models import load_model
from nanoserve.utils.memory import keep_freed_memory

# The sampling parameters a row may set, each with its "unused" value: a column no row uses is None.
PARAMS = {"temperature": 0.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0, "presence_penalty": 0.0,
          "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0}
PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")
# A sampling row: (seq, j), seq's next token after its first j lookahead tokens (a verification has
# 1 + k rows).
SamplingRow = tuple[Sequence, int]


@dataclass
class StepArrays:
    """One step's batch on the host, in the plan's order (lists here, numpy arrays from the
    persistent batch)."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)  # each token's cache slot
    block_tables: list[list[int]] = field(default_factory=list)
    q_lens: list[int] = field(default_factory=list)  # the tokens each sequence computes
    context_lens: list[int] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)  # the row each sampling row samples from
    # per name of PARAMS, a value per sampling row (None: read them here)
    params: dict[str, list] | None = None


@dataclass
class ModelInput:
    """One step's batch as tensors. Rows of logits_rows: first one per sequence that samples (a
    request's n > 1 forks repeat its row), in `sample_seq_ids` order; then those a chapter adds.
    (A chapter's builder makes its subclass, with its own fields: InputBuilder.input_class.)"""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # the rows of the flat batch whose logits are computed
    sampling: SamplingMetadata  # for the first len(sample_seq_ids) rows of logits
    sample_seq_ids: list[int]  # who samples, row by row (the next step finds its placeholders here)


def to_device(data: list | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.as_tensor(data, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()  # pinned host memory lets the copy overlap with GPU work
    return host.to(device, non_blocking=True)


@dataclass
class InputBuilder:
    """Builds each step's ModelInput for one engine (rank 0: the workers get the tensors)."""

    block_size: int
    vocab_size: int
    eos_token_ids: list[int]
    device: torch.device
    # vLLM's interface for what rules tokens out (a grammar's mask): each prepares its step's state
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    input_class = ModelInput  # the batch's record (a chapter may add its own fields)

    @classmethod
    def from_config(cls, config: Config) -> "InputBuilder":
        return cls(config.block_size, config.hf_config.vocab_size, config.eos_token_ids,
                   torch.device(config.device))

    def prepare_inputs(self, out: SchedulerOutput) -> ModelInput | None:
        """The tokens each sequence computes this step as one batch, with their cache slots, and the
        rows whose logits are needed: the last one of each sequence that samples."""
        if not out.rows:  # everyone was preempted this step
            return None
        step = self.flatten(out)
        meta = self.attention_metadata(step.block_tables, step.slot_mapping, step.q_lens,
                                       step.context_lens)
        # Who samples: a row per sequence whose step reaches its end, 1 + k with k lookahead tokens,
        # one per fork.
        rows = [(s, j) for row in out.rows if out.draws(row)
                for s, j in [(row.seq, j) for j in range(len(row.seq.spec_token_ids) + 1)]
                + [(f, 0) for f in row.forks]]
        return self.input_class(
            input_ids=self._tensor(step.input_ids, torch.int64),
            positions=self._tensor(step.positions, torch.int64), meta=meta,
            logits_rows=self._tensor(step.logits_rows, torch.int64),
            sampling=self.prepare_sampling(rows, step.params),
            sample_seq_ids=[seq.seq_id for seq, _ in rows])

    def flatten(self, out: SchedulerOutput) -> StepArrays:
        """The step's host arrays: each scheduled token's id, position and cache slot, sequence by
        sequence."""
        step, bs = StepArrays(), self.block_size
        for row in out.rows:
            seq, start, end = row.seq, row.start, row.start + row.num_tokens
            # (Lookahead tokens follow the newest, speculative decoding; slices, not copies of whole
            # sequences.)
            step.input_ids += (seq.token_ids[start:] + seq.spec_token_ids)[: row.num_tokens]
            step.positions += range(start, end)
            step.slot_mapping += [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]
            step.block_tables.append(seq.block_table)
            step.q_lens.append(row.num_tokens)
            step.context_lens.append(end)
            if out.draws(row):  # the newest token's row, each lookahead's
                newest = len(step.input_ids) - 1 - len(seq.spec_token_ids)
                step.logits_rows += [newest + j for j in range(len(seq.spec_token_ids) + 1)]
                step.logits_rows += [newest] * len(row.forks)  # one per fork
        return step

    def attention_metadata(self, block_tables: np.ndarray | list[list[int]],
                           slot_mapping: np.ndarray | list[int], q_lens: np.ndarray | list[int],
                           context_lens: np.ndarray | list[int]) -> AttentionMetadata:
        """Where a batch's new tokens go in the paged cache, and what each sequence attends to."""
        q_lens, context_lens = np.asarray(q_lens), np.asarray(context_lens)
        tables = (self._tensor(block_tables, torch.int32) if isinstance(block_tables, np.ndarray)
                  else self._padded(block_tables, -1, torch.int32))
        return AttentionMetadata(
            slot_mapping=self._tensor(slot_mapping, torch.int64), block_tables=tables,
            context_lens=self._tensor(context_lens, torch.int32),
            cu_seqlens_q=self._tensor(np.append(0, np.cumsum(q_lens)), torch.int32),
            cu_seqlens_k=self._tensor(np.append(0, np.cumsum(context_lens)), torch.int32),
            max_seqlen_q=int(q_lens.max()), max_seqlen_k=int(context_lens.max()))

    def prepare_sampling(self, rows: list[SamplingRow],
                         params: dict[str, list] | None = None) -> SamplingMetadata:
        """The sampler's inputs, an option no row uses None. Row (seq, j) counts seq's first j
        lookahead tokens as output already (penalties, min_tokens)."""
        # read row by row only what some row sets: most steps share one SamplingParams
        if params is None:
            distinct = {id(seq.sampling_params): seq.sampling_params for seq, _ in rows}.values()
            used = {name for name, unused in PARAMS.items()
                    if any(getattr(p, name) != unused for p in distinct)}
            params = {name: [getattr(seq.sampling_params, name) for seq, _ in rows] if name in used
                      else [unused] * len(rows) for name, unused in PARAMS.items()}
        else:  # the persistent batch's columns
            used = {name for name, unused in PARAMS.items()
                    if (np.asarray(params[name]) != unused).any()}

        def column(name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
            return self._tensor(params[name], dtype) if name in used else None

        top_ks = column("top_k", torch.int64)  # -1: all (masked to the vocabulary's size below)
        penalties = None
        if used.intersection(PENALTIES):
            prompts = [seq.prompt_token_ids for seq, _ in rows]
            outputs = [seq.completion_token_ids + seq.spec_token_ids[:j]
                       + [-1] * seq.num_outputs_in_flight for seq, j in rows]
            penalties = PenaltyMetadata(
                prompt_token_ids=self._padded(prompts, self.vocab_size),
                output_token_ids=self._padded(outputs, self.vocab_size),
                presence_penalties=self._tensor(params["presence_penalty"], torch.float32),
                frequency_penalties=self._tensor(params["frequency_penalty"], torch.float32),
                repetition_penalties=self._tensor(params["repetition_penalty"], torch.float32))
        processors = [(p, state) for p in self.logits_processors
                      if (state := p.prepare(rows)) is not None]
        return SamplingMetadata(
            temperatures=column("temperature"), top_ps=column("top_p"), min_ps=column("min_p"),
            top_ks=None if top_ks is None else top_ks.masked_fill(top_ks == -1, self.vocab_size),
            generators=[seq.generator for seq, _ in rows], penalties=penalties,
            min_tokens_mask=self.min_tokens_mask(rows) if "min_tokens" in used else None,
            logits_processors=processors)

    def min_tokens_mask(self, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, token ids) the sampler rules out: EOS and the stop tokens, for a request that has
        fewer than min_tokens output tokens before this one (vLLM's MinTokensLogitsProcessor)."""
        masked, token_ids = [], []
        for row, (seq, j) in enumerate(rows):
            p = seq.sampling_params
            if seq.num_completion_tokens + j + seq.num_outputs_in_flight < p.min_tokens:
                stop_ids = p.stop_token_ids + ([] if p.ignore_eos else self.eos_token_ids)
                masked += [row] * len(stop_ids)
                token_ids += stop_ids
        return ((self._tensor(masked, torch.int64), self._tensor(token_ids, torch.int64))
                if masked else None)

    def _tensor(self, data: list | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return to_device(data, dtype, self.device)

    def _padded(self, rows: list[list[int]], pad: int,
                dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """Rows of unequal length as one tensor, padded with `pad` (numpy: far faster than
        torch.tensor)."""
        table = np.full((len(rows), max(map(len, rows))), pad, dtype=np.int64)
        for i, row in enumerate(rows):
            table[i, : len(row)] = row
        return self._tensor(table, dtype)


class ModelRunner:
    """One rank's model and KV cache: runs a batch's forward, and on rank 0 samples from its logits.
    Every rank of a tensor-parallel engine has one (nanoserve/parallel/executor.py starts them and
    sends each step to all)."""

    def __init__(self, config: Config, rank: int = 0, model_class: type | None = None):
        """model_class: a pipeline stage's part of the model instead of the whole."""
        self.config, self.rank, self.block_size = config, rank, config.block_size
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # reuse activation memory across steps, not page-faulting it in
        torch.manual_seed(config.seed)
        models = self.load_models(model_class)
        for model in models:  # RMSNorm, SwiGLU and RoPE as config.elementwise_backend says
            use_elementwise_backend(model, config.elementwise_backend)
        self.sampler = Sampler()
        self.attn_layers = [m for model in models for m in model.modules()
                            if isinstance(m, Attention)]
        self.cuda_graphs: CUDAGraphs | None = None
        self.kv_pools: dict[str, torch.Tensor] = {}  # a chapter's host KV pools (host_kv_pool.py)
        # Sized from memory: a RAM budget on CPU; on CUDA what a full-budget forward leaves.
        num_blocks = config.num_kvcache_blocks or (
            profile_num_blocks(self, InputBuilder.from_config(config))  # engine/cuda_graph.py
            if self.device.type == "cuda"
            else int(config.cpu_kvcache_space * 2**30) // self.block_bytes())
        self.num_kvcache_blocks = self.fewest_on_any_rank(num_blocks)
        if self.num_kvcache_blocks < 1:
            raise ValueError(
                "the KV cache is too small for even one block: raise gpu_memory_utilization "
                "(CUDA) or cpu_kvcache_space (CPU), or lower max_num_batched_tokens")
        self._allocate_kv_cache(self.num_kvcache_blocks)
        # The fused kernels' decode never waits for the host, so it is capturable.
        if (self.device.type == "cuda" and config.attention_backend != "torch"
                and not config.enforce_eager):  # (the PyTorch path stays eager)
            self.cuda_graphs = CUDAGraphs(self.model, config, self.scratch_slot)

    def load_models(self, model_class: type | None) -> list[nn.Module]:
        """Load the model (model_class: a pipeline stage's part of it); returns every model whose
        attention layers get this rank's KV cache: here the one."""
        config = self.config
        self.model = load_model(config.hf_config, config.model, config.torch_dtype, self.device,
                                model_class)
        return [self.model]

    # ---- KV cache -------------------------------------------------------------------------
    def block_bytes(self) -> int:
        a = self.attn_layers[0]  # (kv_cache_dtype="fp8": 1 byte an element, twice the blocks)
        return (2 * len(self.attn_layers) * self.block_size * a.num_kv_heads * a.head_dim
                * self.config.kv_cache_torch_dtype.itemsize)

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        """One [2, layers, blocks, block_size, kv_heads, head_dim] tensor; each layer gets views of
        it. It has one block more than the scheduler hands out: padding rows of a CUDA graph write
        there."""
        a = self.attn_layers[0]
        self.kv_cache = torch.zeros(2, len(self.attn_layers), num_blocks + 1, self.block_size,
                                    a.num_kv_heads, a.head_dim,
                                    dtype=self.config.kv_cache_torch_dtype, device=self.device)
        self.scratch_slot = num_blocks * self.block_size
        store, impl = attention_backend(self.config.attention_backend)
        for i, layer in enumerate(self.attn_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
            layer.store, layer.impl = store, impl

    def fewest_on_any_rank(self, num_blocks: int) -> int:
        """Every rank must hold the blocks rank 0's scheduler hands out: the fewest on any rank."""
        if dist.is_initialized():
            count = torch.tensor(num_blocks, device=self.device)
            dist.all_reduce(count, dist.ReduceOp.MIN)
            num_blocks = int(count)
        return num_blocks

    def copy_blocks(self, mapping: list[tuple[int, int]], src: torch.Tensor | None = None,
                    dst: torch.Tensor | None = None) -> None:
        """Copy KV blocks (source, destination) within the KV cache (copy-on-write), or from or to a
        chapter's host pool (src, dst: nanoserve/host_kv_pool.py), which is block first: pool[i] is
        a block's KV."""
        src, dst = (self.kv_cache.movedim(2, 0) if pool is None else pool for pool in (src, dst))
        for src_id, dst_id in mapping:  # (non_blocking to or from a pinned pool: the host goes on)
            dst[dst_id].copy_(src[src_id], non_blocking=True)

    # ---- one step: forward (every rank), sampling (rank 0) --------------------------------
    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  logits_rows: torch.Tensor) -> torch.Tensor | None:
        """Logits of the rows sampled from (None on a TP worker)."""
        if self.cuda_graphs is not None and self.cuda_graphs.fits(meta):
            hidden = self.cuda_graphs.replay(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta)
        return self.model.compute_logits(hidden, logits_rows)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, inputs: ModelInput) -> torch.Tensor:
        """The sampler's draw for each sampling row: a token id each, as a device tensor."""
        num_rows = len(inputs.sample_seq_ids)
        newest = (inputs.input_ids[inputs.logits_rows[:num_rows]] if inputs.sampling.penalties
                  else None)
        return self.sampler(logits[:num_rows], inputs.sampling, newest)

    def apply(self, fn: Callable, *args) -> object:
        """A feature's work on this rank's model (`executor.call("apply", fn, ...)` on every rank:
        swap's and the host tier's block copies)."""
        return fn(self, *args)


class Executor:
    """Runs each step on the model: here this process's ModelRunner alone (vLLM's UniProcExecutor).
    The parallel chapter's (parallel/executor.py) runs it on every rank: it overrides `call` (to
    every worker too) and `finish`."""

    def __init__(self, config: Config, model_runner_class: type[ModelRunner] = ModelRunner):
        self.config = config
        self.model_runner = model_runner_class(config)

    def execute_model(self, out: SchedulerOutput, inputs: ModelInput | None) -> torch.Tensor:
        """One step: the KV block copies, the forward, sampling. A token id per sampling row, on the
        device."""
        return self.finish(out, *self.launch(out, inputs))

    def launch(self, out: SchedulerOutput,
               inputs: ModelInput | None) -> tuple[ModelInput | None, torch.Tensor | None]:
        """The step up to the logits: the KV blocks moved and copied, then the forward."""
        # KV moved between blocks before the forward: every read of the device pool first, since a
        # block the step frees may be another copy's destination.
        self.copy_kv_out(out)
        self.copy_kv_in(out)
        return self.forward(out, inputs)

    def forward(self, out: SchedulerOutput,
                inputs: ModelInput | None) -> tuple[ModelInput | None, torch.Tensor | None]:
        """The model's forward over the step's inputs, once its KV is where it reads it: the inputs
        that ran and their logits."""
        if inputs is None:  # everyone was preempted
            return None, None
        return inputs, self.call("run_model", inputs.input_ids, inputs.positions, inputs.meta,
                                 inputs.logits_rows)

    def copy_kv_out(self, out: SchedulerOutput) -> None:
        """Copies that read the device pool into another (a chapter's host pool): none in the
        core."""

    def copy_kv_in(self, out: SchedulerOutput) -> None:
        """Copies that write the device pool: here copy-on-write, a shared block's copy."""
        if out.blocks_to_copy:
            self.call("copy_blocks", out.blocks_to_copy)

    def finish(self, out: SchedulerOutput, inputs: ModelInput | None,
               logits: torch.Tensor | None) -> torch.Tensor:
        """The sampled ids."""
        if inputs is None:
            return torch.empty(0, dtype=torch.int64)
        return self.model_runner.sample(logits, inputs)

    def call(self, method: str, *args):
        return getattr(self.model_runner, method)(*args)

    def shutdown(self) -> None:
        pass
