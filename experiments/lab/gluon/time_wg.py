"""Lab (GPU): the lab's wgmma variants (w4_gluon_wg.py: row block, row chunks, asynchronous MMAs,
fewer split-K programs, split-K summed by float32 atomics) against the library's default path and
bf16, at the 7B shapes and M = 32-256 (rows checked against reference_matmul).

  PYTHONPATH=$PWD python3 experiments/lab/gluon/time_wg.py      # WG_MS=8,32,64
"""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from labcommon import SHAPES_7B, activations, rotating_weights, us_per_call  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from pallas_kernels import matmul, reference_matmul, w4_gluon  # noqa: E402
import w4_gluon_wg as wg  # noqa: E402

MS = [int(v) for v in os.environ.get("WG_MS", "8,32,64").split(",")]
variants = {
    "bf16": None,
    "library": lambda x, w: matmul.kernel_forward(x, w),  # Gluon at M <= 32, Pallas at 33-64, default settings
    "wg": lambda x, w: wg.forward(x, w, warps=8),
    "wgA": lambda x, w: wg.forward(x, w, warps=8, atomic=True),
    "wgA_t1024": lambda x, w: wg.forward(x, w, warps=8, atomic=True, target=1024),
    "wgA_t256": lambda x, w: wg.forward(x, w, warps=8, atomic=True, target=256),
    "wgA_async": lambda x, w: wg.forward(x, w, warps=8, atomic=True, is_async=True),
    "wgA_mb32": lambda x, w: wg.forward(x, w, mb=32, warps=8, atomic=True),
}
tot = {}
for name, (k, n) in SHAPES_7B.items():
  q0, qs = rotating_weights(k, n)
  dense = [jax.random.normal(jax.random.key(i), (k, n), jnp.bfloat16) for i in range(max(2, (512 << 20) // (k * n * 2)))]
  for m in MS:
    x = activations(m, k)
    ref = reference_matmul(x, q0, out_dtype=jnp.float32)
    row, errs = {}, []
    for key, fn in variants.items():
      if fn is None:
        row[key] = us_per_call(lambda x, w: jnp.dot(x, w), x, dense)
        continue
      try:
        y = fn(x, q0).astype(jnp.float32)
        err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
        ok = err < 1e-2 and bool(jnp.isfinite(y).all())
        errs.append(f"{key} {err:.0e}")
        row[key] = us_per_call(fn, x, qs) if ok else float("nan")
      except Exception as e:  # noqa: BLE001 (a lab variant that fails to build is reported, not fatal)
        print(f"{key}: {type(e).__name__}: {str(e)[-300:]}", flush=True)
        row[key] = float("nan")
    for key, v in row.items():
      tot[(m, key)] = tot.get((m, key), 0.0) + v
    print(f"{name:8s} M={m:2d} | " + " | ".join(f"{key} {v:6.1f}" for key, v in row.items()) + " | " + ", ".join(errs),
          flush=True)
print("\nsummed over the four 7B shapes (µs):")
for m in MS:
  b = tot[(m, "bf16")]
  print(f"M={m:2d} " + " | ".join(f"{key} {tot[(m, key)]:6.1f} ({b / tot[(m, key)]:.2f}x)" for key in variants), flush=True)
