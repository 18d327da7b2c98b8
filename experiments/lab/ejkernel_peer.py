"""Lab: ejkernel's NVFP4 `quantized_matmul` as a peer of our fused kernel (issue 4's peer column).

ejkernel (https://github.com/erfanzar/ejkernel, a JAX + Triton kernel library) is not on the GPU
image. Its latest wheel (0.0.80.3) pins jax ~= 0.10 and calls `jax.core.concrete_or_error`, which
jax 0.11 removed; with --no-deps and the one-line alias below it runs on jax 0.11.2 (its XLA path
checked on the CPU in session 3; its Triton path not yet run). Its weights use its own packing
(uint32 codes), so each
side quantizes the same float weight with its own quantizer. Each ejkernel call is checked against
ejkernel's own dequantize-then-dot path (fuse=False) before it is timed; our kernel is checked
against `reference_matmul`. Device time as the other lab scripts (experiments/lab/labcommon.py).

On the GPU machine (carry `.whl-ejk`: ejkernel plus beartype, einops, jaxtyping, wadler_lindig,
pydantic, pydantic_core, annotated_types, typing_inspection, typing_extensions, fetched with
`pip download --no-deps --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64
-d .whl-ejk ejkernel==0.0.80.3 ...`; chex and triton are on the image):

  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl-ejk/*.whl
  export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_dynamic_slice_fusion=true"  # bf16: cuBLAS
  PYTHONPATH=$PWD:/tmp/site python3 experiments/lab/ejkernel_peer.py

EJK_PLATFORM=xla EJK_SHAPES=tiny runs the API check on a CPU.
"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax, jax.numpy as jnp
import jax.extend.core
if not hasattr(jax.core, "concrete_or_error"):  # removed in jax 0.11; ejkernel 0.0.80.3 still calls it
  jax.core.concrete_or_error = jax.extend.core.concrete_or_error
from ejkernel.modules import quantized_matmul as ejk_qmm
from ejkernel.quantization import quantize as ejk_quantize
from labcommon import SHAPES_7B, activations, checked_error, rotating_weights, us_per_call
from pallas_kernels import quantized_matmul

PLATFORM = os.environ.get("EJK_PLATFORM", "triton")
TINY = os.environ.get("EJK_SHAPES") == "tiny"
SHAPES = {"tiny": (256, 128)} if TINY else SHAPES_7B
MS = (1, 8) if TINY else (1, 8, 32, 64, 128)


def ours_call(x, w, out_dtype=jnp.float32, poison_output=False):
  """The library's entry point (the Gluon kernel at M <= 128 on an H200; it has no poisoned-output
  mode), float32 out."""
  return quantized_matmul(x, w, out_dtype=out_dtype)


def ejk_weights(k, n, copies):
  """ejkernel NVFP4 (codes, scales) of a [k, n] weight (x @ W), and rotating copies of it.

  ejkernel's quantize with axis "row" stores the [k, n] weight as codes [n, k/8] (uint32) with
  NVFP4 blocks along K, which its matmul reads with transpose=True (x @ dequantize(w).T).
  """
  w = jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02
  wq, s = ejk_quantize(w, mode="nvfp4", axis="row")
  return (wq, s), [(wq ^ jnp.uint32(i % 2), s) for i in range(copies)]


def ejk_call(x, ws, fuse=True):
  wq, s = ws
  return ejk_qmm(x, wq, s, mode="nvfp4", transpose=True, fuse=fuse, platform=PLATFORM if fuse else "xla")


for name, (k, n) in SHAPES.items():
  q0, qs = rotating_weights(k, n, min_mb=0 if TINY else 256)
  e0, es = ejk_weights(k, n, len(qs))
  for m in MS:
    x = activations(m, k)
    ref = ejk_call(x, e0, fuse=False).astype(jnp.float32)
    got = ejk_call(x, e0).astype(jnp.float32)
    ejk_err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
    line = [f"ejkernel err {ejk_err:.1e}"]
    if not TINY:
      ours_err = checked_error(ours_call, x, q0)
      ours = us_per_call(ours_call, x, qs)
      theirs = us_per_call(ejk_call, x, es)
      copies = max(2, -(-256 * 2**20 // (k * n * 2)))  # bf16 copies beyond the 60 MB L2
      bf16 = us_per_call(jnp.dot, x, [jnp.full((k, n), i, jnp.bfloat16) for i in range(copies)])
      line += [f"ours {ours:6.1f} us (err {ours_err:.1e})", f"ejkernel {theirs:6.1f} us", f"bf16 {bf16:6.1f} us"]
    print(f"{name:8s} M={m:3d}: " + " | ".join(line), flush=True)
