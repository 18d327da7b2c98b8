"""Lab (GPU): what limits the warp-specialized M <= 16 build (w4_gluon.WS_STAGES), and so the decode GEMV?

Device time (µs) at the 7B gate and down shapes, weights rotated beyond the L2 (labcommon.us_per_call), of:
  default      the library's build (register loads one step ahead);
  ws           WS_STAGES buffers, a loader warp;
  ws_compute   the same with WS_PROBE = 1: the loader re-reads split 0's first two steps (L2-resident), so the time
               is what the compute warps take when the weight arrives at once;
  ws_loads     WS_PROBE = 2: the compute warps take and release each buffer without decoding or multiplying, so the
               time is what the loader's TMA stream takes alone.
The probes' outputs are wrong by design; the plain ``ws`` build is checked against the reference first.

  GL_MS=1,8 WS_LIST=2,4 PYTHONPATH=$PWD python3 experiments/lab/gluon/ws_probe.py
"""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from labcommon import SHAPES_7B, matmul_cases, us_per_call  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from pallas_kernels import w4_gluon  # noqa: E402

MS = [int(v) for v in os.environ.get("GL_MS", "1,8").split(",")]
STAGES = [int(v) for v in os.environ.get("WS_LIST", "2,4").split(",")]
shapes = {k: v for k, v in SHAPES_7B.items() if k in ("7b_gate", "7b_down")}


def timed(settings, x, qs):
  old = {a: getattr(w4_gluon, a) for a in settings}
  try:
    for a, v in settings.items():
      setattr(w4_gluon, a, v)
    return us_per_call(lambda x, w: w4_gluon.forward(x, w), x, qs)
  finally:
    for a, v in old.items():
      setattr(w4_gluon, a, v)


for name, k, n, m, x, q0, qs, dense, ref in matmul_cases(shapes, MS):
  row = {"default": timed({}, x, qs)}
  for st in STAGES:
    w4_gluon.WS_STAGES = st
    y = jax.jit(lambda x, w: w4_gluon.forward(x, w, out_dtype=jnp.float32))(x, q0)
    w4_gluon.WS_STAGES = 0
    err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
    assert err < 1e-2, err
    row[f"ws{st}"] = timed({"WS_STAGES": st}, x, qs)
    row[f"ws{st}_compute"] = timed({"WS_STAGES": st, "WS_PROBE": 1}, x, qs)
    row[f"ws{st}_loads"] = timed({"WS_STAGES": st, "WS_PROBE": 2}, x, qs)
  gb = k * n * 9 / 16 / 1e3
  print(f"{name:8s} M={m:2d} " + " | ".join(f"{key} {v:5.1f} ({gb / v:4.0f} GB/s)" for key, v in row.items()),
        flush=True)
