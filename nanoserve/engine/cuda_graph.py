"""CUDA at start-up: the KV pool sized from what a warm-up forward leaves of the GPU's memory, and
CUDA graphs for decode batches: each decode forward recorded once per batch size, replayed every
step, so a step costs one launch instead of one per kernel (the fused attention backends only: the
PyTorch path plans each batch on the host and stays eager)."""
import torch
from torch import nn

from nanoserve.config import Config
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.engine.sequence import Sequence
from nanoserve.layers.attention import AttentionMetadata
from nanoserve.sampling_params import SamplingParams
from nanoserve.utils.math import cdiv


def profile_num_blocks(runner, input_builder) -> int:
    """The KV blocks a ModelRunner's GPU holds: warm up with the largest prefill the scheduler may
    send, on a temporary cache sized for it (counting that cache as activation memory errs on the
    safe side); the blocks are what gpu_memory_utilization leaves after the weights and that
    forward's peak."""
    cfg = runner.config
    num_seqs = max(1, min(cfg.max_num_seqs, cfg.max_num_batched_tokens // cfg.max_model_len))
    blocks_per_seq = cdiv(cfg.max_model_len, runner.block_size)
    torch.cuda.reset_peak_memory_stats()  # the peak must be this warm-up's, not an earlier engine's
    runner._allocate_kv_cache(num_seqs * blocks_per_seq)
    greedy = SamplingParams(temperature=0.0)
    seqs = [Sequence(-1, [0] * cfg.max_model_len, greedy, runner.block_size)
            for _ in range(num_seqs)]
    # With chunked prefill a step computes at most the token budget: the last tokens of a full
    # sequence.
    num_tokens = min(cfg.max_model_len, cfg.max_num_batched_tokens)
    out = SchedulerOutput()
    for i, seq in enumerate(seqs):
        seq.block_table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        seq.num_computed_tokens = cfg.max_model_len - num_tokens
        out.add(seq, num_tokens)
    inputs = input_builder.prepare_inputs(out)
    runner.run_model(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_rows)
    torch.cuda.synchronize()
    del runner.kv_cache
    for layer in runner.attn_layers:
        layer.k_cache = layer.v_cache = torch.tensor([])
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    stats = torch.cuda.memory_stats()
    activations = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
    available = total * cfg.gpu_memory_utilization - (total - free) - activations
    return int(available) // runner.block_bytes() - 1  # minus the scratch block


class CUDAGraphs:
    """A graph replays fixed buffers, so a batch is copied into the smallest graph that fits it, and
    the padding rows write their K/V into the scratch slot (the KV cache's extra block)."""

    @torch.inference_mode()
    def __init__(self, model: nn.Module, config: Config, scratch_slot: int):
        self.model, self.scratch_slot = model, scratch_slot
        dev = torch.device(config.device)
        max_bs = min(config.max_num_seqs, 512)
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.outputs = torch.zeros(max_bs, config.hf_config.hidden_size, dtype=config.torch_dtype,
                                   device=dev)
        self.meta = AttentionMetadata(
            slot_mapping=torch.full((max_bs,), scratch_slot, dtype=torch.int64, device=dev),
            block_tables=torch.zeros(max_bs, cdiv(config.max_model_len, config.block_size),
                                     dtype=torch.int32, device=dev),
            context_lens=torch.zeros(max_bs, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
            # unused by decode kernels
            cu_seqlens_k=torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            max_seqlen_q=1, max_seqlen_k=config.max_model_len,
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        for bs in reversed([1, 2, 4, 8] + list(range(16, max_bs + 1, 16))):
            m = self.meta
            meta = AttentionMetadata(m.slot_mapping[:bs], m.block_tables[:bs], m.context_lens[:bs],
                                     m.cu_seqlens_q[: bs + 1], m.cu_seqlens_k[: bs + 1], 1,
                                     m.max_seqlen_k)
            self.outputs[:bs] = model(self.input_ids[:bs], self.positions[:bs], meta)  # warm up
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.outputs[:bs] = model(self.input_ids[:bs], self.positions[:bs], meta)
            pool = pool or graph.pool()  # all graphs share one memory pool: only one runs at a time
            self.graphs[bs] = graph
            torch.cuda.synchronize()

    def fits(self, meta: AttentionMetadata) -> bool:
        """A decode batch (one new token per sequence) no larger than the largest graph."""
        return meta.max_seqlen_q == 1 and meta.context_lens.shape[0] <= max(self.graphs)

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        graph_bs = min(bs for bs in self.graphs if bs >= n)
        m = self.meta
        self.input_ids[:n], self.positions[:n] = input_ids, positions
        m.slot_mapping.fill_(self.scratch_slot)
        m.slot_mapping[:n] = meta.slot_mapping
        m.context_lens.zero_()
        m.context_lens[:n] = meta.context_lens
        m.block_tables[:n, : meta.block_tables.shape[1]] = meta.block_tables
        self.graphs[graph_bs].replay()
        return self.outputs[:n]
