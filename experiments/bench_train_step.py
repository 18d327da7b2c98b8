r"""Whole GRPO training steps of a recipe at a full model's size, on random weights: seconds a step by phase,
rollout tokens/s and peak device memory, for each base format (NVFP4, bf16, NF4) in its own process.

What runs is the trainer's own loop (``qerl_jax.trainer.train``) with the recipe's config: rollout of
``rl.batch_size`` completions (G per prompt, AQN noise and the LoRA adapter applied), reward, advantages,
the reference log-probs when ``rl.beta > 0``, and the optimizer update in micro-batches, with remat as
configured. Only the inputs are stand-ins, so that nothing is downloaded:

* the base: random weights at the Qwen2.5-7B or -32B shape (``--shape``), built, fused and quantized on
  the device a layer at a time (``model.fuse_projections`` and ``model.code_order`` apply as in training);
* the prompts: the embedded synthetic task's (``qerl_jax.synthetic``), tokenized by its small tokenizer and
  padded to ``data.max_prompt_length`` as the trainer pads every prompt batch;
* the end of a completion: an id outside the vocabulary, so every completion runs to
  ``sampling.max_completion_length`` (the worst case a step can take, the same for every format);
* the rewards: 0 or 1 at random (seeded), so that the advantages and the update are not zero.

Step 1 includes compilation; the table gives it apart and the median of the later steps. Peak memory is
the device's ``peak_bytes_in_use`` over the whole process (the base, the optimizer state, the rollout's KV
cache and the update's activations), as the trainer logs it (``perf/peak_memory_bytes``).

  # on a GPU: the 7B GSM8K recipe (64 completions of up to 2048 tokens a step), NVFP4 against bf16
  python experiments/bench_train_step.py --config=configs/gsm8k_qwen2_5_7b.py --steps=3
  # QeRL's headline: the 32B recipe on one GPU (8 completions a step)
  python experiments/bench_train_step.py --config=configs/gsm8k_qwen2_5_32b_single_gpu.py \
      --shape=qwen2.5-32b --quants=nvfp4
  # on a CPU, to try the script: a tiny shape and a short step
  python experiments/bench_train_step.py --shape=tiny --steps=2 --config.rl.batch_size=4 \
      --config.rl.num_generations=2 --config.rl.micro_batch_size=2 --config.sampling.max_completion_length=8

Prints a markdown table; ``--out`` also writes it and the per-step rows as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from qerl_jax import train_config, xla_flags  # noqa: E402

SHAPES = {
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4),
    "qwen2.5-32b": dict(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8),
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}

_CONFIG = config_flags.DEFINE_config_file("config", os.path.join(_ROOT, "configs", "gsm8k_qwen2_5_7b.py"),
                                          "Recipe config file (configs/<name>.py); --config.<key>=value overrides.")
_SHAPE = flags.DEFINE_enum("shape", "qwen2.5-7b", list(SHAPES), "Model shape of the random base (Qwen2 "
                           "architecture with q/k/v biases; tiny: to try the script on a CPU).")
_QUANTS = flags.DEFINE_list("quants", ["nvfp4", "none"], "Base formats (model.quant), each in its own process: "
                            "nvfp4, nf4, none (bf16).")
_STEPS = flags.DEFINE_integer("steps", 3, "Training steps a format (the first compiles).")
_OUT = flags.DEFINE_string("out", "", "Folder for train_step.md and train_step.json (optional).")
_ONE = flags.DEFINE_string("quant_one", "", "(internal) run this one format here and write its rows to --rows_json.")
_ROWS = flags.DEFINE_string("rows_json", "", "(internal) where --quant_one writes its result.")
_XLA = xla_flags.define_launcher_flag()


def random_pretrained(shape: str, quant: str, *, fuse: bool, seed: int = 0):
  """An :class:`qerl_jax.hf.Pretrained` of random weights at ``shape`` (bf16, fused when ``fuse``, in
  ``quant``), the synthetic task's tokenizer, and an end id outside the vocabulary (no completion ever ends
  early).

  Built a layer at a time (each layer initialized, fused and quantized in one jit, then written in place into
  the stacked layers), so that the build's own peak stays near the finished base: the whole bf16 model (65 GB
  at 32B) never exists, and the peak device memory the trainer reports is the training step's."""
  import dataclasses

  import jax
  import jax.numpy as jnp
  from qerl_jax import hf, models, synthetic
  cfg = models.ModelConfig.from_hf(dict(SHAPES[shape], architectures=["Qwen2ForCausalLM"], rms_norm_eps=1e-6,
                                        rope_theta=1e6, max_position_embeddings=32768,
                                        tie_word_embeddings=False), dtype="bfloat16")
  one = dataclasses.replace(cfg, num_layers=1)

  def build(key):  # a one-layer model: its layer (and, for the first call, the embeddings and head)
    base = models.init_params(one, key, dtype=jnp.bfloat16)
    if fuse:
      base = models.fuse_projections(base)
    return base if quant == "none" else models.quantize_base(base, quant)

  key = jax.random.key(seed)
  first = jax.jit(build)(key)
  layer = jax.jit(lambda k: build(k)["layers"])  # XLA drops the unused embeddings
  put = jax.jit(lambda full, part, i: jax.tree.map(
      lambda f, p: jax.lax.dynamic_update_slice_in_dim(f, p, i, 0), full, part), donate_argnums=0)
  layers = put(jax.tree.map(lambda x: jnp.zeros((cfg.num_layers, *x.shape[1:]), x.dtype), first["layers"]),
               first["layers"], 0)
  for i in range(1, cfg.num_layers):
    layers = put(layers, layer(jax.random.fold_in(key, i)), i)
  base = jax.block_until_ready({**first, "layers": layers})
  tok = synthetic.build_tokenizer(synthetic.training_texts(synthetic.make_split("train", 500)))
  if len(tok) > cfg.vocab_size:
    raise ValueError(f"shape {shape!r}: vocabulary {cfg.vocab_size} is smaller than the prompts' tokenizer's {len(tok)}")
  return hf.Pretrained(cfg, base, tok, {"eos_token_ids": [cfg.vocab_size]})


