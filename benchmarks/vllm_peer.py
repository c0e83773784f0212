"""vLLM as bench.py's peer (`--peer vllm`). bench.py runs this file with vLLM's own interpreter, since vLLM
pins its own transformers and cannot share nanoserve's environment; it imports nothing from nanoserve.

    VLLM_PYTHON benchmarks/vllm_peer.py JOB.json RESULT.json

JOB holds `model` (a local HF folder), `dtype`, `prompts` (token ids), `output_lens` and `warmup` (token ids).
RESULT holds `token_ids`, `wall_s`, per-request `ttft_s` and `tpot_s`, `load_s`, `warmup_s`, `vllm` (its version)
and `device`. The batch runs through vLLM's offline `LLM.generate`, greedy, ignore_eos, each request with its own
max_tokens: what bench.py gives nanoserve. generate() returns only finished requests, so the per-request times
come from vLLM's own stats (`RequestOutput.metrics`, filled when `disable_log_stats=False`): TTFT is the request's
arrival plus its first-token latency (both on the front end's clock), counted from the start of the batch;
TPOT is (last token - first token) / (tokens - 1) on the engine core's clock, as bench.py times nanoserve.
"""
import json
import sys
import time

from vllm import LLM, SamplingParams, __version__
from vllm.platforms import current_platform


def main(job_path: str, result_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    t = time.perf_counter()
    llm = LLM(job["model"], dtype=job["dtype"], seed=0, disable_log_stats=False)
    load_s = time.perf_counter() - t  # loading, compiling the model, sizing the KV cache
    t = time.perf_counter()
    llm.generate({"prompt_token_ids": job["warmup"]}, SamplingParams(max_tokens=8), use_tqdm=False)
    warmup_s = time.perf_counter() - t

    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in job["output_lens"]]
    start = time.time()  # wall clock: vLLM stamps a request's arrival with time.time()
    outputs = llm.generate(prompts, params, use_tqdm=True)  # its progress bar: a leg of minutes says how far
    wall = time.time() - start

    token_ids = [list(out.outputs[0].token_ids) for out in outputs]
    if [len(ids) for ids in token_ids] != job["output_lens"]:
        raise RuntimeError("vLLM returned other output lengths than asked for")
    if any(out.metrics is None for out in outputs):
        raise RuntimeError("vLLM gave no per-request stats (RequestOutput.metrics): its API changed")
    ttft = [out.metrics.arrival_time + out.metrics.first_token_latency - start for out in outputs]
    tpot = [(out.metrics.last_token_ts - out.metrics.first_token_ts) / (n - 1)
            for out, n in zip(outputs, job["output_lens"]) if n > 1]
    result = dict(token_ids=token_ids, wall_s=wall, ttft_s=ttft, tpot_s=tpot, load_s=load_s, warmup_s=warmup_s,
                  vllm=__version__, device=current_platform.device_type)
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
