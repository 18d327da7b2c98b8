"""Lab (GPU): the large-M Gluon forward (pallas_kernels.w4_gluon_mm) against bf16 cuBLAS and the dequantize +
cuBLAS path it would replace, per layer matrix of a stack (layer 13), M = 2048 and 8192; device time, median
of 5 traced calls. Each variant is checked against the dequantize path first (relative error printed).

  XLA_FLAGS="--xla_gpu_enable_triton_gemm=false" PYTHONPATH=$PWD python3 experiments/lab/time_mm.py
  MM_VARIANTS="base;s3:STAGES=3;if0:IN_FLIGHT=0" MM_MS=2048 MM_MODEL=32b ...   # module settings per variant
  MM_ORDER=decode ...   # decode-order codes (nvfp4.to_decode_order, the trainer's GPU default), read in place
  MM_ADDEND=1 ...       # a bf16 [M, N] addend (bias + LoRA delta): the kernel's epilogue adds it; the bf16 and
                        # dequantize paths add it after their GEMM (XLA folds it into cuBLAS's C)
  MM_VARIANTS="base;sk8:MAX_SPLITS=8;narrow:SMALL_M_MAX=128,MAX_SPLITS=8" MM_MS=64,128,256 ...  # split-K, narrow
                        # tiles; at M <= 128 the decode GEMV (w4_gluon, the library's path there) is timed too
  MM_VARIANTS="base:NARROW_DECODE=2,WIDE_DECODE=2;p4:DECODE=4;pk:DECODE=4,PAIRED_X_PERMUTE=0;p5:DECODE=5" MM_ORDER=decode
                        # the paired decode at every M: unpaired (base), x permuted by XLA (p4, the narrow tiles'
                        # default) or handed over permuted (pk), repaired in registers (p5, the wide tiles' default)
  MM_KIND=dx ...        # the backward dy [M, N] @ W^T by the dx build (w4_gluon_mm.dx) against dot_general with
                        # the bf16 W and against dequantize + cuBLAS contracting N
"""
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import devtime  # noqa: E402
from pallas_kernels import w4_gluon, w4_gluon_mm, w4_triton  # noqa: E402
from qerl_jax import nvfp4  # noqa: E402

MODELS = {"7b": {"qkv": (3584, 4608), "o": (3584, 3584), "gate_up": (3584, 37888), "down": (18944, 3584)},
          "32b": {"qkv": (5120, 7168), "o": (5120, 5120), "gate_up": (5120, 55296), "down": (27648, 5120)}}
LAYERS = 4


def device_us(fn, *args, reps=5) -> float:
  f = jax.jit(fn)
  jax.block_until_ready(f(*args))
  return statistics.median(float(sum(sum(v) for v in devtime.trace_durations(f, *args).values())) for _ in range(reps))


def w4_triton_dense(x, w, i):
  """The library's large-M path before this kernel: the layer dequantized to bf16 by a Pallas kernel, one cuBLAS GEMM."""
  return jnp.dot(x, w4_triton.dequantize(w, x.dtype, index=i))


def variants():
  out = []
  for spec in os.environ.get("MM_VARIANTS", "base").split(";"):
    name, _, settings = spec.partition(":")
    out.append((name, dict((kv.split("=")[0], int(kv.split("=")[1])) for kv in settings.split(",") if kv)))
  return out


