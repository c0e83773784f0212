"""Online serving benchmark: requests arrive as a Poisson process and stream their answers over HTTP.

For nanoserve (`nanoserve serve`) and, in the same run on the same prompts, transformers' own OpenAI-compatible
server (`transformers serve --continuous-batching`, a paged cache with continuous batching). Each server is
started by this script on 127.0.0.1, warmed up with one request, then sent the workload once per request rate.
Every request streams /v1/completions with greedy decoding and must produce exactly its output length (EOS is
ignored: `ignore_eos` for nanoserve, `eos_token_id=-1` in the generation config for transformers).

    python benchmarks/serve.py                                  # 32 prompts at 0.5 and 2 requests/s
    python benchmarks/serve.py --request-rate 1 4 inf --json serve.json
    python bench.py --serve --request-rate 1                   # the same, through bench.py

Figures, measured by the client as vLLM's benchmark_serving does: throughput (requests/s, output tokens/s),
TTFT (arrival to the first text), TPOT (mean time per output token after the first, per request), ITL (the gaps
between successive streamed chunks; a transformers chunk may hold several tokens), p50 and p99.
"""
import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from anywhere: the nanoserve of this checkout
from nanoserve.utils.default_model import resolve_model  # noqa: E402  before transformers loads torch: threads.py

# isort: split
import httpx  # noqa: E402
import numpy as np  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder or hub id (default: the embedded SmolLM2-135M)")
    p.add_argument("--request-rate", type=float, nargs="+", default=[0.5, 2.0],
                   help="requests per second of the Poisson arrivals, one run each (inf: all at once)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-blocks", type=int, default=728, help="KV cache of both servers, in blocks of 16 tokens")
    p.add_argument("--max-batch-tokens", type=int, default=2048, help="both servers' token budget per step")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers peer")
    p.add_argument("--nanoserve-flags", default="", help="extra flags for `nanoserve serve`, one string")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    return p.parse_args(argv)


def make_workload(tokenizer, args) -> list[tuple[str, int]]:
    """(prompt text, output length) pairs: random vocabulary tokens, decoded to text (both servers take text)."""
    rng = random.Random(args.seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(min(tokenizer.vocab_size, 10000)) if i not in special]
    return [(tokenizer.decode([rng.choice(vocab) for _ in range(rng.randint(*args.input_len))]),
             rng.randint(*args.output_len)) for _ in range(args.num_prompts)]


# ---- the servers ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: list[str], url: str, log) -> subprocess.Popen:
    process = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"{cmd[0]} did not start; see {log.name}")


def servers(path: str, args) -> dict[str, tuple[list[str], str, dict]]:
    """name -> (command without the port, model name to send, extra request fields for exact lengths)."""
    # The same KV cache and step budget for both (transformers would otherwise size its cache from free RAM).
    nano = [sys.executable, "-m", "nanoserve.serving", path, "--served-model-name", "bench",
            "--uvicorn-log-level", "warning", "--block-size", "16", "--num-kvcache-blocks", str(args.kv_blocks),
            "--max-num-batched-tokens", str(args.max_batch_tokens), "--max-model-len", str(args.max_batch_tokens),
            *args.nanoserve_flags.split()]
    hf = ["transformers", "serve", "--continuous-batching", "--device", "cpu", "--dtype", "float32",
          "--host", "127.0.0.1", "--cb-block-size", "16", "--cb-num-blocks", str(args.kv_blocks),
          "--cb-max-batch-tokens", str(args.max_batch_tokens), path]
    result = {"nanoserve": (nano, "bench", lambda n: {"ignore_eos": True})}
    if not args.no_transformers:  # its generation config replaces the model's: no EOS, greedy, n tokens
        result["transformers"] = (hf, path, lambda n: {"generation_config": json.dumps(
            {"max_new_tokens": n, "eos_token_id": -1, "do_sample": False})})
    return result


