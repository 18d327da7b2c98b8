"""Lab (GPU): a minimal program for Nsight Compute: four calls of the Gluon W4A16 kernel at one shape.

  PYTHONPATH=$PWD python3 experiments/lab/gluon/ncu_target.py M K N      # e.g. 128 3584 18944
  NCU_ORDER=decode ...                                                  # codes in nvfp4.to_decode_order's order
  NCU_L2_PROBE=1 ...                                                    # w4_gluon.L2_PROBE (an L2-resident stream)
  ncu --clock-control none -k regex:w4a16_gemv --launch-skip 2 --launch-count 1 ... python3 <this> M K N
"""
import os
import sys

import jax
import jax.numpy as jnp

from pallas_kernels import w4_gluon
from qerl_jax import nvfp4

m, k, n = (int(v) for v in sys.argv[1:4])
w4_gluon.L2_PROBE = int(os.environ.get("NCU_L2_PROBE", "0"))
w = nvfp4.quantize(jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02)
if os.environ.get("NCU_ORDER") == "decode":  # the rollout's code order (its cheaper E2M1 decode)
  w = nvfp4.to_decode_order(w)
x = jax.random.normal(jax.random.key(1), (m, k), jnp.float32).astype(jnp.bfloat16)
f = jax.jit(lambda x, w: w4_gluon.forward(x, w, out_dtype=jnp.float32))
for _ in range(4):
  y = jax.block_until_ready(f(x, w))
b = w4_gluon._build(m, k, n, 1, w.code_order == "decode")
print(f"M={m} K={k} N={n}: grid {b.grid}, warps {b.warps}, maxnreg {b.maxnreg}, |y| = {float(jnp.linalg.norm(y)):.3e}")
