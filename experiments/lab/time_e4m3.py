"""Lab (GPU): the forward kernel with ``decode="e4m3"`` (E2M1 -> E4M3 bytes -> float16 by Hopper's
``cvt.rn.f16x2.e4m3x2``, float16 tensor-core operands) against the tuned ``decode="asm"`` kernel, same
tiles, at the 7B shapes. Offline SASS (experiments/lab/offline_sass.py) counts 4.70 vs 5.83
instructions per weight value at M <= 16, 5.20 vs 6.38 at M = 32, 6.22 vs 6.72 at M = 64.

First every variant is checked against ``reference_matmul`` on a NaN-poisoned output (relative error
< 1e-2, all finite), at the 7B shapes and at ragged ones; then device time per call
(``labcommon.us_per_call``, rotating weight copies beyond the L2). Stops timing after E4M3_BUDGET_S.

  PYTHONPATH=$PWD python3 experiments/lab/time_e4m3.py
"""
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from labcommon import SHAPES_7B, activations, checked_error, rotating_weights, us_per_call  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from pallas_kernels import w4_triton  # noqa: E402
from qerl_jax import nvfp4  # noqa: E402

T0 = time.time()
BUDGET = float(os.environ.get("E4M3_BUDGET_S", "150"))
MS = [int(v) for v in os.environ.get("E4M3_MS", "1,8,32,64").split(",")]


def fwd(decode):
  def f(x, w, cfg_m=None, **kw):
    cfg = w4_triton.default_config(x.shape[0], *w.shape)
    return w4_triton.forward(x, w, config=dataclasses.replace(cfg, decode=decode), **kw)
  return f


for m, k, n in [(3, 1040, 200), (17, 3584, 1000), (1, 18944, 3584), (64, 3584, 4608), (100, 1040, 4100)]:
  q = nvfp4.quantize(jax.random.normal(jax.random.key(m + n), (k, n), jnp.float32) * 0.02)
  x = activations(m, k) * 30  # activations beyond float16's fine range after the 2**-4 scale, too
  print(f"ragged M={m} K={k} N={n}: asm rel err {checked_error(fwd('asm'), x, q):.2e}, "
        f"e4m3 rel err {checked_error(fwd('e4m3'), x, q):.2e}", flush=True)

totals = {}
for name, (k, n) in SHAPES_7B.items():
  q0, qs = rotating_weights(k, n)
  for m in MS:
    if time.time() - T0 > BUDGET:
      break
    x = activations(m, k)
    errs = {d: checked_error(fwd(d), x, q0) for d in ("asm", "e4m3")}
    row = {d: us_per_call(lambda x, w, d=d: fwd(d)(x, w, out_dtype=jnp.float32), x, qs) for d in ("asm", "e4m3")}
    for d, v in row.items():
      totals[(m, d)] = totals.get((m, d), 0.0) + v
    print(f"{name:8s} M={m:2d} asm {row['asm']:6.1f} us | e4m3 {row['e4m3']:6.1f} us "
          f"({row['asm'] / row['e4m3']:.2f}x) | rel err {errs['asm']:.1e} / {errs['e4m3']:.1e}", flush=True)
print("\nsummed over the 7B shapes timed (µs):")
for m in MS:
  if (m, "asm") in totals:
    print(f"M={m:2d} asm {totals[(m, 'asm')]:6.1f} | e4m3 {totals[(m, 'e4m3')]:6.1f} "
          f"({totals[(m, 'asm')] / totals[(m, 'e4m3')]:.2f}x)", flush=True)