def run_one(config, quant: str, steps: int) -> dict:
  """Trains ``steps`` steps of ``config`` with a random ``quant`` base in a temporary folder; returns the
  logged rows of each step (``time/*``, ``perf/*``, ``completions/*``)."""
  import numpy as np
  from qerl_jax import trainer
  with config.unlocked():
    config.model.quant = quant
    config.model.path = f"random:{_SHAPE.value}"  # a label: the base comes from random_pretrained
    config.train.total_steps = steps
    config.train.eval_every = 0
    config.train.save_every = 10 ** 9
    config.train.plot = False
    config.data.eval = ""
    config.data.train = f"synthetic:train:{max(512, int(config.rl.batch_size) * steps)}:1"
  train_config.validate(config, check_paths=False)
  # Passed on, not kept: load_policy may rearrange the codes (model.code_order), and a reference held here
  # would keep the loaded order alive beside them for the whole run (32B: 18 GB).
  policy = trainer.load_policy(config, pretrained=random_pretrained(
      _SHAPE.value, quant, fuse=bool(config.model.fuse_projections), seed=int(config.seed)))
  rng = np.random.default_rng(0)

  def random_rewards(completions, answers):
    del answers
    return rng.integers(0, 2, len(completions)).astype(float).tolist()

  with tempfile.TemporaryDirectory(prefix="qerl-bench-train-") as workdir:
    trainer.train(config, workdir, policy=policy, reward_fns=(random_rewards, None))
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      rows = [json.loads(line) for line in f]
  keep = ("step", "time/step_s", "time/rollout_s", "time/update_s", "time/reference_s", "perf/tokens_per_s",
          "perf/peak_memory_bytes", "completions/mean_length", "sampling/sampling_logp_difference/mean",
          "sampling/sampling_logp_difference/max", "sampling/importance_sampling_ratio/min",
          "sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/max")
  return {"quant": quant, "rows": [{k: r[k] for k in keep if k in r} for r in rows if "time/step_s" in r]}


