"""bench.py's scenarios: what runs, in which order, and which ratios it reports. Each takes the model folder, the
parsed arguments and the workload, and returns a Scenario: each engine's figures and the ratios between them.
--multi-turn, whose workload is conversations, makes and reports its own.
"""
import gc
import os
import random
from dataclasses import dataclass, field, replace
from time import perf_counter

from nanoserve import LLM, SamplingParams
from nanoserve.config import Config

# isort: split
from transformers import AutoConfig

from benchmarks.peers import PEERS, bench_llama_cpp, missing_peer
from benchmarks.report import percentiles, progress, same_tokens, write_json
from benchmarks.timing import bench_nanoserve, matmul_floor, nanoserve_name
from benchmarks.workloads import make_lora_adapters, merge_lora


@dataclass
class Scenario:
    """What a scenario measured, as the table and the JSON report it."""

    results: dict[str, dict] = field(default_factory=dict)  # each engine's figures, by the name the table shows
    ratios: dict[str, float] = field(default_factory=dict)  # output tokens/s of one over another's
    skipped: dict[str, str] = field(default_factory=dict)  # optional peers that cannot run here, and why


def against_peers(path: str, args, prompts: list[list[int]], output_lens: list[int], folder: str) -> Scenario:
    """The default (also --quick, --nano-vllm, --lookup): the peers, nanoserve in each --dtype, then the same engine
    with each other backend or KV dtype, and with speculation, each right after it; llama.cpp last."""
    # transformers first: nanoserve's start-up tunes the process's allocator (keep_freed_memory),
    # which transformers as a user runs it does not get. llama.cpp allocates its own buffers once.
    # vLLM runs in a process of its own, which gives back all it took when it ends.
    out = Scenario(skipped={name: reason for name in args.peers if (reason := missing_peer(name, args))})
    results, ratios = out.results, out.ratios
    for name, reason in out.skipped.items():
        print(f"{name}: skipped, {reason}")
    run = [name for name in args.peers if name not in out.skipped]
    peers = {name: progress(f"{name}: {len(prompts)} prompts") or PEERS[name](path, args, prompts, output_lens)
             for name in run if name != "llama.cpp"}
    for dtype in args.dtypes:
        results[nanoserve_name(dtype, args)] = bench_nanoserve(path, args, prompts, output_lens, dtype)
    first_name = nanoserve_name(args.dtypes[0], args)
    first = results[first_name]
    for kind, option, values in (("attention", "attention_backend", args.attention_backends),
                                 ("elementwise", "elementwise_backend", args.elementwise_backends),
                                 ("kv cache", "kv_cache_dtype", args.kv_cache_dtypes)):
        for value in values[1:]:  # the same engine with another backend or KV dtype, right after it
            other = results[f"{first_name} {value} {kind}"] = bench_nanoserve(
                path, args, prompts, output_lens, args.dtypes[0], **{option: value})
            ratios[f"{kind} {first[option]} / {value}"] = first["tokens_per_s"] / other["tokens_per_s"]
    if args.speculative_config:  # the same engine with speculation, right after it
        on = results[f"{first_name} speculative"] = bench_nanoserve(
            path, args, prompts, output_lens, args.dtypes[0], speculative_config=args.speculative_config)
        ratios["speculative on / off"] = on["tokens_per_s"] / first["tokens_per_s"]
        print(f"speculative: TPOT p50 {first['tpot_p50_ms']:.1f} -> {on['tpot_p50_ms']:.1f} ms "
              f"({first['tpot_p50_ms'] / on['tpot_p50_ms']:.2f}x), acceptance rate "
              f"{on['acceptance_rate']:.1%}, mean acceptance length {on['mean_acceptance_length']:.2f}")
    if "llama.cpp" in run:
        progress(f"llama.cpp: {len(prompts)} prompts")
        peers["llama.cpp"] = bench_llama_cpp(args, prompts, output_lens)
    fastest = max(results, key=lambda name: results[name]["tokens_per_s"])
    for name, r in peers.items():
        label = f"{name} ({r['dtype']}, batch {r['batch_size']})" if "batch_size" in r else \
            f"{name} ({r.get('quantization') or r['dtype']})"
        results[label] = r
        ratios[f"nanoserve {args.dtypes[0]} / {name}"] = first["tokens_per_s"] / r["tokens_per_s"]
        if fastest != first_name:
            ratios[f"{fastest} / {name}"] = results[fastest]["tokens_per_s"] / r["tokens_per_s"]
    for r in results.values():  # greedy agreement with nanoserve's first dtype, token by token
        r["same_tokens"] = same_tokens(r["token_ids"], first["token_ids"])
    if args.matmul_floor:
        hf_config = AutoConfig.from_pretrained(path)
        for dtype in args.dtypes:
            r = results[nanoserve_name(dtype, args)]
            floor = matmul_floor(hf_config, r["dtype"], r["device"], r["step_shapes"])
            results[f"matmul floor {r['dtype']}"] = dict(
                output_tokens=r["output_tokens"], wall_s=floor, tokens_per_s=r["output_tokens"] / floor)
            r["floor_share"] = floor / r["wall_s"]  # how close the engine gets to the limit
    return out


