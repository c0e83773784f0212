"""Disaggregated prefill against two single instances, on the same cores: long prompts arriving while short requests
decode (docs/disaggregated.md).

Two setups serve the same workload, each server pinned to one core (taskset, one torch thread):
  - "2 x single": two `nanoserve serve` instances, the client sending the requests to each in turn;
  - "prefill + decode": a kv_producer instance on core 0, a kv_consumer instance on core 1, `nanoserve proxy`
    in front (unpinned; it only relays).
The workload: short requests (--short-input tokens, --short-output tokens) arriving as a Poisson process, and long
prompts (--long-input tokens, --long-output tokens) among them. Every request streams /v1/completions, greedy, EOS
ignored. Reported per kind of request: TTFT and ITL (the gaps between streamed tokens), p50 and p99, as measured by
the client (benchmarks/serve.py's).

    python benchmarks/disagg.py                       # 24 short and 4 long requests
    python benchmarks/disagg.py --json disagg.json
"""
import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from nanoserve.utils.default_model import resolve_model  # noqa: E402  before transformers loads torch

# isort: split
import httpx  # noqa: E402
import numpy as np  # noqa: E402
from serve import free_port, one_request, start_server, write_report  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder or hub id (default: the embedded SmolLM2-135M)")
    p.add_argument("--num-short", type=int, default=24)
    p.add_argument("--num-long", type=int, default=4)
    p.add_argument("--short-input", type=int, default=32)
    p.add_argument("--short-output", type=int, default=48)
    p.add_argument("--long-input", type=int, default=1536)
    p.add_argument("--long-output", type=int, default=4)
    p.add_argument("--request-rate", type=float, default=2.0, help="arrivals per second, all kinds together")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cores", default="0,1", help="the two cores, one per server")
    p.add_argument("--nanoserve-flags", default="", help="extra flags for every `nanoserve serve`, one string")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    return p.parse_args(argv)


def make_workload(tokenizer, args) -> list[tuple[str, str, int, float]]:
    """(kind, prompt text, output length, arrival in s): the long prompts spread among the short ones."""
    rng = random.Random(args.seed)
    vocab = [i for i in range(min(tokenizer.vocab_size, 10000)) if i not in set(tokenizer.all_special_ids)]
    kinds = ["short"] * args.num_short + ["long"] * args.num_long
    rng.shuffle(kinds)
    kinds = ["short"] + kinds  # (the first arrival decodes while the rest come)
    gaps = np.random.default_rng(args.seed).exponential(1 / args.request_rate, len(kinds))
    arrivals = np.cumsum(gaps) - gaps[0]
    sizes = {"short": (args.short_input, args.short_output), "long": (args.long_input, args.long_output)}
    return [(kind, tokenizer.decode([rng.choice(vocab) for _ in range(sizes[kind][0])]), sizes[kind][1], float(t))
            for kind, t in zip(kinds, arrivals)]


def serve_cmd(path: str, core: str, args, *flags: str) -> list[str]:
    return ["taskset", "-c", core, sys.executable, "-m", "nanoserve.serving", path, "--served-model-name", "bench",
            "--uvicorn-log-level", "warning", "--max-model-len", "2048", "--max-num-batched-tokens", "2048",
            "--num-kvcache-blocks", "1024", "--shutdown-timeout", "1", *flags, *args.nanoserve_flags.split()]


async def run_workload(urls: list[str], workload) -> list[dict]:
    """Each request to urls[i % len(urls)] (one URL: all to it), at its arrival time."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()
        bodies = [dict(model="bench", prompt=p, max_tokens=n, temperature=0, ignore_eos=True, stream=True,
                       stream_options={"include_usage": True}) for _, p, n, _ in workload]
        return await asyncio.gather(*(one_request(client, urls[i % len(urls)], body, t, start)
                                      for i, (body, (_, _, _, t)) in enumerate(zip(bodies, workload))))


def figures(results: list[dict], workload) -> dict:
    out = {}
    for kind in ("short", "long"):
        mine = [r for r, w in zip(results, workload) if w[0] == kind]
        itl = [v for r in mine for v in r["itl"]]
        out[kind] = dict(ttft_ms=[float(np.percentile([r["ttft"] for r in mine], q)) * 1e3 for q in (50, 99)],
                         itl_ms=[float(np.percentile(itl, q)) * 1e3 for q in (50, 99)] if itl else None)
    return out


def run_setup(name: str, commands: list[tuple[list[str], str]], targets: list[str], workload, log) -> dict:
    """Start the processes (command, URL), warm up, run the workload against `targets`, stop them."""
    print(f"starting {name} ...", flush=True)
    processes = []
    try:
        for cmd, url in commands:
            processes.append(start_server(cmd, url, log))
        asyncio.run(run_workload(targets, [("short", workload[0][1], 2, 0.0)] * len(targets)))  # warm-up
        results = asyncio.run(run_workload(targets, workload))
        if [r["tokens"] for r in results] != [n for _, _, n, _ in workload]:
            raise RuntimeError(f"{name}: output lengths differ from the workload's")
        return figures(results, workload)
    finally:
        for process in processes:
            process.terminate()
            process.wait(60)


def main(argv=None) -> dict:
    args = parse_args(argv)
    path = resolve_model(args.model)
    workload = make_workload(AutoTokenizer.from_pretrained(path), args)
    cores = args.cores.split(",")
    load = os.getloadavg()[0]
    print(f"{args.num_short} short ({args.short_input} -> {args.short_output} tokens) and {args.num_long} long "
          f"({args.long_input} -> {args.long_output}) requests at {args.request_rate}/s; load average {load:.2f}")
    os.environ["OMP_NUM_THREADS"] = "1"  # one torch thread per server: its core
    results = {}
    with tempfile.NamedTemporaryFile("w", prefix="disagg-bench-", suffix=".log", delete=False) as log:
        urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
        singles = [(serve_cmd(path, core, args, "--port", url.rsplit(":", 1)[1]), url)
                   for core, url in zip(cores, urls)]
        results["2 x single"] = run_setup("2 x single", singles, urls, workload, log)
        prefill, decode, proxy = (f"http://127.0.0.1:{free_port()}" for _ in range(3))
        kv_port = free_port()
        pair = [(serve_cmd(path, core, args, "--port", url.rsplit(":", 1)[1], "--kv-transfer-config", json.dumps(
                    {"kv_connector": "P2pConnector", "kv_role": role, "kv_port": kv_port})), url)
                for core, url, role in zip(cores, (prefill, decode), ("kv_producer", "kv_consumer"))]
        pair.append(([sys.executable, "-m", "nanoserve.serving.proxy", "--prefill", prefill, "--decode", decode,
                      "--port", proxy.rsplit(":", 1)[1], "--uvicorn-log-level", "warning"], proxy))
        results["prefill + decode"] = run_setup("prefill + decode", pair, [proxy], workload, log)
    head = f"{'setup':<18}{'kind':<7}{'TTFT p50/p99 ms':>20}{'ITL p50/p99 ms':>20}"
    print(head + "\n" + "-" * len(head))
    for name, by_kind in results.items():
        for kind, f in by_kind.items():
            itl = f"{f['itl_ms'][0]:>10.0f} /{f['itl_ms'][1]:>8.0f}" if f["itl_ms"] else f"{'-':>20}"
            print(f"{name:<18}{kind:<7}{f['ttft_ms'][0]:>10.0f} /{f['ttft_ms'][1]:>8.0f}{itl}")
    return write_report(args, load, log, args=vars(args), results=results)


if __name__ == "__main__":
    main()