def table(results: list[dict], config) -> str:
  import numpy as np
  mismatch = any("sampling/sampling_logp_difference/mean" in r for res in results for r in res["rows"])
  corrected = any("sampling/importance_sampling_ratio/mean" in r for res in results for r in res["rows"])
  head = ("| base | step 1 s (compiles) | step s (median of later) | rollout s | update s | of which reference s "
          "| rollout tokens/s | mean completion tokens | peak device memory GiB |"
          + (" sampler vs trainer log p, mean / max abs nats |" if mismatch else "")
          + (" importance ratio (rl.rollout_correction) min / mean / max |" if corrected else "")
          + "\n|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if mismatch else "")
          + ("---:|" if corrected else ""))
  lines = [head]
  for res in results:
    rows = res["rows"]
    later = rows[1:] or rows
    med = lambda k: float(np.median([r[k] for r in later]))  # noqa: E731
    peak = max((r.get("perf/peak_memory_bytes", 0) for r in rows), default=0)
    lines.append(f"| {res['quant']} | {rows[0]['time/step_s']:.2f} | {med('time/step_s'):.2f} | "
                 f"{med('time/rollout_s'):.2f} | {med('time/update_s'):.2f} | "
                 + (f"{med('time/reference_s'):.2f}" if all("time/reference_s" in r for r in later) else "-")
                 + f" | {med('perf/tokens_per_s'):.0f} | "
                 f"{med('completions/mean_length'):.0f} | " + (f"{peak / 2 ** 30:.1f} |" if peak else "n/a |")
                 + (f" {med('sampling/sampling_logp_difference/mean'):.2e} / "
                    f"{max(r['sampling/sampling_logp_difference/max'] for r in rows):.2e} |" if mismatch else "")
                 + (f" {min(r['sampling/importance_sampling_ratio/min'] for r in rows):.3f} / "
                    f"{med('sampling/importance_sampling_ratio/mean'):.3f} / "
                    f"{max(r['sampling/importance_sampling_ratio/max'] for r in rows):.3f} |" if corrected else ""))
  r = config.rl
  return (f"{_SHAPE.value}, {r.batch_size} completions a step (G = {r.num_generations}, micro-batches of "
          f"{r.micro_batch_size}), up to {config.sampling.max_completion_length} new tokens, LoRA rank "
          f"{config.lora.rank}, AQN {'on' if config.aqn.enabled else 'off'}, beta {r.beta}\n\n" + "\n".join(lines))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected positional arguments: {argv[1:]}")
  xla_flags.apply_recommended(_XLA.value)
  from absl import logging
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
  try:
    config = _CONFIG.value
    config.rl.batch_size  # noqa: B018  (reads the file)
  except OSError as e:
    print(train_config.config_load_error(e), file=sys.stderr)
    return 2
  bad = [q for q in _QUANTS.value if q not in ("nvfp4", "nf4", "none")]
  if bad:
    raise app.UsageError(f"--quants: unknown format(s) {bad}; choose from nvfp4, nf4, none")
  if _STEPS.value < 1:
    raise app.UsageError(f"--steps={_STEPS.value} must be >= 1")
  import jax
  if _SHAPE.value != "tiny" and jax.default_backend() not in ("gpu", "cuda"):
    print(f"error: the {_SHAPE.value} shape needs a GPU (JAX's backend here is {jax.default_backend()}); on a "
          "CPU use --shape=tiny (see --help for a short step)", file=sys.stderr)
    return 2
  if _ONE.value:
    with open(_ROWS.value, "w") as f:
      json.dump(run_one(config, _ONE.value, _STEPS.value), f)
    return 0
  results = []
  with tempfile.TemporaryDirectory() as tmp:
    for quant in _QUANTS.value:  # one process a format: its own peak memory, nothing left from the last
      path = os.path.join(tmp, f"{quant}.json")
      print(f"== {quant}", file=sys.stderr, flush=True)
      r = subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:], f"--quant_one={quant}",
                          f"--rows_json={path}"])
      if r.returncode != 0 or not os.path.isfile(path):
        print(f"error: the {quant} run failed (exit {r.returncode}); its output is above", file=sys.stderr)
        return 1
      with open(path) as f:
        results.append(json.load(f))
  text = table(results, config)
  print(text)
  if _OUT.value:
    os.makedirs(_OUT.value, exist_ok=True)
    with open(os.path.join(_OUT.value, "train_step.md"), "w") as f:
      f.write(text + "\n")
    with open(os.path.join(_OUT.value, "train_step.json"), "w") as f:
      json.dump({"shape": _SHAPE.value, "config": json.loads(config.to_json_best_effort()), "results": results},
                f, indent=2)
  return 0


if __name__ == "__main__":
  app.run(main, flags_parser=train_config.config_flags_parser())