def shared_prefix(path: str, args, prompts: list[list[int]], output_lens: list[int], folder: str) -> Scenario:
    """--shared-prefix: prefix caching on, then off, on prompts that share a long prefix."""
    out = Scenario()
    on = out.results["nanoserve (prefix cache)"] = bench_nanoserve(path, args, prompts, output_lens, args.dtypes[0])
    off = out.results["nanoserve (no prefix cache)"] = bench_nanoserve(
        path, args, prompts, output_lens, args.dtypes[0], enable_prefix_caching=False)
    out.ratios["prefix cache on / off"] = on["tokens_per_s"] / off["tokens_per_s"]
    return out


def lora(path: str, args, prompts: list[list[int]], output_lens: list[int], folder: str) -> Scenario:
    """--lora N: the workload on the base model, spread over N random adapters, and with one adapter merged."""
    out, loras = Scenario(), make_lora_adapters(path, folder, args.lora)
    base = out.results["nanoserve base model"] = bench_nanoserve(path, args, prompts, output_lens, args.dtypes[0])
    spread = [loras[i % args.lora] for i in range(len(prompts))]
    adapters = out.results[f"nanoserve {args.lora} LoRA adapters"] = bench_nanoserve(
        path, args, prompts, output_lens, args.dtypes[0], spread, enable_lora=True, max_loras=args.lora)
    merged = out.results["nanoserve 1 adapter merged"] = bench_nanoserve(
        merge_lora(path, loras[0], os.path.join(folder, "merged")), args, prompts, output_lens, args.dtypes[0])
    out.ratios[f"{args.lora} LoRA adapters / base model"] = adapters["tokens_per_s"] / base["tokens_per_s"]
    out.ratios["1 adapter merged / base model"] = merged["tokens_per_s"] / base["tokens_per_s"]
    return out


def kv_pool_blocks(path: str, args, kv_cache_dtype: str, longest: int) -> int:
    """The KV blocks --kv-cache-memory-bytes hold for this model, dtype and block size: K and V of every layer for
    each token of a block, as ModelRunner.block_bytes counts them (one device: no tensor parallelism). Too few
    for the longest request (prompt and output, in tokens) is a ValueError, before any engine starts."""
    config = Config(path, dtype=args.dtypes[0], kv_cache_dtype=kv_cache_dtype, block_size=args.block_size)
    hf = config.hf_config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    blocks = args.kv_cache_memory_bytes // (2 * hf.num_hidden_layers * config.block_size * hf.num_key_value_heads
                                            * head_dim * config.kv_cache_torch_dtype.itemsize)
    if blocks * config.block_size < longest:
        raise ValueError(f"--kv-cache-memory-bytes {args.kv_cache_memory_bytes} holds {blocks} blocks of "
                         f"{kv_cache_dtype} KV, fewer than the longest request's {longest} tokens need")
    return blocks


def memory_bound(path: str, args, prompts: list[list[int]], output_lens: list[int], folder: str) -> Scenario:
    """--memory-bound: nano-vllm's workload in a KV pool of --kv-cache-memory-bytes, once per --kv-cache-dtype.
    More requests than fit: a KV dtype of fewer bytes holds more tokens in the same pool (fp8 twice bfloat16's),
    so more sequences run each step and fewer are preempted (recomputed)."""
    longest = max(len(p) + n for p, n in zip(prompts, output_lens))
    blocks = {dtype: kv_pool_blocks(path, args, dtype, longest) for dtype in args.kv_cache_dtypes}
    out = Scenario()
    for kv_cache_dtype, num_blocks in blocks.items():
        out.results[f"{nanoserve_name(args.dtypes[0], args)} {kv_cache_dtype} kv cache"] = bench_nanoserve(
            path, args, prompts, output_lens, args.dtypes[0], kv_cache_dtype=kv_cache_dtype,
            num_kvcache_blocks=num_blocks)
    first, *others = out.results.values()
    for r in out.results.values():  # the same model: greedy agreement with the first KV dtype's tokens
        r["same_tokens"] = same_tokens(r["token_ids"], first["token_ids"])
    for r in others:
        out.ratios[f"kv cache {r['kv_cache_dtype']} / {first['kv_cache_dtype']}"] = (r["tokens_per_s"]
                                                                                    / first["tokens_per_s"])
    return out


