"""Lab (GPU): device time of the Gluon decode GEMV (pallas_kernels.w4_gluon) against the tuned
Pallas kernel and bf16 jnp.dot, at the 7B shapes, in the JAX harness of sessions 3-6
(labcommon.us_per_call: the kernels of one call summed, rotating weight copies beyond the L2).
Each row is first checked against reference_matmul.

  PYTHONPATH=$PWD python3 experiments/lab/gluon/time_jax.py      # GL_MS=1,8,16,32,64
  GL_MMA_ATOMIC=1 GL_MS=1,8,16 PYTHONPATH=$PWD python3 experiments/lab/gluon/time_jax.py  # w4_gluon.MMA_ATOMIC
"""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from labcommon import SHAPES_7B, activations, rotating_weights, us_per_call  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from pallas_kernels import reference_matmul, w4_gluon, w4_triton  # noqa: E402

w4_gluon.MMA_ATOMIC = os.environ.get("GL_MMA_ATOMIC", "0") == "1"  # the prepared atomic mma.sync build
MS = [int(v) for v in os.environ.get("GL_MS", "1,8,16,32,64").split(",")]
w4_gluon.TARGET_PROGRAMS = int(os.environ.get("GL_TARGET", w4_gluon.TARGET_PROGRAMS))
tot = {}
for name, (k, n) in SHAPES_7B.items():
  q0, qs = rotating_weights(k, n)
  dense = [jax.random.normal(jax.random.key(i), (k, n), jnp.bfloat16) for i in range(max(2, (512 << 20) // (k * n * 2)))]
  for m in MS:
    x = activations(m, k)
    ref = reference_matmul(x, q0, out_dtype=jnp.float32)
    y = w4_gluon.forward(x, q0, out_dtype=jnp.float32)
    err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
    assert err < 1e-2 and bool(jnp.isfinite(y).all()), err
    row = {"bf16": us_per_call(lambda x, w: jnp.dot(x, w), x, dense),
           "pallas": us_per_call(lambda x, w: w4_triton.forward(x, w), x, qs),
           "gluon": us_per_call(lambda x, w: w4_gluon.forward(x, w), x, qs)}
    for key, v in row.items():
      tot[(m, key)] = tot.get((m, key), 0.0) + v
    gbs = (k * n * 9 / 16) / row["gluon"] / 1e3
    print(f"{name:8s} M={m:2d} err {err:.1e} | " + " | ".join(f"{key} {v:6.1f}" for key, v in row.items())
          + f" | gluon {gbs:5.0f} GB/s, {row['bf16'] / row['gluon']:.2f}x bf16", flush=True)
print("\nsummed over the four 7B shapes (µs):")
for m in MS:
  b, p, g = tot[(m, "bf16")], tot[(m, "pallas")], tot[(m, "gluon")]
  print(f"M={m:2d} bf16 {b:6.1f} | pallas {p:6.1f} | gluon {g:6.1f} | gluon/bf16 {b / g:.2f}x | gluon/pallas {p / g:.2f}x", flush=True)
