#!/usr/bin/env bash
# Lab (GPU): check and measure what session 5 built without device time left. Run from the
# repository root with the wheels installed (see docs/benchmarks.md), in two device calls, each
# about 4-8 minutes (the per-step timeouts are upper bounds; a command may run 10 minutes at most):
#   STEPS=1,2 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=3,4,5 bash experiments/lab/gpu_checkpoint.sh
# 1. the GPU tests of the kernels (the LoRA epilogue, the in-kernel global scale and layer clamp, the
#    masked q load of decode attention, decode="e4m3");
# 2. rollouts with and without the training adapter under the launchers' flags (session 5's table);
# 3. the LoRA epilogue against the split-K default in a training rollout;
# 4. the persistent small-M kernel (experiments/lab/w4_persistent.py) against the tuned one;
# 5. the small-M kernel that reads the codes as 32-bit words (experiments/lab/w4_wide.py).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_checkpoint}
STEPS=",${STEPS:-1,2,3,4,5},"
step() { [[ "$STEPS" == *",$1,"* ]]; }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
step 1 && timeout 240 python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_decode_attention.py 2>&1 | tail -5 | tee "$OUT/gpu_tests.txt"
export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_dynamic_slice_fusion=true"
step 2 && { timeout 200 python3 experiments/bench_rollout.py --batches=8,64 --new_tokens=1024 \
  --formats=nvfp4_fused,bf16_fused --time_budget_s=150 --out="$OUT/base" > "$OUT/base.log" 2>&1; grep "|\|x$" "$OUT/base.log"; }
step 2 && { timeout 200 python3 experiments/bench_rollout.py --batches=8,64 --new_tokens=1024 --formats=nvfp4_fused \
  --lora_rank=32 --aqn --time_budget_s=150 --out="$OUT/lora" > "$OUT/lora.log" 2>&1; grep "|\|x$" "$OUT/lora.log"; }
step 3 && LORA_VARIANTS=split16,epilogue timeout 180 python3 experiments/lab/lora_variants.py nvfp4_fused:8 nvfp4_fused:64 \
  2>&1 | grep --line-buffered "|" | tee "$OUT/lora_variants.txt"
# 4. the persistent flattened small-M kernel against the tuned one (pipeline fill/drain hypothesis)
step 4 && PERSIST_TIME=1 timeout 200 python3 experiments/lab/w4_persistent.py 2>&1 | grep --line-buffered "check\|M=\|us" \
  | tee "$OUT/persistent.txt"
# 5. the small-M kernel reading codes and scales as 32-bit words (byte-gather hypothesis)
step 5 && WIDE_TIME=1 timeout 200 python3 experiments/lab/w4_wide.py 2>&1 | grep --line-buffered "check\|M=\|us" \
  | tee "$OUT/wide.txt"
