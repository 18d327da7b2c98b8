"""The GPU benchmark scripts on a machine without a GPU: one clear error at once, not a crash deep in a
kernel or hours of a 7B-shape job; their documented CPU modes still run."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(script, *args):
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
         "JAX_PLATFORMS": "cpu"}  # the CPU backend even where a GPU is present
  # (timeout: a hang guard; the tiny trainer run takes 60-100 s on 2 busy cores)
  return subprocess.run([sys.executable, os.path.join(ROOT, "experiments", script), *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=300, env=env)


def test_bench_kernels_without_a_gpu_fails_fast_and_names_smoke():
  r = _bench("bench_kernels.py", "--models=7b", "--ms=1", "--kinds=fwd", "--layers=o")
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert r.stderr.strip().splitlines()[-1] == (
      "error: bench_kernels.py times the 4-bit GPU kernels and needs an NVIDIA GPU (JAX's backend here is cpu); "
      "--smoke checks this script on a CPU (tiny shapes, kernels interpreted)")


@pytest.mark.slow
def test_bench_rollout_7b_shape_without_a_gpu_fails_fast_and_tiny_runs(tmp_path):
  r = _bench("bench_rollout.py", "--batches=1", "--new_tokens=2")
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert r.stderr.strip().splitlines()[-1] == (
      "error: the qwen2.5-7b shape needs a GPU (JAX's backend here is cpu); on a CPU use --shape=tiny "
      "(e.g. --shape=tiny --batches=2 --new_tokens=8 --prompt_len=8) or --smoke")
  r = _bench("bench_rollout.py", "--shape=tiny", "--batches=2,3", "--new_tokens=8", "--prompt_len=8",
             "--formats=nvfp4_fused", f"--out={tmp_path}")  # 3: padded to a batch of 4, its pad rows set aside
  assert r.returncode == 0, r.stderr[-2000:]
  md = (tmp_path / "rollout.md").read_text()
  assert "| nvfp4_fused | 2 | 8 | 1 |" in md and "| nvfp4_fused | 3 | 8 | 1 |" in md


@pytest.mark.slow
def test_bench_train_step_7b_shape_without_a_gpu_fails_fast_and_tiny_runs_the_trainer(tmp_path):
  """The whole-step benchmark runs the trainer's loop on each format in its own process. Its end id lies
  outside the vocabulary, so every completion runs to the limit: 8 tokens a completion, 4 completions a
  step, 2 steps each, logged by the trainer itself."""
  import json
  r = _bench("bench_train_step.py", "--steps=1")
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert r.stderr.strip().splitlines()[-1].startswith(
      "error: the qwen2.5-7b shape needs a GPU (JAX's backend here is cpu); on a CPU use --shape=tiny")
  r = _bench("bench_train_step.py", "--shape=tiny", "--steps=2", "--quants=nvfp4,none", "--config.rl.batch_size=4",
             "--config.rl.num_generations=2", "--config.rl.micro_batch_size=2",
             "--config.sampling.max_completion_length=8", "--config.rl.rollout_correction=token_truncate",
             "--config.rl.mask_truncated_completions=False", f"--out={tmp_path}")  # (every completion is truncated)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "keeping q/k/v" not in r.stderr  # the random base comes fused; the trainer keeps it so
  res = json.loads((tmp_path / "train_step.json").read_text())["results"]
  assert [x["quant"] for x in res] == ["nvfp4", "none"]
  for x in res:
    assert [row["step"] for row in x["rows"]] == [1, 2]
    assert all(row["completions/mean_length"] == 8 for row in x["rows"])
    assert all(row["time/step_s"] >= row["time/rollout_s"] > 0 for row in x["rows"])
    assert all(row["time/update_s"] >= row["time/reference_s"] > 0 for row in x["rows"])  # the recipe's beta 0.04
  md = (tmp_path / "train_step.md").read_text()
  assert "tiny, 4 completions a step (G = 2, micro-batches of 2), up to 8 new tokens" in md
  assert md.count("| 8 | n/a |") == 2  # the mean completion length; no device memory statistics on a CPU
  assert "| update s | of which reference s |" in md
  # rl.rollout_correction recomputes the old log-probs as rl.recompute_old_logprobs does: the sampler's distance from the training forward, bf16 rounding apart (0 with jax
  # 0.10.2 on this CPU, up to 2.7e-3 nats with 0.11.2); a misaligned token or another temperature gives nats
  assert "| sampler vs trainer log p, mean / max abs nats |" in md
  for x in res:
    assert all(0 <= row["sampling/sampling_logp_difference/mean"] <= row["sampling/sampling_logp_difference/max"]
               < 0.05 for row in x["rows"])
  # and its per-token ratio exp(trainer - sampler log p) is within exp(+-0.05) of 1, as those distances say
  assert "| importance ratio (rl.rollout_correction) min / mean / max |" in md
  for x in res:
    for row in x["rows"]:
      lo, mean, hi = (row[f"sampling/importance_sampling_ratio/{k}"] for k in ("min", "mean", "max"))
      assert 0.951 < lo <= mean <= hi < 1.052, (lo, mean, hi)


@pytest.mark.slow
def test_bench_train_step_builds_the_base_a_layer_at_a_time_as_the_whole_model_would_be():
  """The layer-at-a-time random base has the tree, shapes and dtypes of models.init_params + fuse + quantize
  of the whole model, for each format; the last layer holds its own (nonzero) weights."""
  code = """
import sys; sys.argv = ['x']; sys.path.insert(0, 'experiments')
import jax, jax.numpy as jnp, numpy as np
import bench_train_step as b
from qerl_jax import models
for q in ('nvfp4', 'nf4', 'none'):
  pre = b.random_pretrained('tiny', q, fuse=True)
  ref = jax.eval_shape(lambda: models.quantize_base(models.fuse_projections(models.init_params(  # (shapes only)
      pre.cfg, jax.random.key(0), dtype=jnp.bfloat16)), q))
  assert jax.tree.structure(pre.base) == jax.tree.structure(ref), q
  assert [(a.shape, a.dtype) for a in jax.tree.leaves(pre.base)] == [(a.shape, a.dtype) for a in jax.tree.leaves(ref)]
  last = [np.asarray(a[-1]) for a in jax.tree.leaves(pre.base['layers'])]
  assert all(np.any(x != 0) for x in last if x.size > 1), q
print('ok')
"""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
         "JAX_PLATFORMS": "cpu"}
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
  assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_bench_kernels_times_each_weight_copy_with_its_own_x():
  """bench_kernels' timing program hands each of its R weight copies a different x (distinct inputs, as a model's
  layers have): with one x shared, XLA ran some bf16 dots 2.4-2.8x slower (session 55), flattering the 4-bit rows.
  --x_copies=false keeps the old program (one x) for comparison. In its own process (the script's absl flags)."""
  code = """
import sys; sys.path.insert(0, 'experiments')
import jax.numpy as jnp
import bench_kernels
seen = []
fn = lambda x, w: (seen.append(x), x @ w)[1]
x = jnp.ones((2, 4), jnp.float32)
ws = [jnp.full((4, 3), float(i), jnp.float32) for i in range(3)]
bench_kernels.FLAGS(['bench_kernels', '--timer=wall'])
for copies in (True, False):
  bench_kernels.FLAGS.x_copies = copies
  seen.clear()
  assert bench_kernels._time(fn, x, ws, reps=1, inner=1) > 0
  print(len(seen), len({id(t) for t in seen}))
"""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
         "JAX_PLATFORMS": "cpu"}
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.split() == ["3", "3", "3", "1"]  # 3 calls: 3 distinct x, or the one shared x