# ---- the client -------------------------------------------------------------------------------------
async def one_request(client: httpx.AsyncClient, url: str, body: dict, delay: float, start: float) -> dict:
    await asyncio.sleep(delay)
    sent = time.perf_counter()
    chunk_times, num_tokens = [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(data["error"])
            if data["choices"] and data["choices"][0]["text"]:
                chunk_times.append(time.perf_counter())
            if data.get("usage"):
                num_tokens = data["usage"]["completion_tokens"]
    done = time.perf_counter()
    ttft = chunk_times[0] - sent
    return dict(ttft=ttft, e2e=done - sent, tokens=num_tokens, end=done - start,
                tpot=(chunk_times[-1] - chunk_times[0]) / (num_tokens - 1) if num_tokens > 1 else None,
                itl=list(np.diff(chunk_times)))


async def run_rate(url: str, model: str, extra, workload, rate: float, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    gaps = np.zeros(len(workload)) if rate == float("inf") else rng.exponential(1 / rate, len(workload))
    delays = np.cumsum(gaps) - gaps[0]
    bodies = [dict(model=model, prompt=p, max_tokens=n, temperature=0, stream=True,
                   stream_options={"include_usage": True}, **extra(n)) for p, n in workload]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, url, b, d, start) for b, d in zip(bodies, delays)))
    expected = [n for _, n in workload]
    if [r["tokens"] for r in results] != expected:
        raise RuntimeError(f"{model}: output lengths differ from the workload's")
    wall = max(r["end"] for r in results)

    def pct(key: str, scale: float = 1e3) -> tuple[float, float]:
        values = [v for r in results for v in (r[key] if isinstance(r[key], list) else [r[key]]) if v is not None]
        return tuple(float(np.percentile(values, q)) * scale for q in (50, 99))

    return dict(request_rate=rate, wall_s=wall, requests_per_s=len(results) / wall,
                output_tokens_per_s=sum(expected) / wall, ttft_ms=pct("ttft"), tpot_ms=pct("tpot"),
                itl_ms=pct("itl"), e2e_s=pct("e2e", 1))


def bench_server(name: str, cmd: list[str], model: str, extra, workload, args, log) -> list[dict]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"starting {name} ...", flush=True)
    process = start_server([*cmd, "--port", str(port)], url, log)
    try:
        asyncio.run(run_rate(url, model, extra, workload[:1], float("inf"), args.seed))  # warm-up
        figures = []
        for rate in args.request_rate:
            figures.append(asyncio.run(run_rate(url, model, extra, workload, rate, args.seed)))
            print(f"  {name} at {rate} req/s: done in {figures[-1]['wall_s']:.1f} s", flush=True)
        return figures
    finally:
        process.terminate()
        process.wait(60)


def print_table(results: dict[str, list[dict]]) -> None:
    head = (f"{'rate':>6} {'engine':<14}{'req/s':>7}{'tok/s':>8}{'TTFT p50/p99 ms':>19}{'TPOT p50/p99 ms':>19}"
            f"{'ITL p50/p99 ms':>19}")
    print(head + "\n" + "-" * len(head))
    for i, rate in enumerate(r["request_rate"] for r in next(iter(results.values()))):
        for name, figures in results.items():
            f = figures[i]
            cells = "".join(f"{a:>10.0f} /{b:>7.0f}" for a, b in (f["ttft_ms"], f["tpot_ms"], f["itl_ms"]))
            print(f"{rate:>6} {name:<14}{f['requests_per_s']:>7.2f}{f['output_tokens_per_s']:>8.1f}{cells}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    path = resolve_model(args.model)
    workload = make_workload(AutoTokenizer.from_pretrained(path), args)
    load = os.getloadavg()[0]  # other work on the machine skews CPU timings
    print(f"{len(workload)} requests, output {sum(n for _, n in workload)} tokens, rates {args.request_rate}, "
          f"load average {load:.2f}")
    results, commands = {}, {}
    with tempfile.NamedTemporaryFile("w", prefix="serve-bench-", suffix=".log", delete=False) as log:
        for name, (cmd, model, extra) in servers(path, args).items():
            results[name] = bench_server(name, cmd, model, extra, workload, args, log)
            commands[name] = " ".join(cmd[1:] if name == "nanoserve" else cmd)
    print_table(results)
    return write_report(args, load, log, num_prompts=args.num_prompts, input_len=args.input_len,
                        output_len=args.output_len, seed=args.seed, commands=commands, results=results)


def write_report(args, load: float, log, /, **fields) -> dict:
    """The run's report: the model, the load average before and now (printed, with the servers' log), fields;
    written to --json too."""
    print(f"load average at the end: {os.getloadavg()[0]:.2f}; server logs: {log.name}")
    report = dict(model=args.model or "default", load_avg_1min=load, load_avg_1min_end=os.getloadavg()[0], **fields)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
