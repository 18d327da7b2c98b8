"""Tests of the training job: loop, checkpoint/resume exactness, config validation, launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from qerl_jax import checkpoint as ckpt_lib
from qerl_jax import metrics as metrics_lib
from qerl_jax import train_config, trainer

sys.path.insert(0, os.path.dirname(__file__))
import _trainer_utils as toy  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def _deterministic(rows):
  """Metric rows without wall-time keys (the only ones that may differ between two runs)."""
  return [{k: v for k, v in r.items() if not k.startswith(metrics_lib.TIMING_KEYS)} for r in rows]


def _final_params(workdir, config, policy):
  return trainer.restore_train_state(config, policy, workdir)


def _toy_run(config, workdir, **kw):
  return trainer.train(config, workdir, policy=toy.toy_policy(config), datasets=toy.toy_datasets(),
                       reward_fns=(toy.contains_answer, toy.contains_answer), progress=False, **kw)


# ------------------------------------------------------------------------------ pure helpers

def test_batch_indices_is_a_seeded_permutation_per_epoch():
  n, p = 10, 4
  rows = [trainer.batch_indices(7, s, p, n)[0] for s in range(5)]  # 20 prompts = 2 epochs
  flat = np.concatenate(rows)
  np.testing.assert_array_equal(flat[:10], np.random.default_rng([7, 0]).permutation(10))
  np.testing.assert_array_equal(flat[10:], np.random.default_rng([7, 1]).permutation(10))
  idx, epoch, pos = trainer.batch_indices(7, 2, p, n)  # prompts 8..11 -> ends in epoch 1 at 2
  assert (epoch, pos) == (1, 2)


def test_step_keys_depend_only_on_seed_and_step():
  a, b, c = trainer.step_keys(3, 5), trainer.step_keys(3, 5), trainer.step_keys(3, 6)
  np.testing.assert_array_equal(a.sample, b.sample)
  assert not np.array_equal(a.sample, c.sample)
  assert not np.array_equal(a.sample, a.update)


def test_score_completions_missing_rewards_are_nan():
  def flaky(completions, answers):
    if len(completions) > 1:
      raise RuntimeError("batch failure")
    if completions[0] == "boom":
      raise ValueError("cannot parse")
    return [1.0 if completions[0] == answers[0] else 0.0]
  r, missing = trainer.score_completions(flaky, ["4", "boom", "5"], ["4", "4", "4"])
  assert missing == 1
  np.testing.assert_array_equal(np.isnan(r), [False, True, False])
  assert r[0] == 1.0 and r[2] == 0.0
  # a wrong count on the batch falls back to one call per completion
  r, missing = trainer.score_completions(lambda c, a: [float(len(c[0]))], ["a", "bb"], ["x", "y"])
  assert missing == 0 and list(r) == [1.0, 2.0]


def test_left_pad():
  ex = [trainer.Example("a", (5, 6), "1"), trainer.Example("b", (7,), "2")]
  t, m = trainer.left_pad(ex, 0)
  np.testing.assert_array_equal(t, [[5, 6], [0, 7]])
  np.testing.assert_array_equal(m, [[1, 1], [0, 1]])
  t, m = trainer.left_pad(ex, 0, length=4)
  np.testing.assert_array_equal(t, [[0, 0, 5, 6], [0, 0, 0, 7]])
  with pytest.raises(ValueError, match="more than the padded length 1"):
    trainer.left_pad(ex, 0, length=1)


# ------------------------------------------------------------------------------ config validation

@pytest.mark.parametrize("key,value,needle", [
    ("rl.batch_size", 10, "not a multiple of rl.num_generations"),
    ("lora.rank", 0, "lora.rank=0"),
    ("aqn.sigma_end", 0.1, "aqn.sigma_end=0.1 > aqn.sigma_start=0.01"),
    ("rl.num_generations", 1, "rl.num_generations=1 must be >= 2"),
    ("rl.micro_batch_size", 5, "rl.micro_batch_size=5"),
    ("rl.loss_type", "ppo", "rl.loss_type='ppo'"),
    ("sampling.top_p", 0.0, "sampling.top_p=0.0"),
    ("model.quant", "int3", "model.quant='int3'"),
])
def test_validate_names_the_impossible_setting(key, value, needle):
  c = toy.toy_config()
  section, name = key.split(".")
  c[section][name] = value
  with pytest.raises(ValueError, match="impossible config") as e:
    train_config.validate(c, check_paths=False)
  assert needle in str(e.value)


def test_validate_missing_local_path():
  c = toy.toy_config()
  c.data.train = "/nonexistent/train.jsonl"
  with pytest.raises(ValueError, match="data.train='/nonexistent/train.jsonl' does not exist"):
    train_config.validate(c)


def test_every_recipe_is_valid():
  import importlib.util
  for name in ("gsm8k_qwen2_5_7b", "bigmath_dapo_qwen2_5_7b", "gsm8k_qwen2_5_32b_single_gpu", "default"):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    train_config.validate(mod.get_config(), check_paths=False)


def _launch(*args, timeout=120):
  return subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "train.py"), *args],
                        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                        env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"})


def test_launcher_rejects_unknown_key_and_impossible_config(tmp_path):
  r = _launch("--config=configs/gsm8k_qwen2_5_7b.py", f"--workdir={tmp_path}",
              "--config.rl.num_generatons=16")
  assert r.returncode == 2
  assert "unknown config key" in r.stderr and "num_generations" in r.stderr  # did-you-mean
  r = _launch("--config=configs/gsm8k_qwen2_5_7b.py", f"--workdir={tmp_path}",
              "--config.rl.num_generations=6", "--config.lora.rank=0")
  assert r.returncode == 2
  assert "rl.batch_size=64 is not a multiple of rl.num_generations=6" in r.stderr
  assert "lora.rank=0" in r.stderr
  assert not os.listdir(tmp_path)  # nothing computed, nothing written


# ------------------------------------------------------------------------------ loop on the toy policy

def test_toy_run_logs_checkpoints_and_resumes_exactly(tmp_path):
  config = toy.toy_config()
  full, part = str(tmp_path / "full"), str(tmp_path / "part")
  _toy_run(config, full)
  _toy_run(config, part, stop_after=3)  # checkpoints at 2; the step-3 lines must be dropped
  assert ckpt_lib.Checkpointer(os.path.join(part, "checkpoints")).latest_step() == 2
  _toy_run(config, part)

  a, b = metrics_lib.read_metrics(full), metrics_lib.read_metrics(part)
  assert [r["step"] for r in a] == [0, 1, 2, 3, 3, 4, 5, 6, 6]  # eval rows at 0, 3, 6
  assert _deterministic(a) == _deterministic(b)
  sa, meta_a = _final_params(full, config, toy.toy_policy(config))
  sb, meta_b = _final_params(part, config, toy.toy_policy(config))
  for x, y in zip(jax.tree_util.tree_leaves(sa), jax.tree_util.tree_leaves(sb)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert meta_a["step"] == 6 and meta_a["data_position"] == meta_b["data_position"]
  assert meta_a["config"]["rl"]["num_generations"] == 4
  assert int(sa.num_updates) == 6
  samples = [json.loads(l) for l in open(os.path.join(part, "samples.jsonl"))]
  assert sorted({s["step"] for s in samples}) == [2, 4, 6]
  assert os.listdir(os.path.join(full, "tensorboard"))
