"""Lab (GPU): a minimal program for Nsight Compute: four calls of the tuned forward kernel at one shape.

  PYTHONPATH=$PWD python3 experiments/lab/ncu_target.py M K N     # e.g. 8 3584 18944
(on a CPU it runs the kernel in interpret mode at the given shape, to check the script.)
"""
import sys

import jax
import jax.numpy as jnp

from pallas_kernels import w4_triton
from qerl_jax import nvfp4

m, k, n = (int(v) for v in sys.argv[1:4])
interpret = jax.default_backend() == "cpu"
w = nvfp4.quantize(jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02)
x = jax.random.normal(jax.random.key(1), (m, k), jnp.float32).astype(jnp.bfloat16)
f = jax.jit(lambda x, w: w4_triton.forward(x, w, out_dtype=jnp.float32, interpret=interpret))
for _ in range(4):
  y = jax.block_until_ready(f(x, w))
print(f"M={m} K={k} N={n}: {w4_triton.default_config(m, k, n)}, |y| = {float(jnp.linalg.norm(y)):.3e}")
