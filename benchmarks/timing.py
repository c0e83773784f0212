"""nanoserve, timed: bench.py drives `llm.engine` step by step (as LLM.generate does) to timestamp each request's
tokens, and wraps `model_runner.run_model` to time the forward. Beside it, the limits it is measured against: the
memory bandwidth of this device, and the bare matrix multiplies of the steps it ran (`--matmul-floor`).

Decoding is bound by memory: every step reads all the weights and every sequence's cached K/V. These functions count
those bytes each step, divide them by the forward's time (GB/s, as gpt-fast reports them) and by the memory
bandwidth measured first on this device (a sum over a buffer far larger than the caches): the share of the machine's
limit that the forward reaches.
"""
import gc
from collections.abc import Callable
from time import perf_counter

from nanoserve import LLM, LoRARequest, RequestOutputKind, SamplingParams
from nanoserve.layers.linear import ParallelLMHead, VocabParallelEmbedding, linear
from nanoserve.layers.onednn import reorder_for_cpu

# isort: split
import torch

from benchmarks.report import Countdown, percentiles, progress


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_forward(runner) -> tuple[Callable[[], list[float]], list[tuple[int, int]], Callable[[], int]]:
    """Wrap runner.run_model (model forward + logits) to time each call and note its shape (rows in the
    batch, rows that get logits). Returns a function that gives the durations after the run, the shapes, and
    a function that gives the tokens of cached K/V the steps read (their context lengths, summed).
    On CUDA, events recorded around each call time it on the GPU without waiting for it: a host sync here
    would stop async scheduling from planning the next step while the GPU runs this one. For the same reason
    the context lengths are summed on the device and read back after the run."""
    marks: list[tuple] = []
    shapes: list[tuple[int, int]] = []
    context_tokens: list[torch.Tensor] = []
    run_model, cuda = runner.run_model, runner.device.type == "cuda"

    def mark():
        if not cuda:
            return perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def timed_run_model(input_ids, positions, meta, logits_rows):
        start = mark()
        out = run_model(input_ids, positions, meta, logits_rows)
        marks.append((start, mark()))
        shapes.append((input_ids.shape[0], logits_rows.shape[0]))
        context_tokens.append(meta.context_lens.sum())
        return out

    def durations() -> list[float]:
        sync(runner.device)
        return [a.elapsed_time(b) / 1e3 if cuda else b - a for a, b in marks]

    runner.run_model = timed_run_model  # an instance attribute shadows the method
    return durations, shapes, lambda: int(torch.stack(context_tokens).sum()) if context_tokens else 0


def bytes_per_step(runner) -> tuple[int, int]:
    """(weight bytes, KV bytes per cached token) that a forward must read from memory: every weight once per step
    (a tied embedding once, by the LM head; of an untied one only the step's rows, left out), and the K and V of
    every token in each sequence's context, in the cache's dtype. Rank 0's share with tensor parallelism."""
    modules = list(runner.model.modules())
    heads = {id(m.weight) for m in modules if isinstance(m, ParallelLMHead)}
    lookups = {id(m.weight) for m in modules if type(m) is VocabParallelEmbedding} - heads
    params = {id(p): p for p in runner.model.parameters()}  # one entry per tensor: tied weights count once
    weights = sum(p.numel() * p.element_size() for i, p in params.items() if i not in lookups)
    kv = runner.kv_cache  # [2, layers, blocks, block_size, kv_heads, head_dim]
    return weights, 2 * kv.shape[1] * kv.shape[4] * kv.shape[5] * kv.element_size()


