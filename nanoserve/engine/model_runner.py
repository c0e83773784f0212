from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch
import torch.distributed as dist

from nanoserve.config import Config
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.engine.sequence import Sequence
from nanoserve.engine.workers import Workers
from nanoserve.layers.attention import (
    Attention,
    AttentionMetadata,
    attention_backend,
)
from nanoserve.layers.linear import reorder_weights_for_cpu
from nanoserve.layers.sampler import Sampler, compute_logprobs
from nanoserve.models import build_model
from nanoserve.outputs import Logprob
from nanoserve.sampling_params import SamplingParams
from nanoserve.utils.loader import load_weights
from nanoserve.utils.memory import keep_freed_memory


@dataclass
class ModelInput:
    """One step's batch as tensors, built on the host (with async scheduling, while the step before runs)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # the rows a next token is sampled from
    sampling: dict  # prepare_sample's arguments for the sampler
    min_tokens_mask: tuple[list[int], list[int]]  # (rows, token ids) whose logits are set to -inf
    sample_seq_ids: list[int]  # who samples, row by row (the next step finds its placeholders here)
    placeholder_rows: list[int]  # rows of input_ids whose token the previous step is still sampling...
    placeholder_seq_ids: list[int]  # ...for these sequences
    logprobs: list[tuple[Sequence, int | None, int]]  # logits rows to score (see record_logprobs)


class ModelRunner:
    """Owns the model and the KV cache; turns a scheduled batch into tensors, runs it, samples."""

    def __init__(self, config: Config, rank: int = 0):
        self.config, self.rank = config, rank
        self.workers: Workers | None = None  # set once every rank is ready; from then on each step goes to them
        # Tensor parallelism: rank 0 starts ranks 1..N-1 (engine/workers.py), each of which builds this runner.
        workers = Workers(config) if rank == 0 and config.tensor_parallel_size > 1 else None
        try:
            self._build(config)
        except BaseException:
            if workers:
                workers.shutdown()  # don't leave them waiting for a rank 0 that will never come
            raise
        self.workers = workers

    def _build(self, config: Config) -> None:
        """The model with this rank's weights, the KV cache (sized from memory), the CUDA graphs."""
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        if self.device.type == "cpu":
            keep_freed_memory()  # reuse activation memory across steps instead of page-faulting it in
        torch.manual_seed(config.seed)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.torch_dtype)
        try:
            with torch.device(self.device):
                self.model = build_model(config.hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        load_weights(self.model, config.model)
        if self.device.type == "cpu":
            reorder_weights_for_cpu(self.model)
        self.model.eval()
        self.sampler = Sampler()
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # The last step's sampled ids, still a device tensor, and who sampled them: the next step's placeholders.
        self.prev_sampled: tuple[dict[int, int], torch.Tensor] | None = None
        self.num_host_blocks, self.host_kv_cache = 0, torch.tensor([])  # the swap pool, if any: below
        self.num_kvcache_blocks = config.num_kvcache_blocks or self._profile_num_blocks()
        if config.tensor_parallel_size > 1:  # every rank must hold the blocks rank 0's scheduler hands out
            num_blocks = torch.tensor(self.num_kvcache_blocks, device=self.device)
            dist.all_reduce(num_blocks, dist.ReduceOp.MIN)
            self.num_kvcache_blocks = int(num_blocks)
        if self.num_kvcache_blocks < 1:
            raise ValueError("the KV cache is too small for even one block: raise gpu_memory_utilization "
                             "(CUDA) or cpu_kvcache_space (CPU), or lower max_num_batched_tokens")
        self._allocate_kv_cache(self.num_kvcache_blocks)
        if config.preemption_mode == "swap":
            self._allocate_host_cache()
        # The fused kernels' decode never waits for the host, so it is capturable; the PyTorch path plans
        # each batch on the host and stays eager.
        if self.device.type == "cuda" and config.attention_backend != "torch" and not config.enforce_eager:
            self._capture_cudagraphs()

    # ---- KV cache -------------------------------------------------------------------------
    def _block_bytes(self) -> int:
        a = self.attn_layers[0]
        per_token = 2 * len(self.attn_layers) * a.num_kv_heads * a.head_dim * self.config.torch_dtype.itemsize
        return self.block_size * per_token

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        """One [2, layers, blocks, block_size, kv_heads, head_dim] tensor; each layer gets views of it.

        It has one block more than the scheduler hands out: padding rows of a CUDA graph write there.
        """
        a = self.attn_layers[0]
        self.kv_cache = torch.zeros(2, len(self.attn_layers), num_blocks + 1, self.block_size,
                                    a.num_kv_heads, a.head_dim, dtype=self.config.torch_dtype, device=self.device)
        self.scratch_slot = num_blocks * self.block_size
        store, impl = attention_backend(self.config.attention_backend)
        for i, layer in enumerate(self.attn_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
            layer.store, layer.impl = store, impl

    def _allocate_host_cache(self) -> None:
        """The swap pool: swap_space GiB of host memory shaped like kv_cache (page-locked on CUDA, as vLLM's)."""
        self.num_host_blocks = int(self.config.swap_space * 2**30) // self._block_bytes()
        if self.num_host_blocks < 1:
            raise ValueError(f"swap_space ({self.config.swap_space} GiB) is too small for one KV block "
                             f"({self._block_bytes()} bytes)")
        shape = (*self.kv_cache.shape[:2], self.num_host_blocks, *self.kv_cache.shape[3:])
        self.host_kv_cache = torch.zeros(shape, dtype=self.config.torch_dtype, pin_memory=self.device.type == "cuda")

    def swap_blocks(self, blocks_to_swap_out: list[tuple[int, int]], blocks_to_swap_in: list[tuple[int, int]],
                    blocks_to_copy: list[tuple[int, int]]) -> None:
        """Copy the blocks the scheduler moved (vLLM's cache engine): preempted requests' KV out to the
        host pool, returning requests' KV back in, then copy-on-write copies inside the device pool."""
        for mapping, src, dst in ((blocks_to_swap_out, self.kv_cache, self.host_kv_cache),
                                  (blocks_to_swap_in, self.host_kv_cache, self.kv_cache),
                                  (blocks_to_copy, self.kv_cache, self.kv_cache)):
            if mapping:
                src_ids, dst_ids = zip(*mapping)
                dst[:, :, list(dst_ids)] = src[:, :, list(src_ids)].to(dst.device)

    def _profile_num_blocks(self) -> int:
        """Size the pool from memory: a RAM budget on CPU; on CUDA what a full-budget forward leaves."""
        if self.device.type == "cpu":
            return int(self.config.cpu_kvcache_space * 2**30) // self._block_bytes()
        # Warm up with the largest prefill the scheduler may send, on a temporary cache sized for it;
        # counting that cache as activation memory errs on the safe side.
        cfg = self.config
        num_seqs = max(1, min(cfg.max_num_seqs, cfg.max_num_batched_tokens // cfg.max_model_len))
        blocks_per_seq = -(-cfg.max_model_len // self.block_size)
        torch.cuda.reset_peak_memory_stats()  # the peak must be this warm-up's, not an earlier engine's
        self._allocate_kv_cache(num_seqs * blocks_per_seq)
        greedy = SamplingParams(temperature=0.0)
        seqs = [Sequence(-1, [0] * cfg.max_model_len, greedy, self.block_size) for _ in range(num_seqs)]
        # With chunked prefill a step computes at most the token budget: the last tokens of a full sequence.
        num_tokens = min(cfg.max_model_len, cfg.max_num_batched_tokens)
        out = SchedulerOutput()
        for i, seq in enumerate(seqs):
            seq.block_table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            seq.num_computed_tokens = cfg.max_model_len - num_tokens
            out.add(seq, num_tokens)
        self.run(out)
        torch.cuda.synchronize()
        del self.kv_cache
        for layer in self.attn_layers:
            layer.k_cache = layer.v_cache = torch.tensor([])
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        stats = torch.cuda.memory_stats()
        activations = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
        available = total * cfg.gpu_memory_utilization - (total - free) - activations
        return int(available) // self._block_bytes() - 1  # minus the scratch block

    # ---- one step ---------------------------------------------------------------------------
    def prepare_inputs(self, out: SchedulerOutput) -> ModelInput | None:
        """Flatten the tokens each sequence computes this step into one batch, with their cache slots, and
        the rows whose logits are needed: the last one of each sequence that samples."""
        if not out.seqs:  # everyone was preempted this step
            return None
        input_ids, positions, slot_mapping, q_lens, context_lens, logits_rows = [], [], [], [], [], []
        placeholder_rows, placeholder_seq_ids = [], []
        bs = self.block_size
        seqs = out.seqs
        for seq, start, num_tokens, do_sample, forks in zip(seqs, out.num_computed_tokens, out.num_scheduled_tokens,
                                                            out.do_sample, out.forks):
            end = start + num_tokens
            input_ids.extend(seq.token_ids[start:end])
            if end > len(seq.token_ids):  # async scheduling: its last token is a placeholder (filled in later)
                placeholder_rows.append(len(input_ids))
                placeholder_seq_ids.append(seq.seq_id)
                input_ids.append(0)
            positions.extend(range(start, end))
            q_lens.append(end - start)
            context_lens.append(end)
            # Token p goes to slot block_table[p // bs] * bs + p % bs: one range per block it touches.
            for i in range(start // bs, (end - 1) // bs + 1):
                base = (seq.block_table[i] - i) * bs
                slot_mapping.extend(range(base + max(start, i * bs), base + min(end, (i + 1) * bs)))
            if do_sample:
                logits_rows += [len(input_ids) - 1] * (1 + len(forks))  # n > 1: the row for every fork too
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slot_mapping, torch.int64),
            block_tables=self._padded([seq.block_table for seq in seqs], -1, torch.int32),
            context_lens=self._tensor(context_lens, torch.int32),
            cu_seqlens_q=self._tensor(list(accumulate(q_lens, initial=0)), torch.int32),
            cu_seqlens_k=self._tensor(list(accumulate(context_lens, initial=0)), torch.int32),
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(context_lens),
        )
        sampling = [s for seq, do_sample, forks in zip(seqs, out.do_sample, out.forks) if do_sample
                    for s in [seq, *forks]]
        # Logprobs: of the sampled tokens, and of prompt tokens (extra logits rows after the sampled ones).
        logprobs = [(seq, None, row) for row, seq in enumerate(sampling) if seq.logprobs is not None]
        prompt_rows, prompt_places = self.prepare_prompt_logprobs(out)
        logprobs += [(seq, p, row) for row, (seq, p) in enumerate(prompt_places, len(sampling))]
        return ModelInput(self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), meta,
                          self._tensor(logits_rows + prompt_rows, torch.int64), self.prepare_sample(sampling),
                          self._min_tokens_mask(sampling),
                          [seq.seq_id for seq in sampling], placeholder_rows, placeholder_seq_ids, logprobs)

    def _tensor(self, data: list | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        host = torch.as_tensor(data, dtype=dtype)
        if self.device.type == "cuda":
            host = host.pin_memory()  # pinned host memory lets the copy overlap with GPU work
        return host.to(self.device, non_blocking=True)

    def prepare_sample(self, seqs: list[Sequence]) -> dict:
        """The sampler's arguments, one row per sequence; an option no row uses is None (see Sampler)."""
        vocab_size = self.config.hf_config.vocab_size
        params = [seq.sampling_params for seq in seqs]

        def column(values: list, unused, dtype: torch.dtype) -> torch.Tensor | None:
            return None if all(v == unused for v in values) else self._tensor(values, dtype)

        sample = dict(
            temperatures=column([p.temperature for p in params], 0.0, torch.float32),
            top_ks=column([vocab_size if p.top_k == -1 else p.top_k for p in params], vocab_size, torch.int64),
            top_ps=column([p.top_p for p in params], 1.0, torch.float32),
            min_ps=column([p.min_p for p in params], 0.0, torch.float32),
            generators=[seq.generator for seq in seqs],
        )
        if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1 for p in params):
            sample["penalties"] = dict(
                prompt_token_ids=self._padded([seq.prompt_token_ids for seq in seqs], vocab_size),
                output_token_ids=self._padded([seq.completion_token_ids + [-1] * (seq.num_output_placeholders - 1)
                                               for seq in seqs], vocab_size),
                presence_penalties=self._tensor([p.presence_penalty for p in params], torch.float32),
                frequency_penalties=self._tensor([p.frequency_penalty for p in params], torch.float32),
                repetition_penalties=self._tensor([p.repetition_penalty for p in params], torch.float32))
        return sample

    def _padded(self, rows: list[list[int]], pad: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """Rows of unequal length as one tensor, padded with `pad` (numpy fills rows far faster than
        torch.tensor converts a list of lists: it matters for 256 block tables a step)."""
        table = np.full((len(rows), max(map(len, rows))), pad, dtype=np.int64)
        for i, row in enumerate(rows):
            table[i, : len(row)] = row
        return self._tensor(table, dtype)

    def prepare_prompt_logprobs(self, out: SchedulerOutput) -> tuple[list[int], list[tuple[Sequence, int]]]:
        """For requests with prompt_logprobs: the batch rows whose logits score a prompt token (the row of
        position p scores token p + 1), and where each result goes: (sequence, p + 1)."""
        rows, places, offset = [], [], 0
        for seq, start, num_tokens in zip(out.seqs, out.num_computed_tokens, out.num_scheduled_tokens):
            if seq.prompt_logprobs is not None:
                end = min(start + num_tokens, seq.num_prompt_tokens - 1)
                rows += range(offset, offset + end - start)
                places += [(seq, p + 1) for p in range(start, end)]
            offset += num_tokens
        return rows, places

    def record_logprobs(self, logits: torch.Tensor, sampled: list[int], places: list[tuple]) -> None:
        """For each (seq, p, row): score a token under logits[row], with the top k. p None: the token sampled
        from that row, appended to seq.logprobs; else prompt token p, stored in seq.prompt_logprobs[p]."""
        token_ids = [sampled[row] if p is None else seq.token_ids[p] for seq, p, row in places]
        ks = [s.sampling_params.logprobs if p is None else s.sampling_params.prompt_logprobs for s, p, _ in places]
        scores = compute_logprobs(logits[[row for *_, row in places]], self._tensor(token_ids, torch.int64), max(ks))
        for (seq, p, _), k, token_id, lp, rank, top_ids, top_lps in zip(places, ks, token_ids,
                                                                       *(t.tolist() for t in scores)):
            d = {i: Logprob(x, r) for r, (i, x) in enumerate(zip(top_ids[:k], top_lps[:k]), 1)}
            d[token_id] = Logprob(lp, rank)
            if p is None:
                seq.logprobs.append(d)
            else:
                seq.prompt_logprobs[p] = d

    def _min_tokens_mask(self, seqs: list[Sequence]) -> tuple[list[int], list[int]]:
        """(row, token) pairs to mask: EOS and the stop tokens, for a request that has fewer than min_tokens
        output tokens before this one (vLLM's MinTokensLogitsProcessor)."""
        rows, token_ids = [], []
        for row, seq in enumerate(seqs):
            p = seq.sampling_params
            if seq.num_completion_tokens + seq.num_output_placeholders - 1 < p.min_tokens:
                stop_ids = p.stop_token_ids + ([] if p.ignore_eos else self.config.eos_token_ids)
                rows += [row] * len(stop_ids)
                token_ids += stop_ids
        return rows, token_ids

    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  logits_rows: torch.Tensor) -> torch.Tensor:
        """Logits of the rows a next token is sampled from (a sequence's last token, if it samples)."""
        num_seqs = meta.context_lens.shape[0]
        if meta.max_seqlen_q == 1 and self.graphs and num_seqs <= max(self.graphs):
            hidden = self._replay_cudagraph(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta)
        return self.model.compute_logits(hidden[logits_rows])

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput, inputs: ModelInput | None) -> torch.Tensor:
        """Copy swapped blocks, fill in the placeholders, run the batch and sample: a token id per sequence that
        samples, as a device tensor (no wait for it here). Steps run one at a time, in planning order."""
        if out.blocks_to_swap_out or out.blocks_to_swap_in or out.blocks_to_copy:  # (TP: no message otherwise)
            self.call("swap_blocks", out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy)
        prev, self.prev_sampled = self.prev_sampled, None
        if inputs is None:
            return torch.empty(0, dtype=torch.int64)
        prev_rows, prev_tokens = prev or ({}, None)
        # A placeholder the previous step has no token for: that step failed, and so did the request.
        rows = [(row, prev_rows[i]) for row, i in zip(inputs.placeholder_rows, inputs.placeholder_seq_ids)
                if i in prev_rows]
        if rows:
            dst, src = zip(*rows)
            inputs.input_ids[self._tensor(dst, torch.int64)] = prev_tokens[self._tensor(src, torch.int64)]
        logits = self.call("run_model", inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_rows)
        if logits is None:  # a tensor-parallel worker (in the CUDA warm-up): only rank 0 samples
            return torch.empty(0, dtype=torch.int64)
        sample_logits = logits[: len(inputs.sample_seq_ids)]
        mask_rows, mask_ids = inputs.min_tokens_mask
        if mask_rows:  # (on a copy: logprobs are of the raw logits)
            rows, ids = self._tensor(mask_rows, torch.int64), self._tensor(mask_ids, torch.int64)
            sample_logits = sample_logits.index_put((rows, ids), sample_logits.new_tensor(float("-inf")))
        penalties = inputs.sampling.get("penalties")
        if penalties is not None:  # the token the step before was sampling (-1 in the plan) is output too
            newest = inputs.input_ids[inputs.logits_rows[: len(sample_logits)]]
            penalties["output_token_ids"] = torch.where(penalties["output_token_ids"] == -1, newest[:, None],
                                                        penalties["output_token_ids"])
        sampled = self.sampler(sample_logits, **inputs.sampling)
        self.prev_sampled = ({seq_id: row for row, seq_id in enumerate(inputs.sample_seq_ids)}, sampled)
        if inputs.logprobs:
            self.record_logprobs(logits, sampled.tolist(), inputs.logprobs)
        return sampled

    def run(self, out: SchedulerOutput) -> list[int]:
        """One synchronous step: prepare, execute, and wait for the sampled ids on the host."""
        return self.execute_model(out, self.prepare_inputs(out)).tolist()

    def call(self, method: str, *args):
        """self.method(*args); under tensor parallelism every worker first gets the same call, on its own slice."""
        if self.workers is None:
            return getattr(self, method)(*args)
        return self.workers.call(self, method, args)

    def parameter_shapes(self) -> list[dict[str, tuple[int, ...]]] | None:
        """Every rank's parameter shapes, gathered on rank 0 (a debug call: `call("parameter_shapes")`)."""
        shapes = {name: tuple(p.shape) for name, p in self.model.named_parameters()}
        gathered = [{} for _ in range(self.config.tensor_parallel_size)] if self.rank == 0 else None
        dist.gather_object(shapes, gathered, dst=0)
        return gathered

    # ---- CUDA graphs ------------------------------------------------------------------------
    @torch.inference_mode()
    def _capture_cudagraphs(self) -> None:
        """Record the decode forward once per batch size; replaying it skips per-kernel launch costs.

        A graph replays fixed buffers, so a batch is copied into the smallest graph that fits it,
        and the padding rows write their K/V into the scratch slot.
        """
        cfg, dev = self.config, self.device
        max_bs = min(cfg.max_num_seqs, 512)
        max_num_blocks = -(-cfg.max_model_len // self.block_size)
        self.graph_vars = dict(
            input_ids=torch.zeros(max_bs, dtype=torch.int64, device=dev),
            positions=torch.zeros(max_bs, dtype=torch.int64, device=dev),
            outputs=torch.zeros(max_bs, cfg.hf_config.hidden_size, dtype=cfg.torch_dtype, device=dev),
        )
        self.graph_meta = AttentionMetadata(
            slot_mapping=torch.full((max_bs,), self.scratch_slot, dtype=torch.int64, device=dev),
            block_tables=torch.zeros(max_bs, max_num_blocks, dtype=torch.int32, device=dev),
            context_lens=torch.zeros(max_bs, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
            cu_seqlens_k=torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),  # unused by decode kernels
            max_seqlen_q=1, max_seqlen_k=cfg.max_model_len,
        )
        pool = None
        for bs in reversed([1, 2, 4, 8] + list(range(16, max_bs + 1, 16))):
            v, m = self.graph_vars, self.graph_meta
            meta = AttentionMetadata(m.slot_mapping[:bs], m.block_tables[:bs], m.context_lens[:bs],
                                     m.cu_seqlens_q[: bs + 1], m.cu_seqlens_k[: bs + 1], 1, m.max_seqlen_k)
            v["outputs"][:bs] = self.model(v["input_ids"][:bs], v["positions"][:bs], meta)  # warm up
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                v["outputs"][:bs] = self.model(v["input_ids"][:bs], v["positions"][:bs], meta)
            pool = pool or graph.pool()  # all graphs share one memory pool: only one runs at a time
            self.graphs[bs] = graph
            torch.cuda.synchronize()

    def _replay_cudagraph(self, input_ids: torch.Tensor, positions: torch.Tensor,
                          meta: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        graph_bs = min(bs for bs in self.graphs if bs >= n)
        v, m = self.graph_vars, self.graph_meta
        v["input_ids"][:n], v["positions"][:n] = input_ids, positions
        m.slot_mapping.fill_(self.scratch_slot)
        m.slot_mapping[:n] = meta.slot_mapping
        m.context_lens.zero_()
        m.context_lens[:n] = meta.context_lens
        m.block_tables[:n, : meta.block_tables.shape[1]] = meta.block_tables
        self.graphs[graph_bs].replay()
        return v["outputs"][:n]

