"""Lab (GPU): rollout throughput (7B shape) with fewer split-K programs in the small-M forward kernel.

At batch 8 the tuned M <= 16 tile aims at about 1056 programs, so the q/k/v kernel splits K 28 ways,
and each of its three consumers (q RoPE, the K and V cache writes: 3.7, 3.1 and 1.7 µs a layer and
step in the session-6 profile) re-reads and sums all 28 float32 partials. This times whole rollouts
with the M <= 16 bucket's target program count at 1056 (as committed), 528 and 264 (monkeypatched
into w4_triton.TUNED before tracing; every shape follows, not only q/k/v).

  XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_dynamic_slice_fusion=true" \\
  PYTHONPATH=$PWD python3 experiments/lab/split_variants.py nvfp4_fused:8 nvfp4_fused:8:32
  (format:batch[:lora rank]; a rank adds a training adapter with AQN; SPLIT_TARGETS=1056,528,264;
  SPLIT_SHAPE=tiny runs a tiny model, to try the script on a CPU)
"""
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "experiments"))
import jax  # noqa: E402
from absl import flags  # noqa: E402

flags.FLAGS(["lab"])
import bench_rollout as br  # noqa: E402
from pallas_kernels import w4_triton  # noqa: E402
from qerl_jax import models  # noqa: E402

TARGETS = [int(v) for v in os.environ.get("SPLIT_TARGETS", "1056,528,264").split(",")]
ORIGINAL = w4_triton.TUNED[("fwd", 16)]

# SPLIT_SHAPE=tiny: a tiny model, to try the script on a CPU
cfg = models.ModelConfig.from_hf(br.TINY if os.environ.get("SPLIT_SHAPE") == "tiny" else br.QWEN25_7B,
                                 dtype="bfloat16")
bw = br.hbm_bandwidth() if jax.default_backend() != "cpu" else 1e10  # CPU: a placeholder (no roofline)
print("| weights | batch | " + " | ".join(f"{t} programs tok/s" for t in TARGETS) + " |")
print("|---|---|" + "---|" * len(TARGETS))
for spec in sys.argv[1:]:
  fmt, batch, *rest = spec.split(":")
  rank = int(rest[0]) if rest else 0
  base = br.make_base(cfg, fmt)
  lora, scale, noise = br.adapter_and_noise(cfg, base, rank, rank > 0)
  row = []
  for target in TARGETS:
    w4_triton.TUNED[("fwd", 16)] = ORIGINAL[:5] + (target,) + ORIGINAL[6:]
    jax.clear_caches()  # else .lower() reuses the previous variant's trace
    r = br.bench_one(cfg, base, int(batch), 256, 1024, bw, lora=lora, lora_scale=scale, noise=noise)
    row.append(f"{r['tokens_per_s']:.0f}")
  w4_triton.TUNED[("fwd", 16)] = ORIGINAL
  print(f"| {fmt}{f'+lora{rank}+aqn' if rank else ''} | {batch} | " + " | ".join(row) + " |", flush=True)
  del base, lora
