r"""Evaluate a base model or a trained checkpoint on GSM8K test, MATH-500, AIME24 and AMC23, or on the
recipe's own held-out set.

  # the base model of a recipe (no LoRA), greedy pass@1 on every benchmark
  python experiments/eval.py --config=configs/gsm8k_qwen2_5_7b.py
  # a training run's newest checkpoint, plus pass@8 with sampling at temperature 0.6
  python experiments/eval.py --config=configs/gsm8k_qwen2_5_7b.py --workdir=workdirs/gsm8k_7b \
      --num_samples=8 --temperature=0.6 --benchmarks=gsm8k
  # the main job's run (embedded tiny model, CPU, no download): its held-out synthetic set
  python experiments/eval.py --config=configs/default.py --workdir=workdirs/default --num_samples=8

``--benchmarks=heldout`` is the recipe's own held-out set (``data.eval``, the first ``data.eval_size``
prompts, scored with ``data.task``'s check): what the trainer's held-out accuracy measures. It is the
default for a recipe whose ``data.eval`` is the embedded model's synthetic task (``configs/default.py``);
otherwise the default is the four benchmarks.

The model, quantization, LoRA shape and system prompt come from the config
(``--config.<key>=value`` overrides work as in train.py); a checkpoint whose saved config built
a different base (``model.*``) gets a warning naming the flag that matches it. Prompts longer
than ``--max_prompt_length`` are skipped (for ``heldout``, unless the flag is given, the recipe's
``data.max_prompt_length``, as in training). Benchmarks are read from
``--data_dir`` (default ``../shared/data``): ``<name>/test.jsonl``. GSM8K is scored with the
GSM8K answer check, the others with math-verify. Prints a table and writes
``<workdir or --out>/eval_<step>.json``.

Without ``--workdir`` the base model runs with LoRA off. The trainer's step-0 evaluation instead runs its
zero-initialized adapter (B = 0) and trained norms. The adapter's delta is exactly zero, but the decode path
rounds differently with it in bf16: log-probs differ by up to about 0.03 nats, and either path is as close to
the training forward as the other. So greedy answers on near-ties can differ. For the main job
(``configs/default.py``) 2 of the 100 held-out completions differ. One of them flips from wrong to right, so the
base scores 0.37 against the trainer's initial 0.38.

On a GPU running the Gluon decode kernel the default ``model.code_order="auto"`` stores the NVFP4 codes
in that kernel's order, which makes the decode steps faster (7B: by 4.6 percent at batch 8) at no cost to the result.
"""

from __future__ import annotations

import json
import os
import sys

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
# transformers warns at import that PyTorch is absent; the project never needs PyTorch.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from qerl_jax import train_config, xla_flags  # noqa: E402

BENCHMARKS = {"gsm8k": "gsm8k", "math500": "math", "aime24": "math", "amc23": "math"}
HELDOUT = "heldout"  # the config's data.eval set, scored with its data.task

_CONFIG = config_flags.DEFINE_config_file("config", None, "Recipe config file (configs/<name>.py).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Training run folder; its newest checkpoint is evaluated. "
                               "Omit to evaluate the base model (LoRA off).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step to evaluate (default: the newest); needs --workdir.")
_BENCH = flags.DEFINE_list("benchmarks", None, f"Subset of {[*BENCHMARKS, HELDOUT]} ({HELDOUT}: the config's "
                           "data.eval set). Default: heldout for a config whose data.eval is a synthetic: set "
                           "(configs/default.py), else the four benchmarks.")
_DATA_DIR = flags.DEFINE_string("data_dir", os.path.join(_ROOT, "..", "shared", "data"),
                                "Folder with <benchmark>/test.jsonl.")
_LIMIT = flags.DEFINE_integer("limit", 0, "Evaluate only the first N prompts of each benchmark (0: all).")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 1, "k of pass@k; 1 = greedy pass@1 only.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.6, "Sampling temperature for pass@k (k > 1).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 0, "Completion budget (0: the config's).")
_BATCH = flags.DEFINE_integer("batch_size", 0, "Prompts per generate call (0: config.train.eval_batch_size).")
_OUT = flags.DEFINE_string("out", None, "Folder for eval_<step>.json (default: --workdir or cwd).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the pass@k sampling.")
_MAX_PROMPT = flags.DEFINE_integer("max_prompt_length", 1024, "Prompts longer than this (tokens) are skipped and "
                                   "counted (default: 1024, or less when the tokenizer's model_max_length "
                                   "minus the completion budget is smaller; for heldout, the config's "
                                   "data.max_prompt_length unless this flag is given).")
