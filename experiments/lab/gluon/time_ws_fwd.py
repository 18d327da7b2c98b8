"""Lab (GPU): the warp-specialized mid-M forward (pallas_kernels.w4_gluon_ws) against bf16 cuBLAS and the
library's current path (quantized_matmul: the Gluon wgmma builds at M <= 128, dequantize + cuBLAS above),
per 7B matrix, decode-order codes, a 4-layer stack run layer after layer in one call (152+ MB for gate, beyond
the L2); device time per layer, median of 5. Each route is checked against the float32 XLA reference first.

  PYTHONPATH=$PWD python3 experiments/lab/gluon/time_ws_fwd.py          # WS_MS=64,128,256 WS_SHAPES=qkv,o,gate,down
"""
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import devtime  # noqa: E402
from pallas_kernels import quantized_matmul, w4_gluon_ws  # noqa: E402
from qerl_jax import nvfp4  # noqa: E402

SHAPES = {"qkv": (3584, 4608), "o": (3584, 3584), "gate": (3584, 18944), "down": (18944, 3584)}
LAYERS = 4


def device_us(fn, *args, reps=5) -> float:
  f = jax.jit(fn)
  jax.block_until_ready(f(*args))
  return statistics.median(float(sum(sum(v) for v in devtime.trace_durations(f, *args).values()))
                           for _ in range(reps)) / LAYERS


def over_layers(call):
  """The sum over the stack's layers of ``call(x, w, i)`` (each layer read once)."""
  def f(x, w):
    return sum(call(x, w, jnp.int32(i)).astype(jnp.float32) for i in range(LAYERS))
  return f


def main():
  ms = [int(m) for m in os.environ.get("WS_MS", "64,128,256").split(",")]
  shapes = os.environ.get("WS_SHAPES", ",".join(SHAPES)).split(",")
  totals = {}
  for name in shapes:
    k, n = SHAPES[name]
    w = jax.jit(lambda key: nvfp4.to_decode_order(nvfp4.quantize(jax.random.normal(key, (LAYERS, k, n), jnp.bfloat16) * 0.02)))(jax.random.key(0))
    # bf16 weights as separate arrays (a slice of a stacked array may be a copy)
    wb = tuple(jax.jit(lambda w, i=i: nvfp4.dequantize(jax.tree.map(lambda a: a[i], nvfp4.to_standard_order(w)),
                                                       jnp.bfloat16))(w) for i in range(LAYERS))
    for m in ms:
      x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
      ref = jax.jit(lambda x, wb: sum(jnp.dot(x.astype(jnp.float32), wb[i].astype(jnp.float32)) for i in range(LAYERS)))(x, wb)
      routes = {
          "bf16": (lambda x, wb: sum(jnp.dot(x, wb[i], preferred_element_type=jnp.float32).astype(jnp.bfloat16)
                                  .astype(jnp.float32) for i in range(LAYERS)), wb),
          "library": (over_layers(lambda x, w, i: quantized_matmul(x, w, index=i)), w),
          "ws": (over_layers(lambda x, w, i: w4_gluon_ws.forward(x, w, index=i)), w),
      }
      row = f"{name:5s} M={m:4d}"
      times = {}
      for r, (f, wt) in routes.items():
        got = jax.jit(f)(x, wt)
        err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
        times[r] = device_us(f, x, wt)
        totals[(r, m)] = totals.get((r, m), 0.0) + times[r]
        row += f" | {r} {times[r]:7.1f} us ({times['bf16'] / times[r]:4.2f}x, err {err:.1e})"
      print(row, flush=True)
  for m in ms:
    b = totals[("bf16", m)]
    print(f"7B summed M={m}: " + ", ".join(f"{r} {t:7.1f} us ({b / t:4.2f}x bf16)" for (r, mm), t in totals.items() if mm == m),
          flush=True)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)


if __name__ == "__main__":
  main()
