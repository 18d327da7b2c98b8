"""Lab (GPU): device time of the Gluon decode GEMV (pallas_kernels.w4_gluon) against the tuned
Pallas kernel and bf16 jnp.dot, at the 7B shapes, in the JAX harness of sessions 3-6
(labcommon.us_per_call: the kernels of one call summed, rotating weight copies beyond the L2).
Each row is first checked against reference_matmul.

  PYTHONPATH=$PWD python3 experiments/lab/gluon/time_jax.py      # GL_MS=1,8,16,32,64
  GL_MMA_ATOMIC=0 GL_MS=1,8,16 PYTHONPATH=$PWD python3 experiments/lab/gluon/time_jax.py  # partials, not atomics
  GL_VARIANTS="part@1/8:MMA_ATOMIC=0" ...  # extra columns: w4_gluon module settings, each checked first
"""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from labcommon import SHAPES_7B, matmul_cases, us_per_call  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from pallas_kernels import w4_gluon, w4_triton  # noqa: E402

w4_gluon.MMA_ATOMIC = os.environ.get("GL_MMA_ATOMIC", "1") == "1"  # 0: float32 partials (the pre-session-9 build)
MS = [int(v) for v in os.environ.get("GL_MS", "1,8,16,32,64").split(",")]
w4_gluon.TARGET_PROGRAMS = int(os.environ.get("GL_TARGET", w4_gluon.TARGET_PROGRAMS))
VARIANTS = {}  # name -> {w4_gluon attribute: int value}
ONLY = {}  # name -> the M it runs at ("name@16/32:..."), else every M
for spec in filter(None, os.environ.get("GL_VARIANTS", "").split(";")):
  name, _, assigns = spec.partition(":")
  if "@" in name:
    name, ms = name.split("@")
    ONLY[name] = {int(v) for v in ms.split("/")}
  VARIANTS[name] = {a.split("=")[0]: int(a.split("=")[1]) for a in assigns.split(",")}


def with_settings(settings, fn):
  """fn() with w4_gluon's module settings temporarily replaced (they are read at trace time)."""
  old = {a: getattr(w4_gluon, a) for a in settings}
  for a, v in settings.items():
    setattr(w4_gluon, a, v)
  try:
    return fn()
  finally:
    for a, v in old.items():
      setattr(w4_gluon, a, v)


tot = {}
for name, k, n, m, x, q0, qs, dense, ref in matmul_cases(SHAPES_7B, MS):
  y = w4_gluon.forward(x, q0, out_dtype=jnp.float32)
  err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
  assert err < 1e-2 and bool(jnp.isfinite(y).all()), err
  row = {"bf16": us_per_call(lambda x, w: jnp.dot(x, w), x, dense),
         "pallas": us_per_call(lambda x, w: w4_triton.forward(x, w), x, qs),
         "gluon": us_per_call(lambda x, w: w4_gluon.forward(x, w), x, qs)}
  for vname, settings in VARIANTS.items():
    if vname in ONLY and m not in ONLY[vname]:
      row[vname] = row["gluon"]
      continue
    try:
      yv = with_settings(settings, lambda: jax.jit(lambda x, w: w4_gluon.forward(x, w, out_dtype=jnp.float32))(x, q0))
      verr = float(jnp.linalg.norm(yv - ref) / jnp.linalg.norm(ref))
      assert verr < 1e-2 and bool(jnp.isfinite(yv).all()), f"relative error {verr}"
      row[vname] = with_settings(settings, lambda: us_per_call(lambda x, w: w4_gluon.forward(x, w), x, qs))
    except Exception as e:  # a lab variant that fails is reported, not fatal
      print(f"{name} M={m} {vname} FAILED: {str(e)[:300]}", flush=True)
      row[vname] = float("nan")
  for key, v in row.items():
    tot[(m, key)] = tot.get((m, key), 0.0) + v
  gbs = (k * n * 9 / 16) / row["gluon"] / 1e3
  print(f"{name:8s} M={m:2d} err {err:.1e} | " + " | ".join(f"{key} {v:6.1f}" for key, v in row.items())
        + f" | gluon {gbs:5.0f} GB/s, {row['bf16'] / row['gluon']:.2f}x bf16", flush=True)
print("\nsummed over the four 7B shapes (µs):")
for m in MS:
  b, p, g = tot[(m, "bf16")], tot[(m, "pallas")], tot[(m, "gluon")]
  extra = "".join(f" | {v} {tot[(m, v)]:6.1f} ({b / tot[(m, v)]:.2f}x)" for v in VARIANTS)
  print(f"M={m:2d} bf16 {b:6.1f} | pallas {p:6.1f} | gluon {g:6.1f} | gluon/bf16 {b / g:.2f}x | gluon/pallas {p / g:.2f}x"
        + extra, flush=True)
