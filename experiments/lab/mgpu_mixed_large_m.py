"""Lab (GPU, sm_90): is a mixed-input wgmma kernel with the weight dequantized in registers fast enough at large M?

Issue 4 asks 0.9x of bf16 at M >= 2048 (forward and dx) with no bf16 W written; the library's path (dequantize +
cuBLAS) is at 0.87-0.88x at M = 2048 because of the dequantize pass. Before writing an NVFP4 Mosaic GPU kernel,
this measures JAX's own Hopper mixed-type example, ``jax.experimental.pallas.ops.gpu.hopper_mixed_type_matmul_mgpu``
(int8 weights converted to bf16 in registers as wgmma's A operand, a warp-specialized TMA pipeline, a persistent
grid), as the swapped product ``y^T = W^T x^T`` at the Qwen2.5-7B layer shapes: the weight ``[N, K]`` int8 is A, x^T
``[K, M]`` bf16 is B. The int8 -> bf16 conversion is the cheapest decode there is, so its ratio to bf16 is an
upper bound for an NVFP4 version (which also reads half the bytes, which does not matter when compute-bound).

  MIX_MS=2048,8192 PYTHONPATH=$PWD python3 experiments/lab/mgpu_mixed_large_m.py
  MIX_BF16_ONLY=1 ...   # only the bf16 column (the baseline of cutlass_mixed_ceiling.sh)

Prints, per shape and M: bf16 ``jnp.dot`` (x @ W, cuBLAS under the launchers' XLA flags), the example's best of a few
tile configurations, each checked against the reference first (relative error), device time from a profiler trace.
"""
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "experiments"))
import jax
import jax.numpy as jnp
import numpy as np

import devtime
from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as mix

SHAPES = ({"qkv": (5120, 7168), "o": (5120, 5120), "gate": (5120, 27648), "down": (27648, 5120)}
          if os.environ.get("MIX_MODEL") == "32b" else
          {"qkv": (3584, 4608), "o": (3584, 3584), "gate": (3584, 18944), "down": (18944, 3584)})  # (K, N)
MS = [int(m) for m in os.environ.get("MIX_MS", "2048,8192").split(",")]
D = mix.MatmulDimension
FIELDS = {f.name for f in dataclasses.fields(mix.TuningConfig)}
CONFIGS = [dict(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, grid_minor_dim=D.N, grid_tile_width=8,
                wg_dimension=D.N),
           dict(tile_m=128, tile_n=128, tile_k=128, max_concurrent_steps=4, grid_minor_dim=D.N, grid_tile_width=8,
                wg_dimension=D.N),
           dict(tile_m=64, tile_n=128, tile_k=128, max_concurrent_steps=4, grid_minor_dim=D.M, grid_tile_width=8,
                wg_dimension=D.M),
           dict(tile_m=128, tile_n=64, tile_k=128, max_concurrent_steps=4, grid_minor_dim=D.N, grid_tile_width=16,
                wg_dimension=D.N),
           dict(tile_m=64, tile_n=128, tile_k=64, max_concurrent_steps=5, grid_minor_dim=D.N, grid_tile_width=8,
                wg_dimension=D.N)]


def dev_us(fn, *args, reps=5):
  """Median over ``reps`` traced calls of the summed kernel time (µs) of one call."""
  jax.block_until_ready(fn(*args))
  totals = []
  for _ in range(reps):
    durs = devtime.trace_durations(lambda: jax.block_until_ready(fn(*args)))
    totals.append(sum(sum(v) for v in durs.values()))
  return float(np.median(totals))


print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; TuningConfig fields {sorted(FIELDS)}", flush=True)
print("| shape | M | bf16 µs | mixed int8 best µs | / bf16 | config | rel err |\n|---|---:|---:|---:|---:|---|---:|",
      flush=True)
for name, (k, n) in SHAPES.items():
  for m in MS:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w_int8 = jnp.asarray(rng.integers(-127, 128, (n, k)), jnp.int8)  # W^T [N, K]
    w_bf16 = w_int8.astype(jnp.bfloat16).T  # W [K, N]
    dense = jax.jit(lambda x, w: jnp.dot(x, w))
    t_bf16 = dev_us(dense, x, w_bf16)
    ref = np.asarray(jnp.dot(x, w_bf16, preferred_element_type=jnp.float32)).T  # y^T [N, M]
    xt = jax.block_until_ready(jnp.asarray(x.T))  # x^T [K, M], made outside the timed call
    best = (float("inf"), None, None)
    for cfg in [] if os.environ.get("MIX_BF16_ONLY") else CONFIGS:
      cfg = {kk: v for kk, v in cfg.items() if kk in FIELDS}
      try:
        f = jax.jit(lambda a, b, cfg=cfg: mix.mixed_matmul_kernel(a, b, out_dtype=jnp.bfloat16,
                                                                  config=mix.TuningConfig(**cfg)))
        y = np.asarray(f(w_int8, xt), np.float32)
        err = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
        if not err < 1e-2:
          print(f"  {name} M={m} {cfg}: wrong, rel err {err:.2e}", flush=True)
          continue
        t = dev_us(f, w_int8, xt)
        if t < best[0]:
          best = (t, cfg, err)
      except Exception as e:  # a config the example refuses (shape divisibility) or fails to compile
        print(f"  {name} M={m} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
    t, cfg, err = best
    if cfg is None:
      print(f"| {name} | {m} | {t_bf16:.1f} | - | - | none ran | - |", flush=True)
    else:
      short = ",".join(f"{kk}={getattr(v, 'name', v)}" for kk, v in cfg.items())
      print(f"| {name} | {m} | {t_bf16:.1f} | {t:.1f} | {t_bf16 / t:.2f}x | {short} | {err:.1e} |", flush=True)
