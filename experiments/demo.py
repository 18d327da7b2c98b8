"""A first look at the 4-bit weight formats (runs on a CPU in seconds, no download).

  PYTHONPATH=. python experiments/demo.py [--layers 2] [--seed 0]

Builds random weights with the shapes of Qwen2.5-0.5B's decoder linears (hidden
896, MLP 4864, 14 query / 2 KV heads of 64), stacked over ``--layers`` layers as
the model stores them (``[L, K, N]``, ``x @ W`` layout), quantizes them to NF4
(QLoRA's baseline) and NVFP4 (QeRL's format), and prints per format the bytes
held and the relative Frobenius error of the weights and of a
``quantized_matmul`` output against the float32 product. q/k/v share one NVFP4
global scale (the smallest of the three), as vLLM requires for fused projections.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from qerl_jax import nf4, nvfp4

HIDDEN, MLP, HEAD_DIM, Q_HEADS, KV_HEADS = 896, 4864, 64, 14, 2
SHAPES = {  # name: (K, N) in x @ W layout
    "q": (HIDDEN, Q_HEADS * HEAD_DIM), "k": (HIDDEN, KV_HEADS * HEAD_DIM),
    "v": (HIDDEN, KV_HEADS * HEAD_DIM), "o": (Q_HEADS * HEAD_DIM, HIDDEN),
    "gate": (HIDDEN, MLP), "up": (HIDDEN, MLP), "down": (MLP, HIDDEN),
}


def rel_err(a, b) -> float:
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--tokens", type=int, default=16, help="rows of the activation x [T, K]")
  a = p.parse_args()

  key = jax.random.key(a.seed)
  weights = {}
  for i, (name, (k, n)) in enumerate(SHAPES.items()):
    # Gaussian weights with std 1/sqrt(K) (a typical init) and a few large outliers.
    w = jax.random.normal(jax.random.fold_in(key, i), (a.layers, k, n), jnp.float32) / np.sqrt(k)
    w = w.at[:, 0, 0].set(20.0 / np.sqrt(k))
    weights[name] = w.astype(jnp.bfloat16)

  # q/k/v share the smallest per-layer global scale (vLLM's fused qkv_proj needs one).
  qkv_gs = jnp.min(jnp.stack([nvfp4.compute_global_scale(weights[m]) for m in "qkv"]), axis=0)

  t0 = time.perf_counter()
  quant = {"bf16": weights,
           "nf4": {m: nf4.quantize(w) for m, w in weights.items()},
           "nvfp4": {m: nvfp4.quantize(w, global_scale=qkv_gs if m in "qkv" else None)
                     for m, w in weights.items()}}
  jax.block_until_ready(quant)
  print(f"quantized {len(SHAPES)} linears x {a.layers} layers to NF4 and NVFP4 in "
        f"{time.perf_counter() - t0:.2f} s on {jax.devices()[0].device_kind}\n")

  x = jax.random.normal(jax.random.fold_in(key, 99), (a.tokens, HIDDEN), jnp.bfloat16)
  n_params = sum(int(np.prod(w.shape)) for w in weights.values())
  print(f"{'format':7s} {'bytes':>12s} {'bits/weight':>12s} {'weight rel err':>15s} {'x@W_gate rel err':>17s}")
  for fmt, ws in quant.items():
    nbytes = sum(int(w.nbytes) for w in ws.values())
    if fmt == "bf16":
      deq = {m: w.astype(jnp.float32) for m, w in ws.items()}
      y = jnp.dot(x, ws["gate"][0], preferred_element_type=jnp.float32)
    else:
      mod = nf4 if fmt == "nf4" else nvfp4
      deq = {m: mod.dequantize(w) for m, w in ws.items()}
      layer0 = jax.tree_util.tree_map(lambda arr: arr[0], ws["gate"])  # one layer's [K, N]
      y = pallas_kernels.quantized_matmul(x, layer0, out_dtype=jnp.float32)
    w_err = rel_err(jnp.concatenate([d.reshape(-1) for d in deq.values()]),
                    jnp.concatenate([w.astype(jnp.float32).reshape(-1) for w in weights.values()]))
    y_ref = jnp.dot(x.astype(jnp.float32), weights["gate"][0].astype(jnp.float32))
    print(f"{fmt:7s} {nbytes:12,d} {8 * nbytes / n_params:12.3f} {w_err:15.4f} {rel_err(y, y_ref):17.4f}")
  print("\n(weight error is against the bf16 weights; x@W error against the float32 product.)")


if __name__ == "__main__":
  main()
