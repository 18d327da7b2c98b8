"""Lab (GPU): does the layer index cost the small decode GEMVs time? In a decode step every W4A16 kernel reads layer
``index`` of a 28-layer stack, and its first weight load waits for the index load (the code and scale addresses
depend on it). This times the 7B kernels (q/k/v, o, the fused gate/up, down; LAB_SHAPES=small for the first two) at M = 1 and 8 on a 28-layer stack, each call at another layer
(so no weight comes from the L2), against the same kernels on 28 separate one-layer matrices, where the build never
reads the index for its addresses. Codes in decode order, as the sampler reads them; checked against the reference
first.

  PYTHONPATH=$PWD python3 experiments/lab/gluon/layer_index_probe.py
"""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from labcommon import activations, us_per_call  # noqa: E402
import jax, jax.numpy as jnp  # noqa: E402
from pallas_kernels import matmul, w4_gluon  # noqa: E402
from pallas_kernels.matmul import reference_matmul  # noqa: E402
from qerl_jax import nvfp4  # noqa: E402

L = 28
print("| matrix | M | 28 one-layer matrices (µs) | a 28-layer stack, index per call (µs) |\n|---|---:|---:|---:|")
SHAPES = {"7b_qkv": (3584, 4608), "7b_o": (3584, 3584), "7b_gate_up": (3584, 37888), "7b_down": (18944, 3584)}
if os.environ.get("LAB_SHAPES") == "small":
  SHAPES = {k: SHAPES[k] for k in ("7b_qkv", "7b_o")}
for name, (k, n) in SHAPES.items():
  stack = nvfp4.to_decode_order(jax.tree.map(lambda *a: jnp.stack(a), *[  # quantized a layer at a time (memory)
      nvfp4.quantize(jax.random.normal(jax.random.key(k + n + i), (k, n), jnp.float32) * 0.02) for i in range(L)]))
  singles = [matmul.layer_of(stack, i) for i in range(L)]
  for m in (1, 8):
    x = activations(m, k)
    for i in (0, 17):
      ref = reference_matmul(x, singles[i], out_dtype=jnp.float32)
      y = w4_gluon.forward(x, stack, out_dtype=jnp.float32, index=jnp.int32(i))
      err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
      assert err < 1e-2 and bool(jnp.isfinite(y).all()), err
    one = us_per_call(lambda x, w: w4_gluon.forward(x, w), x, singles)
    idx = [jnp.int32(i) for i in range(L)]
    stacked = us_per_call(lambda x, i: w4_gluon.forward(x, stack, index=i), x, idx)
    print(f"| {name} | {m} | {one:.2f} | {stacked:.2f} |", flush=True)