def run_multi_turn(path: str, args, conversations: list[list[list[int]]], output_lens: list[list[int]],
                   **options) -> dict:
    """--multi-turn: conversation 0's turn 1, conversation 1's turn 1, ..., then everyone's turn 2: each turn sends
    the history (earlier messages and answers) and its new message, one request at a time, so that its TTFT is its
    prefill. The device pool holds a quarter of the conversations' KV: by a conversation's next turn, the others
    have evicted its blocks."""
    block_size = args.block_size or 16
    working_set = sum(sum(map(len, c)) + sum(n) for c, n in zip(conversations, output_lens))
    llm = LLM(path, block_size=block_size, num_kvcache_blocks=-(-working_set // block_size) // 4,
              enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling, **options)
    llm.generate([list(range(1, 33))], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    engine, before = llm.engine, replace(llm.stats)
    histories, answers, ttft = [[] for _ in conversations], [], []
    start = perf_counter()
    label = "host tier on" if options.get("kv_offloading_size") else "host tier off"
    for turn in range(args.turns):
        progress(f"multi-turn, {label}: turn {turn + 1} of {args.turns}, {len(conversations)} conversations")
        for i, conversation in enumerate(conversations):
            prompt, tokens = histories[i] + conversation[turn], []
            sent = perf_counter()
            engine.add_request(f"{i}.{turn}", prompt, SamplingParams(temperature=0, ignore_eos=True,
                                                                     max_tokens=output_lens[i][turn]))
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if not tokens:
                        ttft.append(perf_counter() - sent)
                    tokens += out.new_token_ids
            histories[i] = prompt + tokens
            answers.append(tokens)
    wall, stats = perf_counter() - start, llm.stats
    prompt_tokens = stats.num_prompt_tokens - before.num_prompt_tokens
    cached = stats.num_cached_tokens - before.num_cached_tokens
    host = stats.num_host_cached_tokens - before.num_host_cached_tokens
    output_tokens = sum(map(len, answers))
    result = dict(prompt_tokens=prompt_tokens, prompt_tokens_recomputed=prompt_tokens - cached,
                  device_hit_rate=(cached - host) / prompt_tokens, host_hit_rate=host / prompt_tokens,
                  ttft_p50_s=percentiles(ttft)[0], ttft_p90_s=percentiles(ttft)[1], output_tokens=output_tokens,
                  wall_s=wall, tokens_per_s=output_tokens / wall, device_blocks=llm.engine.block_manager.num_blocks,
                  offloaded_blocks=stats.num_offloaded_blocks, loaded_blocks=stats.num_loaded_blocks,
                  answers=answers)
    del llm
    gc.collect()
    return result


def multi_turn(path: str, args, vocab_size: int, machine_info: dict) -> dict:
    """The prefix cache's host tier off, then on, back to back, on the same conversations."""
    rng = random.Random(args.seed)
    conversations = [[[rng.randrange(3, vocab_size) for _ in range(rng.randint(*args.input_len))]
                      for _ in range(args.turns)] for _ in range(args.num_prompts)]
    output_lens = [[rng.randint(*args.output_len) for _ in range(args.turns)] for _ in range(args.num_prompts)]
    print(f"multi-turn: {args.num_prompts} conversations x {args.turns} turns, messages {args.input_len}, "
          f"answers {args.output_len} tokens, model {args.model}")
    results = {"host tier off": run_multi_turn(path, args, conversations, output_lens),
               "host tier on": run_multi_turn(path, args, conversations, output_lens, kv_offloading_size=1.0)}
    same = results["host tier off"].pop("answers") == results["host tier on"].pop("answers")
    print(f"{'':14} {'recomputed':>10} {'device hits':>11} {'host hits':>9} {'TTFT p50':>9} {'TTFT p90':>9} "
          f"{'tok/s':>7}")
    for name, r in results.items():
        print(f"{name:14} {r['prompt_tokens_recomputed']:>10} {r['device_hit_rate']:>11.1%} "
              f"{r['host_hit_rate']:>9.1%} {r['ttft_p50_s'] * 1e3:>7.0f}ms {r['ttft_p90_s'] * 1e3:>7.0f}ms "
              f"{r['tokens_per_s']:>7.1f}")
    off, on = results["host tier off"], results["host tier on"]
    ratios = {"TTFT p50 off / on": off["ttft_p50_s"] / on["ttft_p50_s"]}
    print(f"TTFT p50 off / on: {ratios['TTFT p50 off / on']:.2f}x; the same answers: {same}")
    return write_json(dict(scenario="multi-turn", machine=machine_info, model=args.model, results=results,
                           ratios=ratios, same_answers=same,
                           workload=dict(conversations=args.num_prompts, turns=args.turns, input_len=args.input_len,
                                         output_len=args.output_len)), args.json)

