#!/usr/bin/env bash
# Lab (GPU, sm_90a): how close does CUTLASS's own Hopper mixed-input GEMM (int4 x bf16, the narrow weight converted
# in registers, warp-specialized TMA pipeline; example 55_hopper_int4_bf16_gemm of CUTLASS 4.2) come to bf16 at
# issue 4's large-M shapes? Session 45: 0.92-0.94x at M = 2048 with a 128 x 256 tile and group scales (7B shapes,
# H100), where dequantize + cuBLAS reads 0.85x. NVFP4 would need a block scale every 16 values, which CUTLASS's
# mixed-input mainloop does not take (its group size must be K or a multiple of the tile's K).
#
# 1. Build on the CPU machine (nvcc 13.0; headers from the nvidia-cutlass 4.2.0.0 and nvidia-curand 10.4.5.25 wheels,
#    unpacked into the ignored .cutlass/; about 1.5 minutes a binary on 2 cores):
#      CUTLASS_BUILD=1 bash experiments/lab/cutlass_mixed_ceiling.sh
#    It builds bin/ex55_int4_bf16 (the example as shipped) and copies with the TileShape or ClusterShape line edited:
#    ex55_t128x256, ex55_t256x128, ex55_c2 (a 2 x 1 cluster).
# 2. Carry .cutlass (and .whl for the bf16 column) and run on the GPU:
#      CUTLASS_BINS="ex55_int4_bf16 ex55_t128x256" CUTLASS_MS="2048 8192" bash experiments/lab/cutlass_mixed_ceiling.sh
#    CUTLASS_MODEL=32b: the 32B shapes. The last lines are bf16 jnp.dot at the same shapes (mgpu_mixed_large_m.py).
set -u
if [ "${CUTLASS_BUILD:-0}" = 1 ]; then
  set -e
  W=$(mktemp -d)
  python3 -m pip download -q --no-deps -d "$W" nvidia-cutlass==4.2.0.0 nvidia-curand==10.4.5.25 2>&1 | grep -v "^WARNING" || true
  rm -rf .cutlass && mkdir -p .cutlass/bin "$W/x"
  (cd "$W/x" && unzip -q "$W"/nvidia_cutlass-*.whl 'cutlass_library/source/include/*' 'cutlass_library/source/tools/util/include/*' \
     'cutlass_library/source/examples/55_hopper_mixed_dtype_gemm/*' 'cutlass_library/source/examples/common/*' \
   && unzip -q "$W"/nvidia_curand-*.whl 'nvidia/*/include/*')
  cp -r "$W/x/cutlass_library/source/." .cutlass/
  CURAND=$(dirname "$(find "$W/x/nvidia" -name curand_kernel.h | head -1)")
  E=examples/55_hopper_mixed_dtype_gemm
  base='using TileShape           = Shape<_128,_128,cute::Int<TileShapeK>>;'
  cp .cutlass/$E/55_hopper_int4_bf16_gemm.cu .cutlass/$E/v_int4_bf16.cu
  sed "s/$base/using TileShape = Shape<_128,_256,cute::Int<TileShapeK>>;/" .cutlass/$E/v_int4_bf16.cu > .cutlass/$E/v_t128x256.cu
  sed "s/$base/using TileShape = Shape<_256,_128,cute::Int<TileShapeK>>;/" .cutlass/$E/v_int4_bf16.cu > .cutlass/$E/v_t256x128.cu
  sed 's/using ClusterShape        = Shape<_1,_1,_1>;/using ClusterShape = Shape<_2,_1,_1>;/' .cutlass/$E/v_int4_bf16.cu > .cutlass/$E/v_c2.cu
  for v in int4_bf16 t128x256 t256x128 c2; do
    if [ $v != int4_bf16 ] && cmp -s .cutlass/$E/v_int4_bf16.cu .cutlass/$E/v_$v.cu; then
      echo "ex55_$v: the example's TileShape / ClusterShape line was not found (another CUTLASS version?)" >&2; exit 1
    fi
    (cd .cutlass && nvcc -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
       -I include -I tools/util/include -I "$CURAND" -I examples/common -I $E -o bin/ex55_$v $E/v_$v.cu 2>/dev/null) \
      && echo "built .cutlass/bin/ex55_$v"
  done
  rm -rf "$W"
  exit 0
fi
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
