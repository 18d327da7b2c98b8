"""Times the decoder on real model shapes (random weights, few layers): prefill, one decode
step, and the jitted value-and-grad of token_logprobs w.r.t. LoRA; prints a table.

  PYTHONPATH=$PWD python experiments/bench_model.py --config ../shared/fixtures/configs/qwen2.5-7b-base/config.json --layers 4
"""

import json
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from qerl_jax import models
from qerl_jax.models import layers

flags.DEFINE_string("config", None, "a Hugging Face config.json", required=True)
flags.DEFINE_integer("layers", 4, "layers to keep (times scale ~linearly with L)")
flags.DEFINE_integer("batch", 8, "sequences")
flags.DEFINE_integer("prompt", 256, "prompt tokens")
flags.DEFINE_integer("length", 1024, "tokens per sequence for the log-prob gradient")
flags.DEFINE_string("quant", "nvfp4", "nvfp4 | nf4 | none")
flags.DEFINE_integer("rank", 32, "LoRA rank (all 7 linears)")
flags.DEFINE_bool("fuse", True, "q/k/v and gate/up as one matrix each (models.fuse_projections), as the trainer's "
                  "default model.fuse_projections; 4-bit codes in the order model.code_order='auto' picks")
F = flags.FLAGS


def _time(fn, *args, n=3):
  out = fn(*args)
  jax.block_until_ready(out)
  t0 = time.perf_counter()
  for _ in range(n):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / n * 1e3


def main(argv):
  del argv
  hf_cfg = json.load(open(F.config))
  hf_cfg["num_hidden_layers"] = F.layers
  cfg = models.ModelConfig.from_hf(hf_cfg, dtype="bfloat16")
  key = jax.random.key(0)
  base = models.init_params(cfg, key)
  if F.fuse:
    base = models.fuse_projections(base)
  base = models.quantize_base(base, F.quant)
  if F.quant == "nvfp4" and pallas_kernels.resolve_code_order("auto") == "decode":
    base = models.to_decode_order(base)
  shapes = cfg.linear_shapes()
  lora = {"layers": {"attn": {}, "mlp": {}}}
  for (g, n), (k, nn) in shapes.items():
    lora["layers"][g][n] = {"a": 0.01 * jnp.ones((cfg.num_layers, k, F.rank), jnp.float32),
                            "b": jnp.zeros((cfg.num_layers, F.rank, nn), jnp.float32)}
  B, P, T = F.batch, F.prompt, F.length
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, P)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))

  @jax.jit
  def prefill(base, lora, prompt):
    cache = models.init_cache(cfg, B, P + 64)
    h, cache = models.forward(cfg, base, prompt, pos, lora=lora, cache=cache, return_hidden=True)
    return models.lm_head_logits(cfg, base, h[:, -1]), cache

  @jax.jit
  def decode(base, lora, cache, tok):
    return models.forward(cfg, base, tok, jnp.full((B, 1), P, jnp.int32), lora=lora, cache=cache)

  toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32)
  tpos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

  @jax.jit
  def grad(base, lora):
    def loss(lo):
      lp, ent = models.token_logprobs(cfg, base, toks, tpos, lora=lo, remat=True)
      return jnp.mean(lp) + 0.01 * jnp.mean(ent)
    return jax.value_and_grad(loss)(lora)

  _, cache = prefill(base, lora, prompt)
  rows = [("prefill", B * P, _time(prefill, base, lora, prompt)),
          ("decode step", B, _time(decode, base, lora, cache, prompt[:, :1])),
          ("logprob grad", B * T, _time(grad, base, lora, n=2))]
  dev = jax.devices()[0]
  stats = dev.memory_stats() or {}
  print(f"\n{cfg.architecture} D={cfg.hidden_size} L={cfg.num_layers} quant={F.quant} rank={F.rank} fuse={F.fuse} "
        f"BF16_EPILOGUE={layers.BF16_EPILOGUE} on {dev.device_kind}; "
        f"peak device memory {stats.get('peak_bytes_in_use', 0) / 2**30:.1f} GiB")
  print(f"{'op':>13} | {'tokens':>7} | {'ms':>9} | {'ms / layer':>10}")
  for name, ntok, ms in rows:
    print(f"{name:>13} | {ntok:7d} | {ms:9.2f} | {ms / cfg.num_layers:10.2f}")


if __name__ == "__main__":
  app.run(main)
