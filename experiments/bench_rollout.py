"""Rollout throughput of qerl_jax.sampling.generate: bf16 vs NVFP4 weights, decode step time vs roofline.

Random weights at the Qwen2.5-7B shape (no checkpoint), prompts of 256 random
tokens, a fixed number of new tokens (``early_stop=False``: every row decodes
every step), temperature-1 sampling. For each weight format and batch size:

* tokens/s = batch * new_tokens / (prefill + decode wall time), from one timed
  run of the AOT-compiled ``generate`` body (compile time reported apart);
  no row ever ends (the end id is outside the vocabulary), so every row
  decodes exactly ``new_tokens`` tokens, through the early-stop while loop RL uses;
* decode step time = (total - prefill) / (new_tokens - 1), "prefill" timed by
  the same executable with no live row (the loop exits at once: prefill,
  cache set-up and the first sample);
* roofline step time = bytes read per decode step / measured HBM bandwidth,
  bytes = decoder weights + lm_head (+ the adapter as decode reads it: bf16,
  regrouped for a fused base) + the KV cache. Two KV figures: "ideal"
  counts the valid slots on average (prompt + new_tokens / 2), "as run"
  counts every preallocated slot (the decode attention reads the whole
  cache, masked). HBM bandwidth is measured in the same run by a large
  device copy (bytes read + bytes written).

Usage (on the H200)::

  python experiments/bench_rollout.py --smoke            # correctness at a tiny shape, then exit
  python experiments/bench_rollout.py --batches=8,64,256 --new_tokens=2048 --out=/tmp/rollout.md

Prints a markdown table (and writes it, plus JSON, under ``--out``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from absl import app, flags

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from qerl_jax import lora as lora_lib
from qerl_jax import models, sampling, xla_flags

FLAGS = flags.FLAGS
_XLA = xla_flags.define_launcher_flag()  # the bf16 baseline as the launchers run it (cuBLAS)
flags.DEFINE_list("batches", ["8", "64", "256"], "Batch sizes (prompts; num_generations = 1). A batch that is "
                  "not a power of two runs padded to the next one, as sampling.generate buckets it; tokens/s "
                  "counts its own rows.")
flags.DEFINE_list("formats", ["bf16_fused", "nvfp4_fused"], "Weight formats of the decoder linears: bf16, "
                  "nvfp4, bf16_fused, nvfp4_fused (q/k/v and gate/up fused, models.fuse_projections: "
                  "the trainer's default, model.fuse_projections=True).")
flags.DEFINE_integer("prompt_len", 256, "Prompt tokens per row.")
flags.DEFINE_integer("new_tokens", 2048, "New tokens per row (fixed: no early stop).")
flags.DEFINE_list("new_tokens_by_batch", [], "Overrides 'batch:new_tokens', e.g. 256:1024 (to fit device time).")
flags.DEFINE_integer("kv_phases", 1, "SamplingConfig.kv_phases for the table's runs.")
flags.DEFINE_bool("unroll_decode", True, "SamplingConfig.unroll_decode: unroll the decode step's layer loop "
                  "(--nounroll_decode: the scanned loop, labelled '+scanned').")
flags.DEFINE_list("extra_runs", [], "Extra runs 'format:batch:kv_phases' after the table, e.g. bf16:256:4.")
flags.DEFINE_enum("code_order", "auto", ["standard", "decode", "auto"], "NVFP4 code order of the base, as "
                  "the trainer's model.code_order (default auto): decode = models.to_decode_order, the Gluon "
                  "decode kernel's cheaper E2M1 decode; auto = decode where pallas_kernels.decode_order_applies().")
flags.DEFINE_float("time_budget_s", 1e9, "Skip the remaining runs once this much wall time has passed.")
flags.DEFINE_string("out", "", "Folder for rollout.md / rollout.json (optional).")
flags.DEFINE_integer("lora_rank", 0, "Attach a LoRA adapter of this rank to all 7 linears and train-style norms "
                     "(what a training rollout runs; 0: none, the base alone).")
flags.DEFINE_integer("dequantize_min_rows", 0, "SamplingConfig.dequantize_min_rows: rollouts of at least this many "
                     "rows run on a bf16 copy of a 4-bit base made once per rollout (0: never).")
flags.DEFINE_integer("dequantize_max_weights", 0, "SamplingConfig.dequantize_max_weights: with --dequantize_min_rows, "
                     "copy only the linears of at most this many weights a layer (0: all; 20000000: the 7B's q/k/v "
                     "and o).")
flags.DEFINE_bool("aqn", False, "Fold AQN noise into the RMSNorm weights, as a training rollout does.")
flags.DEFINE_bool("smoke", False, "Tiny-shape correctness checks on this device, then exit.")
flags.DEFINE_enum("shape", "qwen2.5-7b", ["qwen2.5-7b", "tiny"], "Model shape (tiny: to try the script on CPU).")
flags.DEFINE_bool("smoke_first", False, "Run the smoke checks, then the benchmark.")

QWEN25_7B = dict(architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                 num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                 rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)
TINY = dict(QWEN25_7B, vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


def kernel_backend() -> str:
  """Which 4-bit matmul paths ``quantized_matmul(backend="auto")`` takes for bf16 activations on this device."""
  from pallas_kernels import matmul, w4_gluon
  if jax.default_backend() not in ("gpu", "cuda"):
    return "reference (pallas_kernels XLA path: dequantize to bf16, then dot)"
  if matmul.gluon_enabled():
    return (f"gluon decode GEMV (pallas_kernels.w4_gluon, launch {w4_gluon.launcher()}) for M <= "
            f"{w4_gluon.max_rows()}, Pallas dequantize + cuBLAS above")
  return "pallas (pallas_kernels fused W4A16 Triton kernels, backend='auto')"


def hbm_bandwidth(gib: float = 4.0, iters: int = 5) -> float:
  """Measured device-copy bandwidth in bytes/s (bytes read + written by one elementwise kernel over
  ``gib`` GiB of bf16), median of ``iters`` runs. On a GPU each run is the kernel's device time
  (experiments/devtime.py): wall-clock timing also counted the 4 GiB output's allocation and the host
  round trip, which read 2.7-2.8 TB/s on an H200 in session 10 and put a bf16 decode step above 100%
  of its roofline. On a CPU, wall-clock time."""
  import devtime

  n = int(gib * 2**30) // 2
  x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
  f = jax.jit(lambda a: a * jnp.bfloat16(1.5))
  f(x).block_until_ready()
  times = [devtime.device_time(f, x)]
  if times[0] is None:  # no device events (CPU): wall clock
    times = []
    for _ in range(iters):
      t0 = time.perf_counter()
      f(x).block_until_ready()
      times.append(time.perf_counter() - t0)
  else:
    times += [devtime.device_time(f, x) for _ in range(iters - 1)]
  del x
  return 2 * n * 2 / float(np.median(times))


def tree_bytes(tree) -> int:
  return int(sum(np.dtype(x.dtype).itemsize * x.size for x in jax.tree.leaves(tree)))


def weight_bytes_per_step(cfg, base, batch: int) -> int:
  """Bytes of parameters one decode step reads: decoder layers, final norm, lm_head, ``batch`` embedding rows."""
  head = base["lm_head"] if "lm_head" in base else base["embed"]
  return tree_bytes(base["layers"]) + tree_bytes(base["final_norm"]) + tree_bytes(head) + batch * cfg.hidden_size * 2


FORMATS = ("bf16", "nvfp4", "bf16_fused", "nvfp4_fused")


def make_base(cfg, fmt: str, bf16_base=None, code_order: str | None = None):
  """The random base of one format; ``*_fused`` stores q/k/v and gate/up fused (models.fuse_projections;
  for NVFP4 the fused float matrices are quantized, so each shares one global scale). ``code_order``
  (default ``--code_order`` where the flags are parsed, else ``"auto"``): ``"decode"`` puts the NVFP4
  codes in the decode kernel's order (models.to_decode_order); ``"auto"`` does so where
  ``pallas_kernels.decode_order_applies()``, as the trainer does (``pallas_kernels.resolve_code_order``)."""
  if code_order is None:
    code_order = FLAGS.code_order if FLAGS.is_parsed() else "auto"
  code_order = pallas_kernels.resolve_code_order(code_order)
  if fmt not in FORMATS:
    raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
  src = bf16_base if bf16_base is not None else models.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16)
  if fmt.endswith("_fused"):
    src = models.fuse_projections(src)
  if fmt.startswith("bf16"):
    return src
  q = jax.jit(lambda b: models.quantize_base(b, "nvfp4"))(src)
  if code_order == "decode":
    q = jax.jit(models.to_decode_order)(q)
  jax.block_until_ready(q)
  return q


def random_prompts(cfg, batch: int, length: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  return rng.integers(0, cfg.vocab_size, size=(batch, length)).astype(np.int32), np.ones((batch, length), np.int32)


def adapter_and_noise(cfg, base, rank: int, aqn: bool):
  """``(lora, lora_scale, noise)`` as a training rollout passes them: a rank-``rank`` adapter on all
  7 linears with trainable norms (float32, B random so nothing is skipped; None when rank is 0),
  and AQN norm noise (float32 ``[L, D]``; None unless ``aqn``)."""
  lora, scale = None, 1.0
  if rank:
    lcfg = lora_lib.LoRAConfig(r=rank, lora_alpha=float(rank), train_norms=True)
    lora = lora_lib.init_lora(jax.random.key(2), cfg, lcfg, base)
    lora = jax.tree.map(lambda a: a + 1e-3 * jax.random.normal(jax.random.key(a.size), a.shape, a.dtype), lora)
    scale = lora_lib.scale(lcfg)
  noise = None
  if aqn:
    noise = {k: 1e-3 * jax.random.normal(jax.random.key(i), (cfg.num_layers, cfg.hidden_size), jnp.float32)
             for i, k in enumerate(("input_norm", "post_attn_norm"))}
  return lora, scale, noise


def bench_one(cfg, base, batch: int, prompt_len: int, new_tokens: int, bandwidth: float, kv_phases: int = 1,
              lora=None, lora_scale: float = 1.0, noise=None, unroll_decode: bool = True,
              dequantize_min_rows: int = 0, dequantize_max_weights: int = 0) -> dict:
  """One compiled generate at (batch, prompt_len, new_tokens), timed twice: all rows live, and no row live.

  The end id is outside the vocabulary, so no row ever ends and the decode
  loop runs exactly ``new_tokens - 1`` steps (asserted) through the same
  early-stop while loop that RL uses. Calling the same executable with zero
  live prompts makes the loop exit at once: that run times prefill + cache
  set-up + the first sample, subtracted to get the decode step time. With
  ``dequantize_min_rows`` met, the dense copy of the base is made in both runs:
  it counts in tokens/s, not in the step time, and the roofline counts the
  copy's bytes (what a step then reads).
  """
  config = sampling.SamplingConfig(max_new_tokens=new_tokens, eos_token_ids=(cfg.vocab_size + 1,), pad_id=0,
                                   temperature=1.0, kv_phases=kv_phases, unroll_decode=unroll_decode,
                                   dequantize_min_rows=dequantize_min_rows,
                                   dequantize_max_weights=dequantize_max_weights)
  tokens_np, mask_np = random_prompts(cfg, batch, prompt_len)
  bb, pb = sampling.bucket(batch), sampling.bucket(prompt_len, 16)
  tokens_np, mask_np = sampling.pad_prompts(tokens_np, mask_np, bb, pb, config.pad_id)
  tokens, mask = jnp.asarray(tokens_np), jnp.asarray(mask_np)
  key = jax.random.key(1)

  t0 = time.perf_counter()
  compiled = sampling._generate_jit.lower(cfg, config, lora_scale, base, lora, noise, tokens, mask, key,
                                          jnp.int32(batch)).compile()
  t_compile = time.perf_counter() - t0
  run = lambda live: jax.block_until_ready(compiled(base, lora, noise, tokens, mask, key, jnp.int32(live)))

  pre = run(0)  # warm-up; the loop exits at once
  assert int(pre[6]) == 0, int(pre[6])
  pre_times = []
  for _ in range(2 if batch <= 64 else 1):
    t0 = time.perf_counter()
    run(0)
    pre_times.append(time.perf_counter() - t0)
  t_prefill = float(np.median(pre_times))

  t0 = time.perf_counter()
  out = run(batch)
  t_total = time.perf_counter() - t0
  # the batch's own rows; a batch that is not a power of two runs padded to its bucket, and those rows hold pad
  toks, lp, live_mask = (np.asarray(a)[:batch] for a in (out[0], out[1], out[3]))
  steps = int(out[6])
  assert steps == new_tokens - 1, steps
  assert toks.min() >= 0 and toks.max() < cfg.vocab_size and np.isfinite(lp).all() and live_mask.all()
  del out, pre

  step = (t_total - t_prefill) / (new_tokens - 1)
  # adapters too, as decode reads them: cast to the compute dtype once per rollout (and regrouped for a
  # fused base, block-diagonal b included), not the float32 training copy
  adapter = sampling._decode_adapter(cfg, base, lora) if lora is not None else None
  dense_copy = config.dequantizes(bb) and sampling.dequantized_base_bytes(base, cfg.dtype, dequantize_max_weights) > 0
  read = base  # what a decode step reads: with the dense copy (of every linear or of the small ones), its shapes
  if dense_copy:
    read = jax.eval_shape(lambda b: models.dequantize_base(b, jnp.dtype(cfg.dtype),
                                                           max_weights=dequantize_max_weights), base)
  w_bytes = weight_bytes_per_step(cfg, read, bb) + (tree_bytes(adapter) if adapter is not None else 0)
  slots_run = pb + new_tokens
  kv_per_slot = 2 * cfg.num_layers * bb * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(config.cache_dtype).itemsize
  ends = (0,) + config.phase_ends()  # slots each step's attention reads: prompt bucket + the phase's end
  kv_run = kv_per_slot * (pb + sum((e - s) * e for s, e in zip(ends[:-1], ends[1:])) / new_tokens)
  kv_ideal = kv_per_slot * (prompt_len + new_tokens / 2)
  return dict(batch=batch, new_tokens=new_tokens, kv_phases=kv_phases, dense_copy=dense_copy, compile_s=t_compile, prefill_s=t_prefill, total_s=t_total,
              tokens_per_s=batch * new_tokens / t_total, decode_tokens_per_s=batch * (new_tokens - 1) / (t_total - t_prefill),
              step_ms=1e3 * step, weight_gb=w_bytes / 1e9, kv_cache_gb=sampling.kv_cache_bytes(cfg, bb, slots_run) / 1e9,
              roofline_ideal_ms=1e3 * (w_bytes + kv_ideal) / bandwidth, roofline_run_ms=1e3 * (w_bytes + kv_run) / bandwidth)


def _smoke_prompts(vocab: int):
  rng = np.random.default_rng(0)
  lengths = [7, 16, 3, 12]
  toks = np.zeros((4, 16), np.int32)
  mask = np.zeros((4, 16), np.int32)
  for i, n in enumerate(lengths):
    toks[i, 16 - n:] = rng.integers(0, vocab, n)
    mask[i, 16 - n:] = 1
  return toks, mask, lengths


def _logprob_gap(cfg, base, ro) -> float:
  """max |rollout logprobs - one full forward over prompt + completion| on the completion mask."""
  seq = jnp.concatenate([ro.prompt_tokens, ro.tokens], 1)
  m = jnp.concatenate([ro.prompt_mask, ro.mask], 1)
  lp, _ = models.token_logprobs(cfg, base, seq, models.positions_from_mask(m), attn_mask=m, remat=False)
  p = ro.prompt_tokens.shape[1]
  return float(jnp.max(jnp.abs((lp[:, p:] - ro.logprobs) * ro.mask)))


def smoke() -> None:
  """Tiny NVFP4 model on this device.

  float32 at highest matmul precision (XLA reference matmul): greedy batched
  == each row alone, logprobs == full forward (1e-4). bf16 (the Pallas kernel
  path on a GPU): logprobs within bf16 noise of the full forward.
  """
  warm = sampling.SamplingConfig(max_new_tokens=16, eos_token_ids=(5,), pad_id=0, temperature=1.0,
                                 num_generations=2, cache_dtype=jnp.float32)
  with jax.default_matmul_precision("highest"):
    cfg = models.ModelConfig.from_hf(TINY, dtype="float32")
    base = models.quantize_base(models.init_params(cfg, jax.random.key(0), dtype=jnp.float32, std=0.1), "nvfp4")
    toks, mask, lengths = _smoke_prompts(cfg.vocab_size)
    greedy = sampling.SamplingConfig(max_new_tokens=16, eos_token_ids=(5,), pad_id=0, temperature=0.0,
                                     cache_dtype=jnp.float32)
    ro = sampling.generate(cfg, base, toks, mask, jax.random.key(0), greedy)
    for i, n in enumerate(lengths):
      alone = sampling.generate(cfg, base, toks[i:i + 1, 16 - n:], mask[i:i + 1, 16 - n:], jax.random.key(0), greedy)
      np.testing.assert_array_equal(np.asarray(alone.tokens[0]), np.asarray(ro.tokens[i]))
    err = _logprob_gap(cfg, base, sampling.generate(cfg, base, toks, mask, jax.random.key(1), warm))
    print(f"smoke float32 nvfp4: greedy batched == alone for {len(lengths)} rows; |logprobs - full forward| "
          f"max {err:.2e}", flush=True)
    assert err < 1e-4, err
  cfg = models.ModelConfig.from_hf(TINY, dtype="bfloat16")
  base = models.quantize_base(models.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16, std=0.1), "nvfp4")
  err = _logprob_gap(cfg, base, sampling.generate(cfg, base, toks, mask, jax.random.key(1),
                                                  dataclasses.replace(warm, cache_dtype=jnp.bfloat16)))
  print(f"smoke bf16 nvfp4 ({kernel_backend()}): |logprobs - full forward| max {err:.2e}", flush=True)
  assert err < 0.25, err


def _suffix() -> str:
  """The table label's note on what rides along: '+lora32', '+aqn', '+scanned' (the decode step's layer loop
  not unrolled)."""
  return ((f"+lora{FLAGS.lora_rank}" if FLAGS.lora_rank else "") + ("+aqn" if FLAGS.aqn else "")
          + ("" if FLAGS.unroll_decode else "+scanned"))


def main(argv):
  del argv
  xla_flags.apply_recommended(_XLA.value)  # before the first computation: XLA reads XLA_FLAGS once
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; 4-bit matmul: {kernel_backend()}", flush=True)
  if not FLAGS.smoke and FLAGS.shape == "qwen2.5-7b" and jax.default_backend() not in ("gpu", "cuda"):
    # 7B-shape weights (15 GB in bf16) and a 4 GiB copy: hours on a CPU, or out of memory
    print(f"error: the qwen2.5-7b shape needs a GPU (JAX's backend here is {jax.default_backend()}); on a CPU use "
          "--shape=tiny (e.g. --shape=tiny --batches=2 --new_tokens=8 --prompt_len=8) or --smoke", file=sys.stderr)
    sys.exit(2)
  if FLAGS.smoke or FLAGS.smoke_first:
    smoke()
    if FLAGS.smoke:
      return
  start = time.perf_counter()
  bandwidth = hbm_bandwidth(4.0 if FLAGS.shape == "qwen2.5-7b" else 0.25)
  print(f"measured device copy bandwidth: {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
  cfg = models.ModelConfig.from_hf(QWEN25_7B if FLAGS.shape == "qwen2.5-7b" else TINY, dtype="bfloat16")
  overrides = {int(k): int(v) for k, v in (s.split(":") for s in FLAGS.new_tokens_by_batch)}
  bases, extras = {}, {}
  bf16 = make_base(cfg, "bf16")
  for fmt in FLAGS.formats:
    t0 = time.perf_counter()
    bases[fmt] = bf16 if fmt == "bf16" else make_base(cfg, fmt, bf16)
    extras[fmt] = adapter_and_noise(cfg, bases[fmt], FLAGS.lora_rank, FLAGS.aqn)  # (lora, scale, noise)
    print(f"{fmt} base ready in {time.perf_counter() - t0:.1f}s: decoder linears + lm_head "
          f"{weight_bytes_per_step(cfg, bases[fmt], 0) / 1e9:.2f} GB", flush=True)
  if "bf16" not in FLAGS.formats:
    del bf16
  rows = []
  header = ("| weights | batch | new tokens | KV phases | tokens/s | decode tokens/s | step ms | roofline ms (ideal KV) | "
            "% of roofline | roofline ms (KV as run) | prefill s | compile s | KV cache GB |")
  sep = "|" + "---|" * 13
  for batch in (int(b) for b in FLAGS.batches):
    for fmt in FLAGS.formats:
      if time.perf_counter() - start > FLAGS.time_budget_s:
        print(f"skipping {fmt} batch {batch}: time budget {FLAGS.time_budget_s}s spent", flush=True)
        continue
      r = bench_one(cfg, bases[fmt], batch, FLAGS.prompt_len, overrides.get(batch, FLAGS.new_tokens), bandwidth,
                    FLAGS.kv_phases, *extras[fmt], unroll_decode=FLAGS.unroll_decode,
                    dequantize_min_rows=FLAGS.dequantize_min_rows,
                    dequantize_max_weights=FLAGS.dequantize_max_weights)
      r["format"] = fmt + _suffix()
      rows.append(r)
      print(json.dumps(r), flush=True)
  for spec in FLAGS.extra_runs:
    fmt, batch, phases = spec.split(":")
    if time.perf_counter() - start > FLAGS.time_budget_s:
      print(f"skipping extra run {spec}: time budget {FLAGS.time_budget_s}s spent", flush=True)
      continue
    batch = int(batch)
    r = bench_one(cfg, bases[fmt], batch, FLAGS.prompt_len, overrides.get(batch, FLAGS.new_tokens), bandwidth,
                  int(phases), *extras[fmt], unroll_decode=FLAGS.unroll_decode,
                  dequantize_min_rows=FLAGS.dequantize_min_rows,
                  dequantize_max_weights=FLAGS.dequantize_max_weights)
    r["format"] = fmt + _suffix()
    rows.append(r)
    print(json.dumps(r), flush=True)
  lines = [header, sep]
  for r in rows:
    lines.append(f"| {r['format']}{' (bf16 copy)' if r['dense_copy'] else ''} | {r['batch']} | {r['new_tokens']} | {r['kv_phases']} | {r['tokens_per_s']:.0f} | "
                 f"{r['decode_tokens_per_s']:.0f} | {r['step_ms']:.3f} | {r['roofline_ideal_ms']:.3f} | "
                 f"{100 * r['roofline_ideal_ms'] / r['step_ms']:.1f}% | {r['roofline_run_ms']:.2f} | "
                 f"{r['prefill_s']:.3f} | {r['compile_s']:.1f} | {r['kv_cache_gb']:.1f} |")
  by = {(r["format"], r["batch"]): r for r in rows if r["kv_phases"] == FLAGS.kv_phases}
  for batch in sorted({r["batch"] for r in rows}):
    extra = _suffix()
    for fused in ("", "_fused"):
      q4, b16 = by.get(("nvfp4" + fused + extra, batch)), by.get(("bf16" + fused + extra, batch))
      if q4 and b16:
        label = ((" (fused projections)" if fused else "") + (f" with {extra[1:]}" if extra else "")
                 + (", NVFP4 on its bf16 copy" if q4["dense_copy"] else ""))
        lines.append(f"\nbatch {batch}{label}: NVFP4 / bf16 throughput = "
                     f"{q4['tokens_per_s'] / b16['tokens_per_s']:.2f}x")
  table = "\n".join(lines)
  print(f"\nHBM copy bandwidth {bandwidth / 1e12:.2f} TB/s; 4-bit matmul: {kernel_backend()}\n{table}")
  if FLAGS.out:
    os.makedirs(FLAGS.out, exist_ok=True)
    with open(os.path.join(FLAGS.out, "rollout.md"), "w") as f:
      f.write(table + "\n")
    with open(os.path.join(FLAGS.out, "rollout.json"), "w") as f:
      json.dump(dict(bandwidth=bandwidth, backend=kernel_backend(), rows=rows), f, indent=1)


if __name__ == "__main__":
  app.run(main)
