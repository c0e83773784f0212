#!/usr/bin/env bash
# The GPU checks, in one run of under 5 minutes on an H100 or H200, with nothing from the internet (the models are
# random weights from configs in this checkout). Whoever is lent a GPU runs it and records the figures, with the
# device's name, in docs/benchmarks.md:
#
#     bash benchmarks/gpu_check.sh [OUT_DIR]       # figures as JSON and logs in OUT_DIR (default: gpu-check/)
#
# 1. the CUDA tests: greedy float32 equal to transformers under every option (tests/test_cuda.py), the Triton
#    kernels natively (attention, elementwise, the fp8 KV cache);
# 2. nano-vllm's workload (256 requests, 100-1024 tokens in and out, Qwen3-0.6B's shapes): async scheduling with
#    the KV cache in bfloat16 then fp8, back to back; then synchronous;
# 3. a kernel-time profile of eager decode steps at 256 sequences.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check}
mkdir -p "$out"
export HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'triton', triton.__version__)" \
    | tee -a "$out/device.txt"
python -m pytest tests/test_cuda.py tests/test_triton_attention.py tests/test_triton_elementwise.py \
    tests/test_kv_cache_fp8.py -q -x 2>&1 | tee "$out/tests.log"
workload=(--nano-vllm --model benchmarks/qwen3-0.6b --random-weights --peer none)
python bench.py "${workload[@]}" --async-scheduling --kv-cache-dtype auto,fp8 --json "$out/async.json" \
    2>&1 | tee "$out/async.log"
python bench.py "${workload[@]}" --json "$out/sync.json" 2>&1 | tee "$out/sync.log"
python benchmarks/profile_decode.py --model benchmarks/qwen3-0.6b --random-weights --num-seqs 256 \
    2>&1 | tee "$out/profile.log"