def memory_bandwidth(device: torch.device, size: int = 2**29) -> float:
    """Bytes per second this device's memory delivers: the best of 5 sums over `size` bytes of float32, far
    more than any cache holds (a reduction reads, as a decode step does)."""
    x = torch.ones(size // 4, device=device)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t = perf_counter()
        x.sum()
        sync(device)
        best = min(best, perf_counter() - t)
    return size / best


def run_nanoserve(llm: LLM, prompts: list[list[int]], output_lens: list[int], warmup: list[int],
                  loras: list[LoRARequest | None] | None = None, label: str = "nanoserve") -> dict:
    """Drive the engine like LLM.generate does, timestamping each request's first and last token, and counting the
    sequences running after each step (what the KV pool holds). loras: each request's adapter (--lora)."""
    engine, countdown = llm.engine, Countdown(label, len(prompts))
    t = perf_counter()
    llm.generate([warmup], SamplingParams(max_tokens=8), use_tqdm=False)
    warmup_s = perf_counter() - t
    forward_durations, step_shapes, context_tokens = time_forward(engine.model_runner)
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=n, output_kind=RequestOutputKind.FINAL_ONLY)
              for n in output_lens]  # FINAL_ONLY, as LLM.generate asks: the text is decoded once, at the end
    preemptions_before, running = llm.stats.num_preemptions, []
    start = perf_counter()
    for i, (ids, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), ids, sp, lora_request=None if loras is None else loras[i])
    first_token, finish, token_ids, cached = {}, {}, [[] for _ in prompts], [0] * len(prompts)
    gc.freeze()  # as LLM.generate does: the heap so far is left out of full collections
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = perf_counter()
        for out in outputs:
            i = int(out.request_id)
            first_token.setdefault(i, now)
            token_ids[i] += out.new_token_ids
            if out.finished:
                finish[i], cached[i] = now, out.num_cached_tokens
                countdown(len(finish))
        running.append(len(engine.scheduler.running))
    wall = perf_counter() - start
    gc.unfreeze()
    forward_times = forward_durations()
    assert [len(ids) for ids in token_ids] == output_lens
    num_tokens = sum(output_lens)
    ttft = [first_token[i] - start for i in range(len(prompts))]
    tpot = [(finish[i] - first_token[i]) / (n - 1) for i, n in enumerate(output_lens) if n > 1]
    forward = sum(forward_times)
    weight_bytes, kv_bytes_per_token = bytes_per_step(engine.model_runner)
    bytes_read = weight_bytes * len(forward_times) + kv_bytes_per_token * context_tokens()
    return dict(
        output_tokens=num_tokens, wall_s=wall, tokens_per_s=num_tokens / wall,
        ttft_p50_s=percentiles(ttft)[0], ttft_p90_s=percentiles(ttft)[1],
        tpot_p50_ms=percentiles(tpot)[0] * 1e3, tpot_p90_ms=percentiles(tpot)[1] * 1e3,
        forward_s=forward, overhead_share=(wall - forward) / wall, warmup_s=warmup_s,
        steps=len(forward_times), cached_prompt_tokens=sum(cached), step_shapes=step_shapes, token_ids=token_ids,
        weight_bytes=weight_bytes, bytes_read=bytes_read, read_bytes_per_s=bytes_read / forward,
        kv_bytes_per_token=kv_bytes_per_token, running_seqs_mean=sum(running) / len(running),
        running_seqs_max=max(running), num_preemptions=llm.stats.num_preemptions - preemptions_before,
    )


def bench_nanoserve(path: str, args, prompts, output_lens, dtype: str = "auto",
                    loras: list[LoRARequest | None] | None = None, **options) -> dict:
    shown = [f"{name}={value}" for name, value in options.items() if value is not None]
    label = f"nanoserve {dtype}{' with ' + ', '.join(shown) if shown else ''}"
    progress(f"{label}: {len(prompts)} prompts")
    options.setdefault("attention_backend", args.attention_backends[0])
    options.setdefault("elementwise_backend", args.elementwise_backends[0])
    options.setdefault("kv_cache_dtype", args.kv_cache_dtypes[0])
    if args.block_size:
        options["block_size"] = args.block_size
    if args.max_num_seqs:
        options["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(path, dtype=dtype, enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
              enable_chunked_prefill=args.enable_chunked_prefill,
              tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
              **options)
    # The warm-up request is the shared prefix, if any: like a system prompt a running server has seen.
    # (Otherwise the prompts of the first prefill step would all miss: blocks are cached once computed.)
    # It also compiles the Triton kernels' variants that CUDA graphs did not: warmup_s shows that cost.
    warmup = prompts[0][: args.prefix_len] if args.shared_prefix else list(range(1, 33))
    result = run_nanoserve(llm, prompts, output_lens, warmup, loras, label)
    config, num_blocks = llm.engine.config, llm.engine.block_manager.num_blocks
    result.update(dtype=config.dtype, device=config.device, block_size=config.block_size,
                  async_scheduling=config.scheduler_config.async_scheduling, max_num_seqs=config.max_num_seqs,
                  elementwise_backend=config.elementwise_backend, attention_backend=config.attention_backend,
                  kv_cache_dtype=config.kv_cache_dtype,
                  enable_chunked_prefill=config.enable_chunked_prefill,
                  max_num_batched_tokens=config.max_num_batched_tokens, num_kvcache_blocks=num_blocks,
                  kv_cache_bytes=num_blocks * config.block_size * result["kv_bytes_per_token"])
    if config.speculative_config is not None:
        spec = llm.stats.spec_decoding
        result.update(num_drafts=spec.num_drafts, num_draft_tokens=spec.num_draft_tokens,
                      num_accepted_tokens=spec.num_accepted_tokens, acceptance_rate=spec.acceptance_rate,
                      mean_acceptance_length=spec.mean_acceptance_length,
                      acceptance_rate_per_pos=spec.acceptance_rate_per_pos)
    figures = ", ".join(f"{k} {result[k]:.3g}" for k in ("tokens_per_s", "wall_s", "forward_s", "overhead_share")
                        if k in result)
    progress(f"{label}: done, {figures}")  # kept if cut off
    del llm
    gc.collect()  # give back the KV cache before the next engine allocates its own
    return result


