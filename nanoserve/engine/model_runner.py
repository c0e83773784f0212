from collections.abc import Callable

import torch
import torch.distributed as dist

from nanoserve.config import Config
from nanoserve.engine.cuda_graph import CUDAGraphs, profile_num_blocks
from nanoserve.engine.input_batch import ModelInput
from nanoserve.engine.scheduler_output import SchedulerOutput
from nanoserve.engine.seams import Seams
from nanoserve.layers.attention import Attention, AttentionMetadata
from nanoserve.layers.sampler import Sampler
from nanoserve.layers.selector import attention_backend, use_elementwise_backend
from nanoserve.models import load_model
from nanoserve.utils.memory import keep_freed_memory


class ModelRunner:
    """One rank's model and KV cache: runs a batch's forward, and on rank 0 samples from its logits.
    Every rank of a tensor-parallel engine has one (nanoserve/parallel/executor.py starts them and
    sends each step to all)."""

    def __init__(self, config: Config, rank: int = 0, seams: Seams | None = None,
                 model_class: type | None = None):
        """model_class: a pipeline stage's part of the model instead of the whole."""
        self.config, self.rank, self.block_size = config, rank, config.block_size
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # reuse activation memory across steps, not page-faulting it in
        torch.manual_seed(config.seed)
        self.model = load_model(config.hf_config, config.model, config.torch_dtype, self.device,
                                model_class)
        # Speculative decoding's draft model (spec_decode/draft_model_proposer.py): its layers are
        # more layers of the same KV cache, so its KV shares the target's blocks and block tables.
        self.draft_model = None if config.draft_hf_config is None else load_model(
            config.draft_hf_config, config.speculative_config.model, config.torch_dtype,
            self.device)
        models = [m for m in (self.model, self.draft_model) if m is not None]
        for model in models:  # RMSNorm, SwiGLU and RoPE as config.elementwise_backend says
            use_elementwise_backend(model, config.elementwise_backend)
        self.sampler, self.seams = Sampler(), Seams() if seams is None else seams
        self.attn_layers = [m for model in models for m in model.modules()
                            if isinstance(m, Attention)]
        self.cuda_graphs: CUDAGraphs | None = None
        self.kv_pools: dict[str, torch.Tensor] = {}  # a chapter's host KV pools (host_kv_pool.py)
        # Sized from memory: a RAM budget on CPU; on CUDA what a full-budget forward leaves.
        num_blocks = config.num_kvcache_blocks or (
            profile_num_blocks(self) if self.device.type == "cuda"  # engine/cuda_graph.py
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
                  logits_rows: torch.Tensor, draft: bool = False) -> torch.Tensor | None:
        """Logits of the rows sampled from (None on a TP worker); draft=True: the draft model's."""
        model = self.draft_model if draft else self.model
        if not draft and self.cuda_graphs is not None and self.cuda_graphs.fits(meta):
            hidden = self.cuda_graphs.replay(input_ids, positions, meta)
        else:
            hidden = model(input_ids, positions, meta)
        return model.compute_logits(hidden, logits_rows)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, inputs: ModelInput) -> torch.Tensor:
        """A token id per sampling row, as a device tensor."""
        verify = self.seams.sample  # the seam: speculative decoding's verification, not a draw
        sampled = self.draw(logits, inputs) if verify is None else verify(self, logits, inputs)
        for after_sample in self.seams.after_sample:  # the seam: logprobs asked for (logprobs.py)
            after_sample(self, logits, sampled, inputs)
        return sampled

    def draw(self, logits: torch.Tensor, inputs: ModelInput) -> torch.Tensor:
        num_rows = len(inputs.sample_seq_ids)
        newest = (inputs.input_ids[inputs.logits_rows[:num_rows]] if inputs.sampling.penalties
                  else None)
        return self.sampler(logits[:num_rows], inputs.sampling, newest)

    def apply(self, fn: Callable, *args) -> object:
        """A feature's work on this rank's model (`executor.call("apply", fn, ...)` on every rank:
        LoRA's)."""
        return fn(self, *args)


class Executor:
    """Runs each step on the model: here this process's ModelRunner alone (vLLM's UniProcExecutor).
    The parallel chapter's (parallel/executor.py) runs it on every rank: it overrides `call` (to
    every worker too) and `finish`."""

    def __init__(self, config: Config, seams: Seams,
                 model_runner_class: type[ModelRunner] = ModelRunner):
        self.config, self.seams = config, seams
        self.model_runner = model_runner_class(config, seams=seams)

    def execute_model(self, out: SchedulerOutput, inputs: ModelInput | None) -> torch.Tensor:
        """One step: the KV block copies, the forward, sampling. A token id per sampling row, on the
        device."""
        return self.finish(out, *self.launch(out, inputs))

    def launch(self, out: SchedulerOutput,
               inputs: ModelInput | None) -> tuple[ModelInput | None, torch.Tensor | None]:
        """The step up to the logits: the inputs that ran (with a draft model's drafts) and their
        logits."""
        # KV moved between blocks before the forward: every read of the device pool first, since a
        # block the step frees may be another copy's destination.
        self.copy_kv_out(out)
        self.copy_kv_in(out)
        # the seam before the forward: a draft model fills the lookahead slots (draft=True)
        if self.seams.propose is not None:
            inputs = self.seams.propose(out, inputs, lambda *a: self.call("run_model", *a, True))
        if inputs is None:  # everyone was preempted
            return None, None
        # the seam: e.g. async scheduling's placeholders, LoRA's rows
        for prepare in self.seams.before_forward:
            prepare(out, inputs)
        return inputs, self.call("run_model", inputs.input_ids, inputs.positions, inputs.meta,
                                 inputs.logits_rows)

    def copy_kv_out(self, out: SchedulerOutput) -> None:
        """Copies that read the device pool into another (a chapter's host pool): none in the
        core."""
        for move in self.seams.move_kv:
            move(out, self, "out")

    def copy_kv_in(self, out: SchedulerOutput) -> None:
        """Copies that write the device pool: here copy-on-write, a shared block's copy."""
        for move in self.seams.move_kv:
            move(out, self, "in")
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
