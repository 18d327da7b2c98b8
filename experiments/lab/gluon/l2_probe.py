"""Lab (GPU): how long the library's register-load builds of the Gluon GEMV take when their weight stream is
L2-resident (w4_gluon.L2_PROBE: every split of a column tile reads split 0's codes and scales), against the
same builds reading HBM. If the two times match, the kernel is bound inside its programs (decode, MMA, the
chain between them), not by HBM; the gap is what the weight stream costs. The probe's outputs are wrong by
design; the default build is checked against the reference first.

Device time (µs, labcommon.us_per_call: weights rotated beyond the L2) at the 7B shapes.

  GL_MS=1,8,64 PYTHONPATH=$PWD python3 experiments/lab/gluon/l2_probe.py
  GL_SHAPES=7b_gate,7b_down ...     # a subset of labcommon.SHAPES_7B
"""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from labcommon import SHAPES_7B, matmul_cases, us_per_call  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from pallas_kernels import w4_gluon  # noqa: E402

MS = [int(v) for v in os.environ.get("GL_MS", "1,8,64").split(",")]
NAMES = os.environ.get("GL_SHAPES", "")
shapes = {k: v for k, v in SHAPES_7B.items() if not NAMES or k in NAMES.split(",")}


def timed(probe, x, qs):
  w4_gluon.L2_PROBE = probe
  try:
    return us_per_call(lambda x, w: w4_gluon.forward(x, w), x, qs)
  finally:
    w4_gluon.L2_PROBE = 0


for name, k, n, m, x, q0, qs, dense, ref in matmul_cases(shapes, MS):
  y = jax.jit(lambda x, w: w4_gluon.forward(x, w, out_dtype=jnp.float32))(x, q0)
  err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
  assert err < 1e-2, err
  hbm, l2 = timed(0, x, qs), timed(1, x, qs)
  b = w4_gluon._build(m, k, n, 1, q0.code_order == "decode")
  print(f"{name:8s} M={m:3d} grid {b.grid} | HBM {hbm:6.1f} µs ({k * n * 9 / 16 / 1e3 / hbm:5.0f} GB/s) | "
        f"L2-resident {l2:6.1f} µs | L2 / HBM {l2 / hbm:.2f}", flush=True)
