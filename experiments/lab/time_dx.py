"""Lab (GPU): the large-M Gluon dx kernel (pallas_kernels.w4_gluon_dx) against bf16 cuBLAS and the
dequantize + cuBLAS path it replaces, per 7B layer matrix of a 28-layer stack (layer 13), M = 2048 and
8192; device time, median of 5 traced calls. Each variant is checked against the dequantize path first.

  XLA_FLAGS="--xla_gpu_enable_triton_gemm=false" PYTHONPATH=$PWD python3 experiments/lab/time_dx.py
  DX_VARIANTS="base;as2:A_STAGES=2;xs5:X_STAGES=5" DX_MS=2048 ...   # module settings per variant
  DX_ORDER=decode ...                                                 # decode-order codes (converted per call)
"""
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import devtime  # noqa: E402
from pallas_kernels import matmul, w4_gluon_dx  # noqa: E402
from qerl_jax import nvfp4  # noqa: E402

SHAPES = {"qkv": (3584, 4608), "o": (3584, 3584), "gate_up": (3584, 37888), "down": (18944, 3584)}
LAYERS = 28


def device_us(fn, *args, reps=5) -> float:
  f = jax.jit(fn)
  jax.block_until_ready(f(*args))
  return statistics.median(float(sum(sum(v) for v in devtime.trace_durations(f, *args).values())) for _ in range(reps))


def variants():
  out = []
  for spec in os.environ.get("DX_VARIANTS", "base").split(";"):
    name, _, settings = spec.partition(":")
    out.append((name, dict((kv.split("=")[0], int(kv.split("=")[1])) for kv in settings.split(",") if kv)))
  return out


def main():
  ms = [int(m) for m in os.environ.get("DX_MS", "2048,8192").split(",")]
  shapes = os.environ.get("DX_SHAPES", ",".join(SHAPES)).split(",")
  defaults = {k: getattr(w4_gluon_dx, k) for k in ("BLOCK_M", "X_STAGES", "A_STAGES", "WS", "WS_STAGES",
                                                  "WS_DECODE_WARPS", "WS_MAXNREG", "WS_DECODE_REGS", "WS_PROBE", "WS_CODE_STAGES", "WS_BLOCK_M", "WS_BLOCK_K")}
  idx = jnp.int32(13)
  totals = {}
  for name in shapes:
    k, n = SHAPES[name]
    w = jax.jit(lambda key: nvfp4.quantize(jax.random.normal(key, (LAYERS, k, n), jnp.bfloat16) * 0.02))(jax.random.key(0))
    wb = jax.jit(lambda w: nvfp4.dequantize(jax.tree.map(lambda a: a[13], w), jnp.bfloat16))(w)
    if os.environ.get("DX_ORDER") == "decode":  # the trainer's GPU default (model.code_order="auto")
      w = jax.jit(nvfp4.to_decode_order)(w)
    for m in ms:
      dy = jax.random.normal(jax.random.key(2), (m, n), jnp.float32).astype(jnp.bfloat16)
      bf16 = device_us(lambda dy, wb: jax.lax.dot_general(dy, wb, (((1,), (1,)), ((), ())),
                                                          preferred_element_type=jnp.float32).astype(jnp.bfloat16), dy, wb)
      matmul.GLUON_DX = "0"
      deq_f = lambda dy, w, i: matmul.kernel_dx(dy, w, index=i)
      ref = jax.jit(deq_f)(dy, w, idx)
      deq = device_us(deq_f, dy, w, idx)
      row = f"{name:8s} M={m:5d} | bf16 {bf16:8.1f} us | deq+cuBLAS {deq:8.1f} ({bf16 / deq:4.2f}x)"
      totals.setdefault(("bf16", m), 0.0)
      totals[("bf16", m)] += bf16
      totals.setdefault(("deq", m), 0.0)
      totals[("deq", m)] += deq
      for vname, settings in variants():
        for key, value in {**defaults, **settings}.items():
          setattr(w4_gluon_dx, key, value)
        g = lambda dy, w, i: w4_gluon_dx.dx(dy, w, index=i)
        got = jax.jit(g)(dy, w, idx)
        err = float(jnp.linalg.norm((got.astype(jnp.float32) - ref.astype(jnp.float32))) / jnp.linalg.norm(ref.astype(jnp.float32)))
        t = device_us(g, dy, w, idx)
        totals.setdefault((vname, m), 0.0)
        totals[(vname, m)] += t
        row += f" | {vname} {t:8.1f} ({bf16 / t:4.2f}x, err {err:.1e})"
      print(row, flush=True)
  for m in ms:
    b = totals[("bf16", m)]
    print(f"7B summed M={m}: " + ", ".join(f"{v} {t:8.1f} us ({b / t:4.2f}x bf16)" for (v, mm), t in totals.items() if mm == m),
          flush=True)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)


if __name__ == "__main__":
  main()
