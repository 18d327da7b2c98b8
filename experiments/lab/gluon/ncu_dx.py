"""Lab (GPU): a minimal program for Nsight Compute: a few calls of the large-M dx kernel (w4_gluon_dx) at one shape.

  PYTHONPATH=$PWD python3 experiments/lab/gluon/ncu_dx.py M K N                 # e.g. 2048 3584 37888 (7B gate/up)
  DX_SET="WS=0" ...                                                              # module settings
  ncu --clock-control none -k regex:w4a16_dx --launch-skip 1 --launch-count 1 --section SpeedOfLight ... python3 <this> M K N
"""
import os
import sys

import jax
import jax.numpy as jnp

from pallas_kernels import w4_gluon_dx
from qerl_jax import nvfp4

m, k, n = (int(v) for v in sys.argv[1:4])
for kv in filter(None, os.environ.get("DX_SET", "").split(",")):
  setattr(w4_gluon_dx, kv.split("=")[0], int(kv.split("=")[1]))
w = nvfp4.quantize(jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02)
dy = jax.random.normal(jax.random.key(1), (m, n), jnp.float32).astype(jnp.bfloat16)
f = jax.jit(w4_gluon_dx.dx)
for _ in range(3):
  y = jax.block_until_ready(f(dy, w))
print(f"M={m} K={k} N={n} WS={w4_gluon_dx.WS}: |dx| = {float(jnp.linalg.norm(y.astype(jnp.float32))):.3e}")
