"""Lab: training-rollout throughput (7B shape, LoRA rank 32 on all linears, AQN) under variants of the
LoRA delta's formulation in qerl_jax.models.layers (monkeypatched before tracing).

Variants: "split16" (as committed), "split8", "split32", "noSplit" (one dot for x @ A),
"bReduce" (split16, and (x @ A) @ B as a broadcast-multiply-reduce that XLA can fuse with the add),
and "epilogue" (split16, and the B product added in the fused W4A16 kernel's epilogue:
layers.LORA_EPILOGUE). ``LORA_VARIANTS=split16,epilogue`` picks some.

  XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_dynamic_slice_fusion=true" \
  PYTHONPATH=$PWD python3 experiments/lab/lora_variants.py nvfp4_fused:8 nvfp4_fused:64
"""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "experiments"))
import jax, jax.numpy as jnp
from absl import flags
flags.FLAGS(["lab"])
import bench_rollout as br
from qerl_jax import models
from qerl_jax.models import layers

ORIGINAL = layers._lora_f32


def b_reduce(x, lora, lora_scale):
  dt = x.dtype
  xa = layers._x_at_a(x, lora["a"].astype(dt)).astype(dt)
  rows = 1
  for d in x.shape[:-1]:
    rows *= d
  if rows > 64:
    return ORIGINAL(x, lora, lora_scale)
  b = lora["b"].astype(dt)
  return lora_scale * jnp.sum(xa[..., :, None].astype(jnp.float32) * b.astype(jnp.float32), axis=-2)


VARIANTS = {"split16": (16, ORIGINAL), "split8": (8, ORIGINAL), "split32": (32, ORIGINAL),
            "noSplit": (10 ** 9, ORIGINAL), "bReduce": (16, b_reduce), "epilogue": (16, ORIGINAL)}

cfg = models.ModelConfig.from_hf(br.QWEN25_7B)
bw = br.hbm_bandwidth()
names = os.environ.get("LORA_VARIANTS", ",".join(VARIANTS)).split(",")
print("| weights | batch | " + " | ".join(f"{v} tok/s" for v in names) + " |")
print("|---|---|" + "---|" * len(names))
for spec in sys.argv[1:]:
  fmt, batch = spec.split(":")
  base = br.make_base(cfg, fmt)
  lora, scale, noise = br.adapter_and_noise(cfg, base, 32, True)
  row = []
  for v in names:
    split, fn = VARIANTS[v]
    layers._LORA_SPLIT_K, layers._lora_f32 = split, fn
    layers.LORA_EPILOGUE = v == "epilogue"  # (x @ A) @ B added in the fused W4A16 kernel's epilogue
    jax.clear_caches()  # else .lower() reuses the first variant's trace
    r = br.bench_one(cfg, base, int(batch), 256, 1024, bw, lora=lora, lora_scale=scale, noise=noise)
    row.append(f"{r['tokens_per_s']:.0f}")
  print(f"| {fmt}+lora32+aqn | {batch} | " + " | ".join(row) + " |", flush=True)
  del base, lora