_XLA = xla_flags.define_launcher_flag()
flags.mark_flags_as_required(["config"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected positional arguments: {argv[1:]}")
  xla_flags.apply_recommended(_XLA.value)  # before the first computation: XLA reads XLA_FLAGS once
  import jax
  from absl import logging
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
  from qerl_jax import data as data_lib
  from qerl_jax import metrics as metrics_lib
  from qerl_jax import trainer

  try:
    config = _CONFIG.value
    config_task, user_template = str(config.data.task), str(config.data.user_template)  # reads the file
  except OSError as e:  # ml_collections could not load the config file
    print(train_config.config_load_error(e), file=sys.stderr)
    return 2
  try:  # the recipe's own checks (lora.rank=0 failed only after the model loaded); its data paths may be absent
    train_config.validate(config, check_paths=False)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  import math
  for name, value, ok, why in (
      ("batch_size", _BATCH.value, _BATCH.value >= 0, ">= 0 (0: config.train.eval_batch_size)"),
      ("max_new_tokens", _MAX_NEW.value, _MAX_NEW.value >= 0, ">= 0 (0: the config's)"),
      ("temperature", _TEMPERATURE.value, math.isfinite(_TEMPERATURE.value) and _TEMPERATURE.value >= 0,
       "a finite number >= 0"),
      ("max_prompt_length", _MAX_PROMPT.value, _MAX_PROMPT.value >= 1, ">= 1")):
    if not ok:
      raise app.UsageError(f"--{name}={value} must be {why}")
  out_dir = _OUT.value or _WORKDIR.value or os.getcwd()
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):  # found after the whole evaluation before
    raise app.UsageError(f"--out={out_dir} is a file; eval_<step>.json goes into a folder")
  heldout_spec = str(config.data.eval or "")
  benchmarks = _BENCH.value or ([HELDOUT] if heldout_spec.startswith("synthetic:") else list(BENCHMARKS))
  bad = [b for b in benchmarks if b not in BENCHMARKS and b != HELDOUT]
  if bad:
    raise app.UsageError(f"unknown benchmark(s) {bad}; choose from {[*BENCHMARKS, HELDOUT]}")
  if HELDOUT in benchmarks and not heldout_spec:
    raise app.UsageError(f"--benchmarks={HELDOUT} needs the config's data.eval (it is empty)")
  if _NUM_SAMPLES.value < 1:
    raise app.UsageError(f"--num_samples={_NUM_SAMPLES.value} must be >= 1")
  paths = {b: heldout_spec if b == HELDOUT else os.path.join(_DATA_DIR.value, b, "test.jsonl") for b in benchmarks}
  missing = [p for p in paths.values() if not p.startswith(("synthetic:", "hub:")) and not os.path.isfile(p)]
  if missing:  # checked before the model loads
    print(
        f"error: benchmark data not found: {missing}. --data_dir (now {_DATA_DIR.value!r}) must hold "
        f"<benchmark>/test.jsonl files: JSON lines with 'question' and 'answer' ('#### <number>') "
        f"for gsm8k, 'problem' and 'answer' for math500, aime24 and amc23. The repository ships "
        f"none; GSM8K and MATH-500 are on the Hugging Face hub (openai/gsm8k, "
        f"HuggingFaceH4/MATH-500). Choose a subset with --benchmarks ({HELDOUT}: the config's own "
        f"held-out set, data.eval).", file=sys.stderr)
    return 2
  if _STEP.value is not None and not _WORKDIR.value:
    raise app.UsageError(f"--step={_STEP.value} needs --workdir (without it the base model is evaluated)")
  if _LIMIT.value < 0:
    raise app.UsageError(f"--limit={_LIMIT.value} must be >= 0 (0: all prompts)")
  if _WORKDIR.value:  # checked before the model loads; read-only, so a missing folder is not created
    from qerl_jax import checkpoint as ckpt_lib
    ckpt_dir = os.path.join(_WORKDIR.value, "checkpoints")
    ckpt = ckpt_lib.Checkpointer(ckpt_dir, read_only=True)
    steps, incomplete = ckpt.all_steps(), ckpt.incomplete_steps()
    ckpt.close()
    if not steps or (_STEP.value is not None and _STEP.value not in steps):
      wanted = "a checkpoint" if _STEP.value is None else f"the checkpoint of step {_STEP.value}"
      print(f"error: {wanted} not found under {ckpt_dir!r} (complete checkpoints: {steps or 'none'}). "
            f"--workdir is the folder a training run wrote (it holds checkpoints/<step>); omit it to "
            f"evaluate the base model.", file=sys.stderr)
      return 2
  policy = trainer.load_policy(config)
  params, step = None, "base"
  if _WORKDIR.value:
    state, meta = trainer.restore_train_state(config, policy, _WORKDIR.value, step=_STEP.value)
    params, step = state.params, int(meta["step"])
    skipped = [s for s in incomplete if s > step]
    if _STEP.value is None and skipped:  # the newest folder(s) lack state/ or meta/: say which step is scored
      print(f"warning: checkpoints/{skipped} are incomplete (no state/ or meta/); evaluating step {step}, the newest "
            "complete one", file=sys.stderr)
    for key, saved, now in trainer.checkpoint_config_mismatch(meta, config):
      print(f"warning: the checkpoint was trained with {key}={saved!r} but --config gives {now!r}: the "
            f"adapter sits on a different base; pass --config.{key}={saved} to evaluate the run as trained",
            file=sys.stderr)
  max_new = _MAX_NEW.value or int(config.train.eval_max_completion_length
                                  or config.sampling.max_completion_length)
  max_prompt, max_prompt_given = _MAX_PROMPT.value, flags.FLAGS["max_prompt_length"].present
  context = int(getattr(policy.tokenizer, "model_max_length", 0) or 0)
  if (not max_prompt_given and 0 < context < 10 ** 7
      and context - max_new >= 16 and context - max_new < max_prompt):
    max_prompt = context - max_new  # prompt + completion fit the model's context
    if any(b != HELDOUT for b in benchmarks):  # the held-out set keeps the recipe's limit
      print(f"eval: prompts longer than {max_prompt} tokens are skipped (the tokenizer's context of "
            f"{context} minus {max_new} new tokens; --max_prompt_length overrides)", file=sys.stderr)
  recipe_max_prompt = int(config.data.max_prompt_length)
  batch = _BATCH.value or int(config.train.eval_batch_size)
  results, rows = {}, []
  for name in benchmarks:
    task = config_task if name == HELDOUT else BENCHMARKS[name]
    path = paths[name]
    # The held-out set keeps the recipe's prompt limit and padded length unless --max_prompt_length is given,
    # so that its greedy completions are the trainer's (a different padded length can flip a near-tie in bf16).
    as_trainer = name == HELDOUT and not max_prompt_given
    with config.unlocked():  # the recipe's instruction for its own task, the standard one otherwise
      config.data.user_template = (user_template if task == config_task else
                                   {"gsm8k": data_lib.GSM8K_USER_TEMPLATE,
                                    "math": data_lib.MATH_USER_TEMPLATE}[task])
      config.data.max_prompt_length = recipe_max_prompt if as_trainer else max_prompt
    try:
      examples = trainer.load_prompts(path, task, policy.tokenizer, config)
    except (OSError, ValueError) as e:  # e.g. a data.eval file that is not there
      print(f"error: {name}: {e}", file=sys.stderr)
      return 2
    if name == HELDOUT and int(config.data.eval_size):
      examples = examples[:int(config.data.eval_size)]  # as the trainer's held-out evaluation
    if _LIMIT.value:
      examples = examples[:_LIMIT.value]
    correctness = trainer.make_reward_fns(config, task=task)[0]
    res = {"num_prompts": len(examples)}
    plen = recipe_max_prompt if as_trainer else max(
        len(policy.tokenizer(e.text, add_special_tokens=False)["input_ids"])
        for e in examples)  # one compiled shape per benchmark
    greedy = trainer.evaluate(policy, params, examples, correctness, batch_size=batch,
                              max_new_tokens=max_new, prompt_length=plen, progress=f"{name} greedy")
    res["pass@1_greedy"] = greedy["accuracy"]
    res["mean_length_greedy"] = greedy["mean_length"]
    rows.append((f"{name} pass@1 (greedy)", greedy["accuracy"]))
    k = _NUM_SAMPLES.value
    if k > 1:
      sampled = trainer.evaluate(policy, params, examples, correctness, batch_size=batch,
                                 max_new_tokens=max_new, num_samples=k,
                                 temperature=_TEMPERATURE.value,
                                 key=jax.random.PRNGKey(_SEED.value), prompt_length=plen,
                                 progress=f"{name} pass@{k}")
      res[f"pass@{k}"] = sampled["accuracy"]
      res[f"mean@{k}"] = sampled["sample_accuracy"]
      rows.append((f"{name} pass@{k} (T={_TEMPERATURE.value})", sampled["accuracy"]))
      rows.append((f"{name} mean@{k}", sampled["sample_accuracy"]))
    results[name] = res
  print(metrics_lib.format_summary_table(rows))
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, f"eval_{step}.json")
  with open(path, "w") as f:
    json.dump({"step": step, "model": config.model.path, "results": results}, f, indent=2)
  print(path)
  return 0


if __name__ == "__main__":
  app.run(main, flags_parser=train_config.config_flags_parser())