def main():
  ms = [int(m) for m in os.environ.get("MM_MS", "2048,8192").split(",")]
  model = os.environ.get("MM_MODEL", "7b")
  shapes = MODELS[model]
  names = os.environ.get("MM_SHAPES", ",".join(shapes)).split(",")
  # every setting a variant names, at the module's value: restored before each variant sets its own
  defaults = {k: getattr(w4_gluon_mm, k) for _, settings in variants() for k in settings}
  idx = jnp.int32(2)
  totals = {}
  for name in names:
    k, n = shapes[name]
    w = jax.jit(lambda key: nvfp4.quantize(jax.random.normal(key, (LAYERS, k, n), jnp.bfloat16) * 0.02))(jax.random.key(0))
    wb = jax.jit(lambda w: nvfp4.dequantize(jax.tree.map(lambda a: a[2], w), jnp.bfloat16))(w)
    if os.environ.get("MM_ORDER") == "decode":
      w = jax.jit(nvfp4.to_decode_order)(w)
    addend = os.environ.get("MM_ADDEND") == "1"
    dx = os.environ.get("MM_KIND") == "dx"
    for m in ms:
      x = jax.random.normal(jax.random.key(2), (m, n if dx else k), jnp.float32).astype(jnp.bfloat16)
      c = (jax.random.normal(jax.random.key(3), (m, n), jnp.float32) * 0.1).astype(jnp.bfloat16) if addend else None
      plus = (lambda y: y + c) if addend else (lambda y: y)
      # bf16: the faster of a float32-accumulated dot with a bf16 cast and a plain bf16 dot (as bench_kernels.py)
      if dx:  # dy @ W^T contracting N, no transposed copy (as matmul.kernel_dx)
        dims = (((1,), (1,)), ((), ()))
        bf16 = device_us(lambda x, wb: jax.lax.dot_general(x, wb, dims, preferred_element_type=jnp.bfloat16), x, wb)
        deq_f = lambda x, w, i: jax.lax.dot_general(x, w4_triton.dequantize(w, x.dtype, index=i), dims,
                                                    preferred_element_type=jnp.bfloat16)
      else:
        bf16 = min(device_us(lambda x, wb: plus(jnp.dot(x, wb, preferred_element_type=jnp.float32).astype(jnp.bfloat16)),
                             x, wb),
                   device_us(lambda x, wb: plus(jnp.dot(x, wb)), x, wb))
        deq_f = lambda x, w, i: plus(w4_triton_dense(x, w, i))
      ref = jax.jit(deq_f)(x, w, idx)
      deq = device_us(deq_f, x, w, idx)
      row = f"{name:8s} M={m:5d} | bf16 {bf16:8.1f} us | deq+cuBLAS {deq:8.1f} ({bf16 / deq:4.2f}x)"
      timed = [("bf16", bf16), ("deq", deq)]
      if not dx and not addend and w4_gluon.applies(m, w, x.dtype):  # M <= 128: the decode GEMV, the library's path
        gemv = device_us(lambda x, w, i: w4_gluon.forward(x, w, index=i), x, w, idx)
        row += f" | gemv {gemv:8.1f} ({bf16 / gemv:4.2f}x)"
        timed.append(("gemv", gemv))
      for key, t in timed:
        totals[(key, m)] = totals.get((key, m), 0.0) + t
      for vname, settings in variants():
        for key, value in {**defaults, **settings}.items():
          setattr(w4_gluon_mm, key, value)
        g = ((lambda x, w, i: w4_gluon_mm.dx(x, w, index=i)) if dx else
             (lambda x, w, i: w4_gluon_mm.forward(x, w, index=i, addend=c)))
        # DECODE 4's paired decode with PAIRED_X_PERMUTE 0: x comes in its K order already (the kernel timed without
        # the permute)
        paired = not dx and w4_gluon_mm.takes_nibble_pair_x(w4_gluon_mm.meta_for(m, k, n, LAYERS,
                                                                                  w.code_order == "decode"))
        xv = w4_gluon_mm.x_in_nibble_pair_order(x) if paired and not w4_gluon_mm.PAIRED_X_PERMUTE else x
        got = jax.jit(g)(xv, w, idx)
        err = float(jnp.linalg.norm((got.astype(jnp.float32) - ref.astype(jnp.float32))) / jnp.linalg.norm(ref.astype(jnp.float32)))
        t = device_us(g, xv, w, idx)
        totals[(vname, m)] = totals.get((vname, m), 0.0) + t
        row += f" | {vname} {t:8.1f} ({bf16 / t:4.2f}x, err {err:.1e})"
      print(row, flush=True)
  for m in ms:
    b = totals[("bf16", m)]
    print(f"{model} summed M={m}: " + ", ".join(f"{v} {t:8.1f} us ({b / t:4.3f}x bf16)" for (v, mm), t in totals.items() if mm == m),
          flush=True)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)


if __name__ == "__main__":
  main()
