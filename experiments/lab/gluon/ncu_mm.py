"""Lab (GPU): a target for Nsight Compute: the large-M Gluon forward (pallas_kernels.w4_gluon_mm) called 4 times
at "M K N" (default the 7B fused gate/up at M = 2048). See ncu_mm.sh."""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
import jax, jax.numpy as jnp
from pallas_kernels import w4_gluon_mm
from qerl_jax import nvfp4

m, k, n = (int(v) for v in (sys.argv[1:4] if len(sys.argv) > 3 else (2048, 3584, 37888)))
for kv in os.environ.get("MM_SETTINGS", "").split(","):
  if kv:
    setattr(w4_gluon_mm, kv.split("=")[0], int(kv.split("=")[1]))
w = jax.jit(lambda key: nvfp4.quantize(jax.random.normal(key, (k, n), jnp.bfloat16) * 0.02))(jax.random.key(0))
x = jax.random.normal(jax.random.key(1), (m, k), jnp.float32).astype(jnp.bfloat16)
f = jax.jit(w4_gluon_mm.forward)
for _ in range(4):
  y = f(x, w)
jax.block_until_ready(y)
print("done", y.shape, flush=True)
