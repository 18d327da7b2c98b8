#!/bin/bash
# Lab (GPU, session 19): programmatic dependent launch in a batch-8 rollout.
#   1. does this XLA know the flags (strings of the installed jaxlib / CUDA plugin);
#   2. bench_rollout A/B at batch 8: XLA's --xla_gpu_enable_pdl off/on x the Gluon kernel's PDL build off/on;
#   3. the Gluon GPU tests with the PDL build (eager launches: PDL on a plain stream, where a missing wait races).
# Usage: bash experiments/lab/pdl_ab.sh [new_tokens]   (PYTHONPATH must hold the repo and the wheels)
NEW=${1:-512}
SP=$(python3 -c "import jax,os; print(os.path.dirname(os.path.dirname(jax.__file__)))")
echo "== 1. flags in the installed XLA"
for f in $(find $SP -name "*.so" -size +20M 2>/dev/null | grep -i -E "jax|xla"); do
  echo "-- $f"; strings -n 6 $f | grep -E "uses_pdl|xla_gpu_enable_pdl|pdl_launch" | sort -u | head -8
done
BASE="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_dynamic_slice_fusion=true"
echo "== 2. rollout A/B, batch 8, $NEW new tokens"
for xp in false true; do
  for gp in 0 1; do
    echo "-- xla_gpu_enable_pdl=$xp, w4_gluon.PDL=$gp"
    XLA_FLAGS="$BASE --xla_gpu_enable_pdl=$xp" GL_SET="PDL=$gp" timeout 150 python3 experiments/lab/gluon/ab_rollout.py \
      --batches=8 --new_tokens=$NEW --formats=nvfp4_fused 2>&1 | grep -E "^\| nvfp4|PDL|rror" | tail -4
  done
  echo "-- xla_gpu_enable_pdl=$xp, bf16"
  XLA_FLAGS="$BASE --xla_gpu_enable_pdl=$xp" timeout 120 python3 experiments/bench_rollout.py \
      --batches=8 --new_tokens=$NEW --formats=bf16_fused 2>&1 | grep -E "^\| bf16|rror" | tail -3
done
echo "== 3. Gluon GPU tests with the PDL build"
XLA_FLAGS="$BASE" QERL_GLUON_PDL=1 timeout 200 python3 -m pytest -q -x -m gpu tests/test_gluon.py \
   -k "matches_float64 or forward_into or one_buffer or routes or clamped" 2>&1 | tail -5
