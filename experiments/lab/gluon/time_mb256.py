"""Lab (GPU): a 256-row build of the Gluon kernel for decode steps of 129-256 rows (batch-256 rollouts).

Today M = 129-256 runs dequantize + cuBLAS: each decode step writes every layer's bf16 weight to HBM
and reads it back (about 4.6 bytes moved a weight against bf16's 2). The narrow wgmma build at
MB = 128 reads the 4-bit codes once but is bound by its decode and load chain, not by bytes. A build
of MB = 256 (wgmma N = 256: the batch is the MMA's N in swap-AB) decodes each weight once for 256
rows. It needs 214 registers (uncapped; one program of 8 warps an SM) and a 128 KB x ring.

Columns, µs of device time per call at the 7B shapes (fused gate/up too), M = 256 unless ``MB_MS``:
  bf16         jnp.dot, cuBLAS (the launchers' XLA flags)
  today        pallas_kernels.quantized_matmul: dequantize + cuBLAS
  halves       the MB = 128 Gluon build twice (rows 0-127, 128-255)
  mb256_leS    the MB = 256 build with at most S K steps a program (fewest splits; split-K by atomics)
Each variant is first checked against the XLA reference (relative error < 1e-2, finite).

  XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_dynamic_slice_fusion=true" \
    PYTHONPATH=$PWD python3 experiments/lab/gluon/time_mb256.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from labcommon import SHAPES_7B, matmul_cases, us_per_call  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_kernels  # noqa: E402
from pallas_kernels import w4_gluon  # noqa: E402

MS = [int(v) for v in os.environ.get("MB_MS", "256").split(",")]
MAX_STEPS = [int(v) for v in os.environ.get("MB_STEPS", "8,28,56").split(",")]
SHAPES = dict(SHAPES_7B, **{"7b_gateup": (3584, 37888)})


def mb256_build(m, k, n, max_steps):
  """The narrow wgmma build (128 columns a program, x ring) at MB = 256, fewest splits with at most
  ``max_steps`` K steps a program; None if no divisor fits."""
  total = k // w4_gluon.BLOCK_K
  options = [s for s in range(1, total + 1) if total % s == 0 and total // s <= max_steps]
  if not options:
    return None
  splits = min(options)
  meta = dict(M=m, N=n, K=k, L=1, STEPS=total // splits, MB=256, ATOMIC=splits > 1, XS=4, WA=0)
  return w4_gluon.Build(True, True, 128, splits, meta)


def mb256_forward(build):
  def fwd(x, w):
    ptx, name, shared = w4_gluon._load(w4_gluon._compile_gluon(
        w4_gluon._kernel(True, 128), w4_gluon._ARG_DTYPES, build.meta, w4_gluon._target_cc(), num_warps=8))
    atomic = build.meta["ATOMIC"]
    operands = w4_gluon._operands(x, w, None, build.meta, jnp.zeros((1,), jnp.float32))
    out = jax.ffi.ffi_call(w4_gluon._FFI_TARGET, jax.ShapeDtypeStruct(x.shape[:1] + (w.shape[1],), jnp.float32))(
        *operands, **w4_gluon._launch_attrs(ptx, name, build.grid, shared, threads=256, zero_results=atomic))
    return out.astype(jnp.bfloat16)
  return fwd


def halves(x, w):
  return jnp.concatenate([w4_gluon.forward(x[:128], w), w4_gluon.forward(x[128:], w)])


tot = {}
for name, k, n, m, x, q0, qs, dense, ref in matmul_cases(SHAPES, MS):
  variants = {"today": lambda x, w: pallas_kernels.quantized_matmul(x, w)}
  if m > 128:
    variants["halves"] = halves
  for s in MAX_STEPS:
    b = mb256_build(m, k, n, s)
    if b is not None:
      variants[f"mb256_le{s}"] = mb256_forward(b)
      print(f"{name} M={m} mb256_le{s}: {b.splits} splits of {b.meta['STEPS']} steps, {b.grid[0] * b.splits} programs",
            flush=True)
  row = {"bf16": us_per_call(lambda x, w: jnp.dot(x, w), x, dense)}
  for vname, fn in variants.items():
    try:
      y = jax.jit(fn)(x, q0).astype(jnp.float32)
      err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
      assert err < 1e-2 and bool(jnp.isfinite(y).all()), f"relative error {err}"
      row[vname] = us_per_call(fn, x, qs)
    except Exception as e:  # a lab variant that fails is reported, not fatal
      print(f"{name} M={m} {vname} FAILED: {str(e)[:400]}", flush=True)
      row[vname] = float("nan")
  for key, v in row.items():
    tot[(m, key)] = tot.get((m, key), 0.0) + (v if name != "7b_gate" else 0.0)
  print(f"{name:9s} M={m:3d} | " + " | ".join(f"{key} {v:6.1f} ({row['bf16'] / v:.2f}x)" for key, v in row.items()),
        flush=True)
print("\nsummed over q/k/v, o, fused gate/up and down (µs, x bf16):")
for m in MS:
  keys = [key for (mm, key) in tot if mm == m]
  print(f"M={m:3d} " + " | ".join(f"{key} {tot[(m, key)]:6.1f} ({tot[(m, 'bf16')] / tot[(m, key)]:.2f}x)"
                                   for key in keys), flush=True)
