#!/usr/bin/env bash
# Lab (GPU, sm_90a): how close does CUTLASS's own Hopper mixed-input GEMM (int4 x bf16, the narrow weight converted
# in registers, warp-specialized TMA pipeline; example 55_hopper_int4_bf16_gemm of CUTLASS 4.2) come to bf16 at
# issue 4's large-M shapes? A ceiling for a fused W4A16 kernel at M >= 2048 (NVFP4 needs more decode work per weight
# and a block scale every 16 values, which CUTLASS's mixed-input mainloop does not take: its group size must be K or a
# multiple of the tile's K).
#
# Build here (nvcc 13.0; CUTLASS's headers from the nvidia-cutlass 4.2.0.0 wheel, cuRAND's from nvidia-curand
# 10.4.5.25, both unpacked by hand into an ignored .cutlass/ and /tmp/curand), then carry .cutlass:
#   nvcc -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
#     -I include -I tools/util/include -I <curand>/include -I examples/common -I examples/55_hopper_mixed_dtype_gemm \
#     -o bin/ex55_int4_bf16 examples/55_hopper_mixed_dtype_gemm/55_hopper_int4_bf16_gemm.cu     # (in .cutlass/)
#   CUTLASS_MS=2048 bash experiments/lab/cutlass_mixed_ceiling.sh
# Other tiles (session 45): copies of the example with its TileShape or ClusterShape line edited (sed), built the same
# way as bin/ex55_<name>, run with CUTLASS_BINS="ex55_int4_bf16 ex55_t128x256 ...". CUTLASS_MODEL=32b: the 32B shapes.
set -u
for BIN in ${CUTLASS_BINS:-ex55_int4_bf16}; do
echo "== $BIN"
BIN=.cutlass/bin/$BIN
for m in ${CUTLASS_MS:-2048}; do
  if [ "${CUTLASS_MODEL:-7b}" = 32b ]; then SHAPES=("qkv 7168 5120" "o 5120 5120" "gate 27648 5120" "down 5120 27648")
  else SHAPES=("qkv 4608 3584" "o 3584 3584" "gate 18944 3584" "down 3584 18944"); fi
  for nk in "${SHAPES[@]}"; do
    set -- $nk
    for mode in "0 --g=$3" "1 --g=128"; do
      mo=${mode%% *}; g=${mode#* }
      out=$($BIN --m=$m --n=$2 --k=$3 $g --mode=$mo --iterations=50 --warmup=10 2>&1)
      echo "$1 M=$m mode=$mo $g: $(echo "$out" | grep -E "Disposition|Avg runtime|GFLOPS" | tr '\n' ' ')"
    done
  done
done
done
MIX_MODEL=${CUTLASS_MODEL:-7b} MIX_BF16_ONLY=1 MIX_MS=$(echo ${CUTLASS_MS:-2048} | tr ' ' ',') python3 experiments/lab/mgpu_mixed_large_m.py 2>&1 | grep -v -i warn
