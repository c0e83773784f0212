"""CUDA graphs for decode batches: each decode forward recorded once per batch size at start-up, replayed
every step, so a step costs one launch instead of one per kernel (the fused attention backends only: the
PyTorch path plans each batch on the host and stays eager)."""
import torch
from torch import nn

from nanoserve.config import Config
from nanoserve.layers.attention import AttentionMetadata
from nanoserve.utils.math import cdiv


class CUDAGraphs:
    """A graph replays fixed buffers, so a batch is copied into the smallest graph that fits it, and the
    padding rows write their K/V into the scratch slot (the KV cache's extra block)."""

    @torch.inference_mode()
    def __init__(self, model: nn.Module, config: Config, scratch_slot: int):
        self.model, self.scratch_slot = model, scratch_slot
        dev = torch.device(config.device)
        max_bs = min(config.max_num_seqs, 512)
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.outputs = torch.zeros(max_bs, config.hf_config.hidden_size, dtype=config.torch_dtype, device=dev)
        self.meta = AttentionMetadata(
            slot_mapping=torch.full((max_bs,), scratch_slot, dtype=torch.int64, device=dev),
            block_tables=torch.zeros(max_bs, cdiv(config.max_model_len, config.block_size), dtype=torch.int32,
                                     device=dev),
            context_lens=torch.zeros(max_bs, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
            cu_seqlens_k=torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),  # unused by decode kernels
            max_seqlen_q=1, max_seqlen_k=config.max_model_len,
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        for bs in reversed([1, 2, 4, 8] + list(range(16, max_bs + 1, 16))):
            m = self.meta
            meta = AttentionMetadata(m.slot_mapping[:bs], m.block_tables[:bs], m.context_lens[:bs],
                                     m.cu_seqlens_q[: bs + 1], m.cu_seqlens_k[: bs + 1], 1, m.max_seqlen_k)
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

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
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
