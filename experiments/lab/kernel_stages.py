"""Lab: leave-one-stage-out timing of the fused forward kernel (GPU only).

Device time per call (median over a jax.profiler trace of 8+ calls on rotating weight copies)
of ``w4_triton.forward`` with its decode step swapped out: as tuned (inline-PTX decode), the
jnp bit-trick decode, a 3-D scale multiply, no block scale, and no decode at all (codes cast to
bf16). The last two give wrong numbers on purpose: they bound what decoding costs.

  PYTHONPATH=$PWD python3 experiments/lab/kernel_stages.py
"""
import collections, dataclasses, glob, gzip, json, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "experiments"))
import jax, jax.numpy as jnp, numpy as np
import devtime
from jax import lax
from pallas_kernels import w4_triton
from pallas_kernels.matmul import reference_matmul
from qerl_jax import nvfp4
ORIG = w4_triton._decode_tile

def no_scale(p, s, fmt, dtype, **kw):
  return _noscale(p, dtype)

def _noscale(p, dtype):
  p16 = p.astype(jnp.uint16)
  lo = ((p16 & 7) << 9) | ((p16 & 8) << 12)
  hi = ((p16 & 0x70) << 5) | ((p16 & 0x80) << 8)
  return lax.bitcast_convert_type(lo, jnp.float16).astype(dtype), lax.bitcast_convert_type(hi, jnp.float16).astype(dtype)

def no_decode(p, s, fmt, dtype, **kw):
  return p.astype(dtype), (p >> 4).astype(dtype)

def scale3d(p, s, fmt, dtype, *, decode="bits", multiplier=None):
  rows, cols = p.shape
  lo, hi = _noscale(p, jnp.float32)
  s = s.astype(jnp.float32) * 16384.0
  g = s.shape[0]
  lo = (lo.reshape(g, rows // g, cols) * s[:, None, :]).reshape(rows, cols)
  hi = (hi.reshape(g, rows // g, cols) * s[:, None, :]).reshape(rows, cols)
  return lo.astype(dtype), hi.astype(dtype)

VARIANTS = {"asis": ORIG, "bits": None, "scale3d": scale3d, "noscale": no_scale, "nodecode": no_decode}

def device_us(fn, args, d=None):
  """Median device time (µs) of the fused forward kernels in one traced call."""
  durs = devtime.trace_durations(fn, *args)
  return float(np.median([t for name, ts in durs.items() if name.startswith("w4a16_fwd") for t in ts]))

out = os.environ.get("OUT", "/tmp")
for name, (k, n) in {"7b_gate": (3584, 18944), "7b_down": (18944, 3584), "7b_qkv": (3584, 4608)}.items():
  w = jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02
  q0 = nvfp4.quantize(w)
  r = max(2, -(-(256 << 20) // (k * n // 2)))
  qs = [jax.tree.map(lambda a, i=i: a ^ jnp.uint8(i % 2) if a.dtype == jnp.uint8 else a, q0) for i in range(r)]
  for m in (1, 8):
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
    ref = reference_matmul(x, q0, out_dtype=jnp.float32)
    base = w4_triton.default_config(m, k, n)
    line = []
    for vname, fn in VARIANTS.items():
      cfg = dataclasses.replace(base, decode="bits") if vname != "asis" else base
      w4_triton._decode_tile = fn or ORIG
      try:
        y = w4_triton.forward(x, q0, config=cfg, out_dtype=jnp.float32)
        err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
        us = device_us(jax.jit(lambda x, qs, cfg=cfg: [w4_triton.forward(x, q, config=cfg) for q in qs]), (x, qs),
                            os.path.join(out, f"t_{name}_{m}_{vname}"))
        line.append(f"{vname} {us:6.1f}us ({(k*n*9/16)/us/1e3:5.0f} GB/s, err {err:.0e})")
      except Exception as e:
        line.append(f"{vname} FAIL {repr(e)[:120]}")
      finally:
        w4_triton._decode_tile = ORIG
    print(f"{name} M={m} cfg=({base.block_m},{base.block_n},{base.block_k},s{base.splits},{base.decode}): " + " | ".join(line), flush=True)
