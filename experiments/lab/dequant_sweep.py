"""Lab (GPU): device time of the dequantize kernel (w4_triton.dequantize, decode-order codes) over tile configs
(block_k2, block_n, num_warps) at the 7B gate and 32B down shapes, with its bandwidth (codes + scales read, bf16
written). The large-M path (dequantize, then cuBLAS) pays it on every call: at M = 2048 it is most of the gap to bf16.

  PYTHONPATH=$PWD python3 experiments/lab/dequant_sweep.py
"""
import itertools, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
import labcommon  # noqa: E402,F401  (paths)
import devtime  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from pallas_kernels import w4_triton  # noqa: E402
from qerl_jax import nvfp4  # noqa: E402

for name, (k, n) in {"7b_gate": (3584, 18944), "32b_down": (27648, 5120)}.items():
  w = nvfp4.to_decode_order(nvfp4.quantize(jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02))
  want = np.asarray(nvfp4.dequantize(w, jnp.bfloat16), np.float32)
  res = []
  for bk2, bn, nw in itertools.product((16, 32, 64), (128, 256, 512), (4, 8)):
    f = jax.jit(lambda w: w4_triton.dequantize(w, jnp.bfloat16, block_k2=bk2, block_n=bn, num_warps=nw))
    try:
      np.testing.assert_array_equal(np.asarray(f(w), np.float32), want)
      us = min(devtime.device_time(f, w) * 1e6 for _ in range(3))
    except Exception as e:  # a config that does not compile is reported, not fatal
      print(f"{name} {bk2} {bn} {nw} FAILED {str(e)[:120]}", flush=True)
      continue
    res.append((us, bk2, bn, nw))
  res.sort()
  gb = k * n * (9 / 16 + 2) / 1e3
  print(name, "default", w4_triton.DEQUANT_CONFIG, " | ".join(f"{b}/{c}/{d} {u:.1f} µs {gb / u:.0f} GB/s"
                                                            for u, b, c, d in res[:8]), flush=True)
  print(name, "slowest", " | ".join(f"{b}/{c}/{d} {u:.1f}" for u, b, c, d in res[-3:]), flush=True)
