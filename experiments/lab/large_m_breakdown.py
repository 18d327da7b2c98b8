"""Lab (GPU): the large-M path's kernels one by one (device time, µs) at the 7B gate and 32B down shapes, M = 2048
and 8192: bf16 GEMMs with a bf16 and a float32-then-cast result, the library's forward and dx (matmul.kernel_forward,
kernel_dx), and the dequantize kernel alone. Session 31 found the float32 result's conversion pass with it.

  XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_dynamic_slice_fusion=true" \
      PYTHONPATH=$PWD python3 experiments/lab/large_m_breakdown.py
"""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
from labcommon import activations  # noqa: E402
import devtime  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from pallas_kernels import matmul, w4_triton  # noqa: E402
from qerl_jax import nvfp4  # noqa: E402

for name, (k, n) in {"7b_gate": (3584, 18944), "32b_down": (27648, 5120)}.items():
  w = nvfp4.to_decode_order(nvfp4.quantize(jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02))
  dense = jax.random.normal(jax.random.key(1), (k, n), jnp.bfloat16)
  for m in (2048, 8192):
    x, dy = activations(m, k), activations(m + 1, n)
    cases = {"bf16": (lambda x, d: jnp.dot(x, d), x, dense),
             "bf16, float32 then cast": (
                 lambda x, d: jnp.dot(x, d, preferred_element_type=jnp.float32).astype(jnp.bfloat16), x, dense),
             "library forward": (lambda x, w: matmul.kernel_forward(x, w), x, w),
             "dequantize alone": (lambda x, w: w4_triton.dequantize(w, x.dtype), x, w),
             "library dx (M + 1 rows)": (lambda d, w: matmul.kernel_dx(d, w), dy, w)}
    for key, (f, a, b) in cases.items():
      jf = jax.jit(f)
      jax.block_until_ready(jf(a, b))
      d = devtime.trace_durations(jf, a, b)
      top = sorted(d.items(), key=lambda t: -sum(t[1]))[:4]
      print(f"{name} M={m} {key:24s} {sum(sum(v) for v in d.values()):8.1f} µs: "
            + "; ".join(f"{kk[:40]} {sum(v):.1f}" for kk, v in top), flush=True)