def nanoserve_name(dtype: str, args) -> str:
    scheduling = {None: "", True: " async", False: " sync"}[args.async_scheduling]  # (None: the default)
    return (f"nanoserve {dtype}" + " eager" * args.enforce_eager + scheduling
            + " chunked" * args.enable_chunked_prefill)


def linear_shapes(config) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(in, out) features of one decoder layer's projections (q/k/v fused, o, gate/up fused, down), and the
    LM head's: the weight matrices every token of a step multiplies with."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    h, q, kv = config.hidden_size, config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    layer = [(h, q + 2 * kv), (q, h), (h, 2 * config.intermediate_size), (config.intermediate_size, h)]
    return layer, (h, config.vocab_size)


def matmul_floor(config, dtype: str, device: str, step_shapes: list[tuple[int, int]]) -> float:
    """Seconds the bare matrix multiplies of the given steps take: every layer's projections on all rows of
    a step, the LM head on the rows that get logits. No attention, norms or copies: the physical limit of
    this model on this machine. Timed at powers of two up to 512 rows, interpolated between them (beyond
    512 rows the multiplies are compute-bound and scale linearly)."""
    layer, (hidden, vocab) = linear_shapes(config)
    kw = dict(dtype=getattr(torch, dtype), device=device)
    # One weight set per layer, as in the model: a decode step streams all of them from memory.
    layers = [torch.randn(o, i, **kw) for _ in range(config.num_hidden_layers) for i, o in layer]
    lm_head = [torch.randn(vocab, hidden, **kw)]
    if device == "cpu":  # multiplied as nanoserve multiplies them: reordered for oneDNN
        layers, lm_head = [reorder_for_cpu(w) for w in layers], [reorder_for_cpu(w) for w in lm_head]

    @torch.inference_mode()
    def seconds(weights: list[torch.Tensor], rows: int) -> float:
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1], **kw) for w in weights}
        best = float("inf")
        for _ in range(3):
            sync(torch.device(device))
            t = perf_counter()
            for w in weights:
                linear(inputs[w.shape[1]], w)
            sync(torch.device(device))
            best = min(best, perf_counter() - t)
        return best

    cache: dict[tuple[int, int], float] = {}

    def interpolated(weights: list[torch.Tensor], rows: int) -> float:
        if rows == 0:
            return 0.0
        lo = 1 << (min(rows, 512).bit_length() - 1)  # the power of two at or below
        hi = min(lo * 2, 512)
        for n in (lo, hi):
            if (id(weights), n) not in cache:
                cache[id(weights), n] = seconds(weights, n)
        t_lo, t_hi = cache[id(weights), lo], cache[id(weights), hi]
        if rows >= 512:
            return t_hi * rows / 512
        return t_lo + (t_hi - t_lo) * (rows - lo) / max(hi - lo, 1)

    return sum(interpolated(layers, n) + interpolated(lm_head, m) for n, m in step_shapes)

