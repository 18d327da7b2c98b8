"""Lab (GPU): what the decode code order costs the large-M paths (prefill, training).

A weight in ``nvfp4.to_decode_order``'s order is read in place only by the Gluon decode kernel; the
Pallas kernels get one layer sliced and converted back by XLA first (``w4_triton._standard_codes``).
This times, per 7B layer matrix of a 28-layer stack (device time, one traced call):

* ``convert``: ``_standard_codes(w, index)`` alone (the slice and the XLA conversion that the Pallas
  fused kernels still use);
* ``dequantize``: the dequantize kernel on a standard-order stack and on a decode-order one (which it
  reads in place since session 16), checked bit for bit first;
* ``fwd M=2048`` and ``dx``: ``quantized_matmul`` and ``matmul.kernel_dx`` (dequantize + cuBLAS) from a
  standard-order stack and from a decode-order one, so the difference is the order's whole cost there.

  PYTHONPATH=$PWD python3 experiments/lab/time_code_order.py                            # the in-place kernel (default)
  QERL_DEQUANT_IN_PLACE=0 PYTHONPATH=$PWD python3 experiments/lab/time_code_order.py   # the XLA conversion first

Session 16 (H200, standard dequantize after the XLA conversion): the conversion ran at about 0.7 TB/s and
an M = 2048 forward took 19-22% longer in decode order (docs/benchmarks.md, "Session 16"); session 17
measured the in-place kernel within 2% of the standard order and turned it on.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import devtime  # noqa: E402
from pallas_kernels import matmul, quantized_matmul, w4_triton  # noqa: E402
from qerl_jax import nvfp4  # noqa: E402

SHAPES = {"qkv": (3584, 4608), "o": (3584, 3584), "gate_up": (3584, 37888), "down": (18944, 3584)}
LAYERS, M = 28, 2048


def device_us(fn, *args) -> float:
  durs = devtime.trace_durations(jax.jit(fn), *args)
  return float(sum(sum(v) for v in durs.values()))


def main():
  setting = os.environ.get("QERL_DEQUANT_IN_PLACE")  # "0": the XLA conversion; "1" (the default since session 17): in place
  if setting in ("0", "1"):
    w4_triton.DEQUANT_DECODE_ORDER_IN_PLACE = setting == "1"
  print(f"w4_triton.DEQUANT_DECODE_ORDER_IN_PLACE = {w4_triton.DEQUANT_DECODE_ORDER_IN_PLACE}", flush=True)
  idx = jnp.int32(13)
  for name, (k, n) in SHAPES.items():
    w = jax.jit(lambda key: nvfp4.quantize(jax.random.normal(key, (LAYERS, k, n), jnp.bfloat16) * 0.02))(
        jax.random.key(0))
    wd = jax.jit(nvfp4.to_decode_order)(w)
    back = jax.jit(lambda w, i: w4_triton._standard_codes(w, i)[0].packed)(wd, idx)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(w.packed[13]))
    deq = jax.jit(lambda w, i: w4_triton.dequantize(w, index=i))  # decode order: read in place
    np.testing.assert_array_equal(np.asarray(deq(wd, idx), np.float32), np.asarray(deq(w, idx), np.float32))
    deq_us = (device_us(lambda w, i: w4_triton.dequantize(w, index=i), w, idx),
              device_us(lambda w, i: w4_triton.dequantize(w, index=i), wd, idx))
    x = jax.random.normal(jax.random.key(1), (M, k), jnp.float32).astype(jnp.bfloat16)
    conv = device_us(lambda w, i: w4_triton._standard_codes(w, i)[0].packed, wd, idx)
    f = lambda x, w, i: quantized_matmul(x, w, index=i)
    std, dec = device_us(f, x, w, idx), device_us(f, x, wd, idx)
    dy = jax.random.normal(jax.random.key(2), (M, n), jnp.float32).astype(jnp.bfloat16)
    g = lambda dy, w, i: matmul.kernel_dx(dy, w, index=i)  # the update step's backward for x
    dx_std, dx_dec = device_us(g, dy, w, idx), device_us(g, dy, wd, idx)
    mb = k * n / 2 / 1e6
    print(f"{name:8s} codes {mb:6.1f} MB | convert {conv:7.1f} us ({2 * mb / max(conv, 1e-9):5.2f} TB/s r+w) | "
          f"dequantize: standard {deq_us[0]:6.1f} us, decode order {deq_us[1]:6.1f} us | "
          f"fwd M={M}: standard {std:7.1f} us, decode order {dec:7.1f} us (+{100 * (dec / max(std, 1e-9) - 1):.1f}%) | "
          f"dx: standard {dx_std:7.1f} us, decode order {dx_dec:7.1f} us (+{100 * (dx_dec / max(dx_std, 1e-9) - 1):.1f}%)",
          flush=True)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)


if __name__ == "__main__":
  main()
