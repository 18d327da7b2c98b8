"""Tests of the training job: loop, checkpoint/resume exactness, config validation, launcher."""

from __future__ import annotations

import dataclasses
import json
import math
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


def _pythonpath() -> str:
  """The repository first, then whatever PYTHONPATH the tests run with (packages installed beside it)."""
  return os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH", "")]))


def _deterministic(rows):
  """Metric rows without wall-time keys (the only ones that may differ between two runs)."""
  return [{k: v for k, v in r.items() if not k.startswith(metrics_lib.TIMING_KEYS)} for r in rows]


def _final_params(workdir, config, policy):
  return trainer.restore_train_state(config, policy, workdir)


def _tensorboard_events(workdir):
  """Every event of a run's TensorBoard files, oldest file first (TFRecord framing: u64 length, u32 crc, the
  serialized Event, u32 crc)."""
  import struct
  from tensorboardX.proto import event_pb2
  tb = os.path.join(workdir, "tensorboard")
  out = []
  for name in sorted(os.listdir(tb), key=lambda n: os.path.getmtime(os.path.join(tb, n))):
    data = open(os.path.join(tb, name), "rb").read()
    i = 0
    while i + 12 <= len(data):
      (n,) = struct.unpack("<Q", data[i:i + 8])
      out.append(event_pb2.Event.FromString(data[i + 12:i + 12 + n]))
      i += 12 + n + 4
  return out


def _toy_run(config, workdir, **kw):
  return trainer.train(config, workdir, policy=toy.toy_policy(config), datasets=toy.toy_datasets(),
                       reward_fns=(toy.contains_answer, None), progress=False, **kw)


# ------------------------------------------------------------------------------ pure helpers

def test_step_keys_depend_only_on_seed_and_step():
  a, b, c = trainer.step_keys(3, 5), trainer.step_keys(3, 5), trainer.step_keys(3, 6)
  np.testing.assert_array_equal(a.sample, b.sample)
  assert not np.array_equal(a.sample, c.sample)
  assert not np.array_equal(a.sample, a.update)


def test_score_marks_failed_rewards_missing():
  def flaky(completions, answers):
    if len(completions) > 1:
      raise RuntimeError("batch failure")
    if completions[0] == "boom":
      raise ValueError("cannot parse")
    return [1.0 if completions[0] == answers[0] else 0.0]
  r, missing = trainer.score(flaky, ["4", "boom", "5"], ["4", "4", "4"])
  assert missing == 1
  np.testing.assert_array_equal(np.isnan(r), [False, True, False])
  assert r[0] == 1.0 and r[2] == 0.0


def test_load_prompts_skips_malformed_and_long_rows(tmp_path, data_dir):
  """The real GSM8K test file with malformed rows appended: counted and skipped, never fatal."""
  src = os.path.join(data_dir, "gsm8k", "test.jsonl")
  lines = open(src).read().splitlines()[:20]
  path = tmp_path / "gsm8k.jsonl"
  path.write_text("\n".join(lines + ["{not json", json.dumps({"question": "q"}),
                                       json.dumps({"question": "x " * 3000, "answer": "#### 1"})]) + "\n")
  from qerl_jax import synthetic
  tok = synthetic.build_tokenizer(synthetic.training_texts(synthetic.make_split("train", 50)))
  c = toy.toy_config()
  c.data.max_prompt_length = 512
  prompts = trainer.load_prompts(str(path), "gsm8k", tok, c)
  assert len(prompts) == 20
  gold = json.loads(lines[0])["answer"].split("####")[-1].strip().replace(",", "")
  assert prompts[0].answer == gold
  assert json.loads(lines[0])["question"] in prompts[0].text
  assert prompts[0].text.endswith("<|im_start|>assistant\n")


def test_load_prompts_takes_a_none_system_prompt_as_none():
  """A config file's data.system_prompt = None (validate accepts it) put a system message reading "None" before
  every prompt: str(None) is not empty."""
  from qerl_jax import synthetic
  tok = synthetic.build_tokenizer(synthetic.training_texts(synthetic.make_split("train", 50)))
  c = toy.toy_config()
  c.data.max_prompt_length = 512
  c.data.system_prompt = None
  train_config.validate(c, check_paths=False)
  (p,) = trainer.load_prompts("synthetic:train:1", "gsm8k", tok, c)
  question = synthetic.make_split("train", 1)[0]["question"]
  assert p.text == f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
  # and a checkpoint saved with None resumes under "" without a config-diff warning
  saved = json.loads(c.to_json_best_effort())
  c.data.system_prompt = ""
  assert trainer._config_diff(saved, json.loads(c.to_json_best_effort())) == []


# ------------------------------------------------------------------------------ config validation

@pytest.mark.parametrize("key,value,needle", [
    ("rl.batch_size", 10, "not a multiple of rl.num_generations"),
    ("lora.rank", 0, "lora.rank=0"),
    ("aqn.sigma_end", 0.1, "aqn.sigma_end=0.1 > aqn.sigma_start=0.01"),
    ("rl.num_generations", 1, "rl.num_generations=1 must be >= 2"),
    ("rl.micro_batch_size", 5, "rl.micro_batch_size=5"),
    ("model.attn_chunk", -1, "model.attn_chunk=-1 must be >= 0"),
    ("model.attn_impl", "flash", "model.attn_impl='flash' is not one of ('xla', 'cudnn', 'auto')"),
    ("rl.epsilon", 1.0, "rl.epsilon=1.0 must be in (0, 1)"),
    ("aqn.schedule", "exponential", "aqn.sigma_end=0.0 must be > 0"),
    ("rl.loss_type", "ppo", "rl.loss_type='ppo'"),
    ("sampling.top_p", 0.0, "sampling.top_p=0.0"),
    ("model.quant", "int3", "model.quant='int3'"),
    ("rl.max_sampling_rounds", 0, "rl.max_sampling_rounds=0 must be >= 1"),
    ("rl.oversample_factor", 2, "rl.oversample_factor=2 needs rl.dynamic_sampling=True"),
    ("rl.format_reward_kind", "think_answer", "rl.format_reward_kind='think_answer' has no effect with "
     "rl.format_reward_weight=0"),
    ("aqn.rollout_only", True, "aqn.rollout_only=True has no effect with aqn.enabled=False"),
    ("rl.overlong_buffer_length", 4, "rl.overlong_buffer_length=4 must be in [0, sampling.max_completion_length=3]"),
    ("rl.overlong_penalty_factor", -0.5, "rl.overlong_penalty_factor=-0.5 must be a finite number >= 0"),
    # inf passed every ``> 0`` check: learning_rate=inf made the warm-up's first rate 0 * inf = NaN, and
    # the run finished "ok" with NaN in its saved LoRA weights
    ("optim.learning_rate", float("inf"), "optim.learning_rate=inf must be a finite number"),
    ("optim.learning_rate", 1e39, "optim.learning_rate=1e+39 must be a finite number (within float32's range)"),
    ("optim.weight_decay", float("inf"), "optim.weight_decay=inf must be a finite number"),
    ("lora.alpha", float("inf"), "lora.alpha=inf must be a finite number"),
    ("rl.beta", float("nan"), "rl.beta=nan must be a finite number"),
    ("sampling.temperature", float("inf"), "sampling.temperature=inf must be a finite number"),
    ("sampling.temperature", 0.0, "sampling.temperature=0.0 must be > 0"),
    ("sampling.top_k", 1, "sampling.top_k=1 is greedy sampling"),
    ("seed", -1, "seed=-1 must be an integer in [0, 2**32)"),
    ("seed", 2**64, "seed=18446744073709551616 must be an integer in [0, 2**32)"),
    ("data.train", "synthetic:bogus:10", "data.train='synthetic:bogus:10': the synthetic split 'bogus'"),
    ("data.train", "synthetic:train:abc", "the number of problems 'abc' must be an integer >= 1"),
    ("data.eval", "synthetic:test:0", "data.eval='synthetic:test:0': the number of problems '0'"),
    ("data.eval", "hub:gsm8k", "data.eval='hub:gsm8k': expected hub:<id>[:<config>]:<split>"),
])
def test_validate_names_the_impossible_setting(key, value, needle):
  c = toy.toy_config()
  if key == "seed":
    c.seed = value
  else:
    section, name = key.split(".")
    c[section][name] = value
  if key == "aqn.schedule":  # the exponential schedule is geometric too: a zero sigma_end is impossible
    c.aqn.enabled, c.aqn.sigma_end = True, 0.0
  if key == "aqn.rollout_only":
    c.aqn.enabled = False
  with pytest.raises(ValueError, match="impossible config") as e:
    train_config.validate(c, check_paths=False)
  assert needle in str(e.value)


def test_validate_reports_an_oversample_factor_below_1_once():
  """oversample_factor=0 was also reported as needing dynamic sampling, which is not its problem."""
  c = toy.toy_config()
  c.rl.oversample_factor = 0
  with pytest.raises(ValueError, match="impossible config") as e:
    train_config.validate(c, check_paths=False)
  assert "rl.oversample_factor=0 must be >= 1" in str(e.value) and "needs rl.dynamic_sampling" not in str(e.value)


def test_validate_reports_a_nan_once_not_also_as_a_broken_order():
  c = toy.toy_config()
  c.aqn.enabled, c.aqn.sigma_start = True, float("nan")
  with pytest.raises(ValueError) as e:
    train_config.validate(c, check_paths=False)
  assert str(e.value).splitlines()[1:] == ["  - aqn.sigma_start=nan must be a finite number (within float32's range)",
                                           "  - aqn.sigma_start=nan must be > 0 when aqn.enabled (set aqn.enabled=False "
                                           "to turn AQN off)"]


def test_validate_names_a_missing_key_as_a_config_error():
  c = toy.toy_config()
  del c.rl["batch_size"]
  with pytest.raises(ValueError, match="config is missing a key the trainer reads .*batch_size"):
    train_config.validate(c, check_paths=False)


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


def test_load_base_fuses_projections_and_keeps_the_function():
  """model.fuse_projections (default on) gives a fused base whose forward equals the unfused one
  (float base: the same numbers concatenated, so float32 logits agree to rounding)."""
  from qerl_jax import models
  from qerl_jax.trainer import _load_base
  c = toy.toy_config()
  c.model.path = "random:tiny"
  c.model.quant = "none"
  cfg, fused, _, _ = _load_base(c)
  c.model.fuse_projections = False
  cfg2, plain, _, _ = _load_base(c)
  assert models.is_fused(fused) and not models.is_fused(plain)
  lay = fused["layers"]
  assert {"qkv", "o"} <= set(lay["attn"]) and "q" not in lay["attn"] and "gate_up" in lay["mlp"]
  np.testing.assert_array_equal(np.asarray(lay["attn"]["qkv"][:, :, :cfg.q_dim]),
                                np.asarray(plain["layers"]["attn"]["q"]))
  tokens = jax.numpy.asarray([[3, 5, 7, 11, 13, 2]], jax.numpy.int32)
  positions = jax.numpy.arange(6, dtype=jax.numpy.int32)[None]
  a, _ = models.forward(cfg, fused, tokens, positions)
  b, _ = models.forward(cfg2, plain, tokens, positions)
  assert np.abs(np.asarray(b)).max() > 0.1  # a real signal, not all zeros
  np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=2e-5, atol=2e-5)


def test_checkpoint_config_mismatch_reads_keys_older_runs_lack_as_their_legacy_value():
  c = toy.toy_config()
  saved = json.loads(c.to_json_best_effort())
  del saved["model"]["fuse_projections"]  # a run saved before the key existed (unfused)
  saved["model"]["remat"] = not c.model.remat  # remat does not change the base: not reported
  saved["model"]["code_order"] = "decode"  # nor does the code order (same values)
  saved["model"]["attn_chunk"] = 0  # nor the attention's query chunk (same numbers)
  assert trainer.checkpoint_config_mismatch({"config": saved}, c) == [("model.fuse_projections", False, True)]
  c.model.fuse_projections = False
  assert trainer.checkpoint_config_mismatch({"config": saved}, c) == []
  assert trainer._config_diff(saved, json.loads(c.to_json_best_effort())) == [
      ("model.attn_chunk", 0, c.model.attn_chunk), ("model.code_order", "decode", c.model.code_order),
      ("model.remat", not c.model.remat, c.model.remat)]
  saved["model"]["quant"] = "nf4"
  assert trainer.checkpoint_config_mismatch({"config": saved}, c) == [("model.quant", "nf4", "nvfp4")]
  assert trainer.checkpoint_config_mismatch({}, c) == []


# The keys of the first trainer config (commit 98bb2ad's base_config), which every checkpoint's saved config holds.
_FIRST_CONFIG_KEYS = frozenset("""
    aqn.enabled aqn.num_stages aqn.rollout_only aqn.schedule aqn.sigma_end aqn.sigma_start data.eval data.eval_size
    data.max_prompt_length data.system_prompt data.task data.train lora.alpha lora.rank lora.target_modules
    lora.train_norms lora.use_rslora model.path model.quant model.remat optim.b1 optim.b2 optim.learning_rate
    optim.lr_schedule optim.max_grad_norm optim.warmup_ratio optim.weight_decay rl.batch_size rl.beta rl.epsilon
    rl.epsilon_high rl.format_reward_weight rl.kl_estimator rl.loss_type rl.mask_truncated_completions
    rl.micro_batch_size rl.num_generations rl.num_iterations rl.scale_rewards sampling.max_completion_length
    sampling.temperature sampling.top_k sampling.top_p seed train.async_checkpointing train.eval_batch_size
    train.eval_every train.eval_max_completion_length train.keep_checkpoints train.log_samples_every
    train.num_samples_logged train.plot train.save_every train.total_steps""".split())


def test_every_key_added_since_the_first_config_has_a_legacy_value():
  """A checkpoint saved before a key existed compared that key as None: the resume warning said the run differs
  (sampling.dequantize_min_rows: None -> 0, though 0 is what those runs did) and told the user to pass
  --config.sampling.dequantize_min_rows=None, which the command line refuses (an int key)."""
  current = json.loads(train_config.base_config().to_json_best_effort())
  keys = {f"{s}.{k}" for s, sv in current.items() if isinstance(sv, dict) for k in sv}
  keys |= {s for s, sv in current.items() if not isinstance(sv, dict)}
  assert _FIRST_CONFIG_KEYS <= keys
  assert sorted(keys - _FIRST_CONFIG_KEYS - set(trainer._LEGACY_VALUES)) == []
  # a config saved before data.user_template (the question was the whole user message) and before
  # sampling.dequantize_min_rows (never a dense copy) matches today's defaults
  saved = json.loads(train_config.base_config().to_json_best_effort())
  del saved["data"]["user_template"], saved["sampling"]["dequantize_min_rows"]
  assert trainer._config_diff(saved, current) == []
  saved["train"]["total_steps"] = 7
  assert trainer._override_flags(trainer._config_diff(saved, current)) == "--config.train.total_steps=7"


def test_in_row_chunks_equals_one_call_and_pads_a_ragged_last_chunk():
  """5 rows in chunks of 2 (the last one padded with a zero row) give the hand-computed rows; the
  function sees chunks of 2 rows, never the whole batch."""
  a = np.arange(15, dtype=np.float32).reshape(5, 3)
  b = np.asarray([1, 2, 3, 4, 5], np.int32)
  seen = []

  def fn(x, y):
    seen.append(x.shape)
    return x.sum(axis=1) * y  # row i: sum(a[i]) * b[i]

  out = jax.jit(lambda x, y: trainer._in_row_chunks(fn, 2, x, y))(a, b)
  np.testing.assert_array_equal(np.asarray(out), [3 * 1, 12 * 2, 21 * 3, 30 * 4, 39 * 5])
  assert seen == [(2, 3)]
  np.testing.assert_array_equal(np.asarray(trainer._in_row_chunks(fn, 8, a, b)), np.asarray(out))  # one piece
  with pytest.raises(ValueError, match="rows=0 must be >= 1"):
    trainer._in_row_chunks(fn, 0, a, b)
  with pytest.raises(ValueError, match="leading"):
    trainer._in_row_chunks(fn, 2, a, b[:4])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reference_logprobs_by_micro_batch_equal_one_whole_batch_forward(monkeypatch, temperature):
  """policy.ref_logprobs runs rl.micro_batch_size rows at a time with model.attn_chunk query chunks; its
  numbers equal one unchunked float32 forward of the whole batch with LoRA and AQN off (random:tiny,
  NVFP4 base, left-padded prompts, a completion ended early), its logits divided by the sampling temperature
  (as the sampler's policy_logprobs and TRL's training forward)."""
  from qerl_jax import models
  from qerl_jax.trainer import _load_base
  c = toy.toy_config()
  c.model.path = "random:tiny"
  c.model.quant = "nvfp4"
  c.rl.micro_batch_size = 2
  c.model.attn_chunk = 3
  c.sampling.temperature = temperature
  policy = trainer.load_policy(c)
  cfg, base, _, _ = _load_base(c)
  calls, inner = [], models.token_logprobs

  def spy(*args, **kw):
    calls.append((args[2].shape, kw.get("attn_chunk")))
    return inner(*args, **kw)

  monkeypatch.setattr(models, "token_logprobs", spy)
  rng = np.random.default_rng(0)
  n, p, t = 5, 4, 6
  prompt = rng.integers(3, cfg.vocab_size, (n, p)).astype(np.int32)
  pmask = np.ones((n, p), np.int32)
  pmask[1, :2] = 0
  pmask[3, :1] = 0
  comp = rng.integers(3, cfg.vocab_size, (n, t)).astype(np.int32)
  cmask = np.ones((n, t), np.int32)
  cmask[2, 3:] = 0
  batch = {"prompt_tokens": prompt, "prompt_mask": pmask, "completion_tokens": comp, "completion_mask": cmask}
  got = np.asarray(policy.ref_logprobs(batch, None))
  assert calls == [((2, p + t), 3)]  # traced once, for a micro-batch of rows, with the query chunk
  monkeypatch.undo()
  full, fmask = np.concatenate([prompt, comp], 1), np.concatenate([pmask, cmask], 1)
  forward = lambda temp: np.asarray(models.token_logprobs(
      cfg, base, jax.numpy.asarray(full), models.positions_from_mask(fmask), attn_mask=jax.numpy.asarray(fmask),
      remat=False, temperature=temp)[0])[:, p:]
  want = forward(temperature)
  assert got.shape == (n, t) and np.isfinite(got).all() and np.abs(want).max() > 1.0
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  if temperature != 1.0:
    assert np.abs(got - forward(1.0)).max() > 0.1


def test_unfusable_base_stays_unfused_with_a_warning(capsys):
  """A pre-quantized NVFP4 base whose q/k/v global scales differ cannot be fused: the trainer keeps
  it as loaded (and says so) rather than stopping."""
  from qerl_jax import models
  from qerl_jax.trainer import _fuse_or_keep
  cfg = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                           num_kv_heads=1, head_dim=16, dtype="float32")
  base = models.quantize_base(models.init_params(cfg, jax.random.key(0), dtype=jax.numpy.float32), "nvfp4")
  gs = [float(base["layers"]["attn"][n].global_scale[0]) for n in ("q", "k", "v")]
  assert len(set(gs)) > 1  # quantized one matrix at a time: different global scales
  out = _fuse_or_keep(base)
  assert out is base and not models.is_fused(out)
  assert "keeping q/k/v and gate/up as separate matrices" in capsys.readouterr().err
  fused = _fuse_or_keep(models.init_params(cfg, jax.random.key(0), dtype=jax.numpy.float32))  # float: fusable
  assert models.is_fused(fused) and capsys.readouterr().err == ""


def test_code_order_setting(monkeypatch, capsys):
  """model.code_order: "standard" keeps the loaded codes; "decode" stores every NVFP4 linear in the
  decode kernel's order, with the same dequantized values and the same logits; "auto" (the default)
  does so only where pallas_kernels.decode_order_applies() (never on a CPU); a bad value is refused."""
  import pallas_kernels
  from qerl_jax import models, nvfp4
  from qerl_jax.trainer import _in_code_order
  cfg = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                           num_kv_heads=1, head_dim=16, dtype="float32")
  base = models.quantize_base(models.init_params(cfg, jax.random.key(0), dtype=jax.numpy.float32), "nvfp4")
  assert _in_code_order(base, "standard") is base
  if pallas_kernels.decode_order_applies():  # a GPU with the Gluon decode kernel
    assert _in_code_order(base, "auto")["layers"]["mlp"]["down"].code_order == "decode"
  else:
    assert _in_code_order(base, "auto") is base
  dec = _in_code_order(base, "decode")
  q, qd = base["layers"]["mlp"]["down"], dec["layers"]["mlp"]["down"]
  assert qd.code_order == "decode" and not np.array_equal(np.asarray(q.packed), np.asarray(qd.packed))
  np.testing.assert_array_equal(np.asarray(nvfp4.dequantize(qd)), np.asarray(nvfp4.dequantize(q)))
  tokens = jax.numpy.asarray([[3, 5, 7, 11]], jax.numpy.int32)
  pos = jax.numpy.arange(4, dtype=jax.numpy.int32)[None]
  np.testing.assert_array_equal(np.asarray(models.forward(cfg, dec, tokens, pos)[0]),
                                np.asarray(models.forward(cfg, base, tokens, pos)[0]))
  from qerl_jax.trainer import _rollout_base
  assert _in_code_order(base, "rollout") is base
  if not pallas_kernels.decode_order_applies():  # no Gluon kernel here: the sampler keeps the base too
    assert _rollout_base(base, "rollout") is base
  monkeypatch.setattr(pallas_kernels.matmul, "decode_order_applies", lambda: True)
  assert _in_code_order(base, "auto")["layers"]["attn"]["q"].code_order == "decode"
  # "rollout": the update keeps the standard base, the sampler gets a decode-order copy of the codes
  # that shares the block scales
  assert _in_code_order(base, "rollout") is base and _rollout_base(base, "standard") is base
  roll = _rollout_base(base, "rollout")["layers"]["mlp"]["down"]
  assert roll.code_order == "decode" and roll.block_scale is q.block_scale
  np.testing.assert_array_equal(np.asarray(roll.packed), np.asarray(qd.packed))
  c = toy.toy_config()
  assert c.model.code_order == "auto"
  c.model.code_order = "marlin"
  with pytest.raises(ValueError, match="model.code_order='marlin'"):
    train_config.validate(c, check_paths=False)


def _launch(*args, timeout=120):
  return subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "train.py"), *args],
                        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                        env={**os.environ, "PYTHONPATH": _pythonpath(), "JAX_PLATFORMS": "cpu"})


def test_launcher_rejects_unknown_key_and_impossible_config(tmp_path):
  r = _launch("--config=configs/gsm8k_qwen2_5_7b.py", f"--workdir={tmp_path}", "--config.seed=3",
              "--config.rl.num_generatons=16", "--config.lora.rank=8")
  assert r.returncode == 2
  # only the bad override is named (all three were), with ml_collections' did-you-mean
  assert r.stderr.startswith("error: unknown config key among ['--config.rl.num_generatons=16']: 'num_generatons' "
                             "Did you mean \"num_generations\""), r.stderr[-2000:]
  r = _launch("--config=configs/gsm8k_qwen2_5_7b.py", f"--workdir={tmp_path}",
              "--config.rl.num_generations=6", "--config.lora.rank=0")
  assert r.returncode == 2
  assert "rl.batch_size=64 is not a multiple of rl.num_generations=6" in r.stderr
  assert "lora.rank=0" in r.stderr
  assert not os.listdir(tmp_path)  # nothing computed, nothing written


def test_launcher_missing_config_file_with_an_override_is_one_line(tmp_path):
  # an override makes ml_collections read the (missing) file during flag parsing, not in main()
  r = _launch("--config=configs/no_such_recipe.py", f"--workdir={tmp_path / 'run'}",
              "--config.train.total_steps=2")
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert r.stderr.strip().splitlines() == [
      "error: could not load the config file --config:  [Relative path]: configs/no_such_recipe.py "
      "[Errno 2] No such file or directory: 'configs/no_such_recipe.py'"]
  assert not (tmp_path / "run").exists()


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
  assert [r["data/position"] for r in a if "loss" in r] == [1, 2, 3, 4, 5, 6]
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
  # the resumed writer's first event tells TensorBoard to drop the killed run's events of steps >= 3
  starts = [(e.step, e.session_log.status) for e in _tensorboard_events(part) if e.HasField("session_log")]
  assert starts == [(3, 1)]  # SessionLog.START at the purge step; none in the first, unresumed file
  # plot.py: both runs on one figure per quantity
  r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "plot.py"),
                      f"--workdirs={full},{part}", f"--out={tmp_path / 'plots'}"],
                     capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": _pythonpath()})
  assert r.returncode == 0, r.stderr[-2000:]
  written = sorted(os.listdir(tmp_path / "plots"))
  assert {"reward.png", "accuracy.png", "entropy.png", "sigma.png", "response_length.png"} <= set(written)
  assert all(os.path.getsize(tmp_path / "plots" / f) > 5000 for f in written)
  r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "plot.py"),
                      f"--workdirs={full},{tmp_path / 'no-such-run'}", f"--out={tmp_path / 'plots2'}"],
                     capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": _pythonpath()})
  assert r.returncode == 2 and "Traceback" not in r.stderr
  assert f"error: no metrics.jsonl in workdir '{tmp_path / 'no-such-run'}'" in r.stderr


def _plot(*args):
  return subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "plot.py"), *args], capture_output=True,
                        text=True, timeout=120, env={**os.environ, "PYTHONPATH": _pythonpath()})


def test_plot_launcher_one_step_run_and_nothing_to_plot(tmp_path):
  one = tmp_path / "one"  # one training step, no evaluation, a null entropy and a line torn by a kill
  one.mkdir()
  # and lines that are JSON but no metrics row (an AttributeError or KeyError in plot.py before)
  (one / "metrics.jsonl").write_text('[1, 2]\n{"reward": 0.9}\n{"step": "3", "reward": 0.1}\n'
                                     '{"step": 1, "reward": 0.5, "entropy": null, "aqn/sigma": 0.01}\n'
                                     '{"step": 2, "rew')
  r = _plot(f"--workdirs={one}")
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.split() == [str(one / "plots" / "reward.png"), str(one / "plots" / "sigma.png")]
  empty = tmp_path / "empty"  # killed before its first line
  empty.mkdir()
  (empty / "metrics.jsonl").write_text('{"step": 0, "eval/acc')
  r = _plot(f"--workdirs={empty}")
  assert r.returncode == 1 and r.stdout == "", r.stderr[-2000:]
  assert r.stderr.startswith(f"error: nothing to plot: no metrics.jsonl in ['{empty}'] has a value of ['reward', ")
  (tmp_path / "dir").mkdir()
  (tmp_path / "dir" / "metrics.jsonl").mkdir()  # an IsADirectoryError before
  r = _plot(f"--workdirs={tmp_path / 'dir'}")
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert f"error: no metrics.jsonl in workdir '{tmp_path / 'dir'}'" in r.stderr
  comma = tmp_path / "run,x"  # train.py takes such a --workdir; plot.py split it on the comma
  comma.mkdir()
  (comma / "metrics.jsonl").write_text((one / "metrics.jsonl").read_text())
  r = _plot(f"--workdirs={comma},{one}", f"--out={tmp_path / 'both'}")
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.split() == [str(tmp_path / "both" / "reward.png"), str(tmp_path / "both" / "sigma.png")]
  r = _plot("--workdirs=")
  assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert "--workdirs is empty" in r.stderr
  r = _plot(f"--workdirs={one}", str(empty))  # a second run given without the comma
  assert r.returncode == 1 and f"unexpected positional arguments: ['{empty}']" in r.stderr, r.stderr[-2000:]


def _round(rewards, group_size):
  n = len(rewards) // group_size
  return trainer._Round(prompts=[trainer.Prompt(text=f"q{i}", answer="1") for i in range(n)], prompt_tokens=None,
                        prompt_mask=None, rollout=None, completions=[], answers=[],
                        correct=np.asarray(rewards, np.float32), rewards=np.asarray(rewards, np.float32))


def test_select_groups_takes_informative_groups_in_order_then_fills():
  """G = 2. Round 0: groups [1, 1] (no signal), [0, 1], [0, 0]; round 1: [1, 0], [1, 1], [0, 1]."""
  rounds = [_round([1, 1, 0, 1, 0, 0], 2), _round([1, 0, 1, 1, 0, 1], 2)]
  rows, taken, informative = trainer._select_groups(rounds, 3, 2, dynamic=True)
  assert taken == [(0, 1), (1, 0), (1, 2)] and rows == [(0, 2), (1, 0), (1, 4)] and informative == 3
  # more groups asked than carry signal: the earliest others fill the batch
  rows, taken, informative = trainer._select_groups(rounds, 5, 2, dynamic=True)
  assert taken == [(0, 1), (1, 0), (1, 2), (0, 0), (0, 2)] and informative == 3
  # DAPO eq. 11 filters on the answer check: a group all wrong (or all right) whose shaped rewards differ (an
  # overlong penalty, a format bonus) carries no signal; one with a right and a wrong answer does
  shaped = _round([0, 0, 1, 1, 1, 0], 2)
  shaped = dataclasses.replace(shaped, rewards=np.asarray([0, -0.25, 1.1, 1, 1, -0.5], np.float32))
  np.testing.assert_array_equal(shaped.informative, [False, False, True])
  # without dynamic sampling: the one round's groups, all of them
  rows, taken, _ = trainer._select_groups(rounds[:1], 3, 2, dynamic=False)
  assert taken == [(0, 0), (0, 1), (0, 2)] and rows == [(0, 0), (0, 2), (0, 4)]


def _spy_policy(config, captured, masks=None):
  """The toy policy, recording each update's advantages (and completion masks in ``masks``)."""
  import dataclasses
  masks = [] if masks is None else masks
  policy = toy.toy_policy(config)
  inner = policy.update

  def update(state, batch, noise, step, key):
    captured.append(np.asarray(batch["advantages"]))
    masks.append(np.asarray(batch["completion_mask"]))
    return inner(state, batch, noise, step, key)

  return dataclasses.replace(policy, update=update)


@pytest.mark.parametrize("oversample", [1, 2])
def test_dynamic_sampling_updates_on_groups_with_signal_and_resumes(tmp_path, oversample):
  """DAPO's dynamic sampling on the toy policy (G = 4, 2 prompts a step; the toy's groups often score all 0):
  a step samples further prompts until 2 groups carry signal (or 3 rollouts), each rollout advancing the
  data position by `oversample` batches (2 * oversample prompts), and the update's advantages are those of
  exactly the groups with signal. A run stopped after 3 steps and resumed matches the uninterrupted one."""
  config = toy.toy_config()
  config.rl.dynamic_sampling = True
  config.rl.max_sampling_rounds = 3
  config.rl.oversample_factor = oversample
  captured, masks = [], []
  kw = dict(datasets=toy.toy_datasets(), reward_fns=(toy.contains_answer, None), progress=False)
  trainer.train(config, str(tmp_path / "full"), policy=_spy_policy(config, captured, masks), **kw)
  rows = [r for r in metrics_lib.read_metrics(str(tmp_path / "full")) if "loss" in r]
  rounds = [r["dynamic_sampling/rounds"] for r in rows]
  assert len(captured) == len(rows) == 6 and (max(rounds) > 1 if oversample == 1 else True)
  assert [r["data/position"] for r in rows] == (oversample * np.cumsum(rounds)).tolist()
  if oversample == 1:
    assert any(r["dynamic_sampling/filled_groups"] for r in rows)  # some step ran out of rounds
  for r, adv, mask in zip(rows, captured, masks):
    with_signal = int((adv.reshape(-1, 4) != 0).any(axis=1).sum())
    assert adv.shape == (8,) and with_signal == r["dynamic_sampling/informative_groups"]
    assert r["dynamic_sampling/filled_groups"] == 2 - with_signal
    # the groups with signal come first; the fillers are masked out of the loss (no tokens in the normaliser)
    assert mask.reshape(2, 4, -1)[:with_signal].sum(axis=(1, 2)).min(initial=1) > 0
    assert mask.reshape(2, 4, -1)[with_signal:].sum() == 0
    # the groups with signal among all sampled (frac_reward_zero_std covers every sampled group): the update
    # takes them first, so it has two of them whenever two were sampled
    sampled_with_signal = round((1 - r["frac_reward_zero_std"]) * 2 * oversample * r["dynamic_sampling/rounds"])
    assert with_signal == min(2, sampled_with_signal)
    if r["dynamic_sampling/rounds"] < 3:
      assert with_signal == 2
  trainer.train(config, str(tmp_path / "part"), policy=toy.toy_policy(config), stop_after=3, **kw)
  trainer.train(config, str(tmp_path / "part"), policy=toy.toy_policy(config), **kw)
  a, b = (metrics_lib.read_metrics(str(tmp_path / w)) for w in ("full", "part"))
  assert _deterministic(a) == _deterministic(b)


def test_overlong_penalty_joins_the_training_reward(tmp_path):
  """T = 3 new tokens, buffer 2: a completion of n tokens (end token included) loses 0 / 0.5 / 1 at
  n = 1 / 2 / 3 (DAPO eq. 13, worked by hand); the logged samples' rewards are the answer check plus that."""
  config = toy.toy_config()
  config.rl.overlong_buffer_length = 2
  config.train.total_steps, config.train.log_samples_every, config.train.num_samples_logged = 2, 1, 8
  _toy_run(config, str(tmp_path / "run"))
  samples = [json.loads(l) for l in open(tmp_path / "run" / "samples.jsonl")]
  assert len(samples) == 16
  for s in samples:
    n = min(len(s["completion"]) + 1, 3)  # digits, then the end token unless the row was cut at 3
    expected = (1.0 if s["answer"] in s["completion"] else 0.0) + {1: 0.0, 2: -0.5, 3: -1.0}[n]
    assert s["reward"] == pytest.approx(expected), s
  assert {min(len(s["completion"]) + 1, 3) for s in samples} >= {2, 3}


def test_reference_pass_time_is_logged_apart_when_beta_is_on(tmp_path):
  """With rl.beta > 0 each step logs time/reference_s, the reference pass alone (here one that takes at least
  50 ms), within time/update_s; with beta = 0 there is no such pass and no such key."""
  import dataclasses
  import time

  config = toy.toy_config()
  config.train.total_steps, config.train.eval_every = 2, 0
  config.rl.beta = 0.04
  policy = toy.toy_policy(config)

  def slow_reference(batch, noise):
    time.sleep(0.05)
    return policy.ref_logprobs(batch, noise)

  trainer.train(config, str(tmp_path / "kl"), policy=dataclasses.replace(policy, ref_logprobs=slow_reference),
                datasets=toy.toy_datasets(), reward_fns=(toy.contains_answer, None), progress=False)
  rows = [r for r in metrics_lib.read_metrics(str(tmp_path / "kl")) if "time/step_s" in r]
  assert len(rows) == 2
  for r in rows:
    assert 0.05 <= r["time/reference_s"] <= r["time/update_s"]
  config.rl.beta = 0.0
  _toy_run(config, str(tmp_path / "no_kl"))
  assert not any("time/reference_s" in r for r in metrics_lib.read_metrics(str(tmp_path / "no_kl")))


# ------------------------------------------------------------------------------ the CPU default, end to end

# The CPU default shrunk to about a second a step: 2 prompts x 4 completions, 24 new tokens.
_SMALL = ["--config.train.total_steps=4", "--config.train.save_every=1", "--config.train.eval_every=0",
          "--config.data.eval_size=4", "--config.train.eval_batch_size=4",
          "--config.sampling.max_completion_length=24", "--config.rl.num_generations=4",
          "--config.rl.batch_size=8",
          "--config.rl.micro_batch_size=4", "--config.train.log_samples_every=1",
          "--config.train.plot=False", "--config.train.keep_checkpoints=5",
          "--config.rl.mask_truncated_completions=False"]


def _env(cache_dir):
  # A shared persistent compilation cache makes the 2nd and 3rd process skip compilation: the suite's own (conftest),
  # which the eval launcher's test then shares with these runs, or else ``cache_dir``.
  return {**os.environ, "PYTHONPATH": _pythonpath(), "JAX_PLATFORMS": "cpu",
          "JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR", str(cache_dir)),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}


def _train_cmd(workdir):
  return [sys.executable, os.path.join(ROOT, "experiments", "train.py"),
          "--config=configs/default.py", f"--workdir={workdir}", *_SMALL]


def _complete_steps(workdir):
  d = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(d):
    return []
  return sorted(int(n) for n in os.listdir(d) if n.isdigit())


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory):
  """An uninterrupted 4-step run and a run SIGKILLed after its 2nd checkpoint, then resumed."""
  import signal
  import time
  base = tmp_path_factory.mktemp("default")
  cache = base / "jax_cache"
  full, killed = base / "full", base / "killed"
  r = subprocess.run(_train_cmd(full), cwd=ROOT, env=_env(cache), capture_output=True, text=True,
                     timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]

  p = subprocess.Popen(_train_cmd(killed), cwd=ROOT, env=_env(cache), stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
  deadline = time.time() + 600
  while len(_complete_steps(killed)) < 2 and p.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  p.send_signal(signal.SIGKILL)
  p.wait()
  steps_at_kill = _complete_steps(killed)
  r2 = subprocess.run(_train_cmd(killed), cwd=ROOT, env=_env(cache), capture_output=True,
                      text=True, timeout=900)
  assert r2.returncode == 0, r2.stderr[-3000:]
  return {"full": str(full), "killed": str(killed), "steps_at_kill": steps_at_kill,
          "stdout": r.stdout, "resume_stderr": r2.stderr}


@pytest.mark.slow
@pytest.mark.xdist_group("default_runs")  # one worker runs the module fixture, once
def test_default_config_runs_end_to_end(default_runs):
  full = default_runs["full"]
  rows = metrics_lib.read_metrics(full)
  train_rows = [r for r in rows if "loss" in r]
  assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
  for r in train_rows:
    assert np.isfinite(r["loss"]) and np.isfinite(r["entropy"]) and r["entropy"] > 0
    assert r["time/rollout_s"] > 0 and r["perf/tokens_per_s"] > 0
  assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 4]
  if "tiny-gsm" in json.load(open(os.path.join(full, "config.json")))["model"]["path"]:
    assert any(r["grad_norm"] > 0 for r in train_rows)  # the embedded model learns: LoRA moves
  assert "final_accuracy" in default_runs["stdout"]  # the summary table
  # the outputs line lists what is there: --config.train.plot=False draws no plots/
  assert (f"Outputs in {full}: config.json, metrics.jsonl, summary.json, samples.jsonl, checkpoints; "
          f"TensorBoard events (tensorboard --logdir {full};") in default_runs["stdout"]
  assert not os.path.exists(os.path.join(full, "plots"))
  assert os.listdir(os.path.join(full, "tensorboard"))
  samples = [json.loads(l) for l in open(os.path.join(full, "samples.jsonl"))]
  assert {s["step"] for s in samples} == {1, 2, 3, 4} and all("completion" in s for s in samples)
  # the checkpoint restores (see the next test), holds the config, and not the frozen base
  meta = json.load(open(os.path.join(full, "checkpoints", "4", "meta", "metadata")))
  assert meta["step"] == 4 and meta["config"]["rl"]["batch_size"] == 8
  assert meta["data_position"] == 4  # batches of prompts served
  sizes = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in
              os.walk(os.path.join(full, "checkpoints", "4")) for f in fs)
  assert sizes < 5_000_000, f"a checkpoint of {sizes} bytes: the frozen base must not be saved"


def _restore_on_cpu(path):
  """The state saved at ``path`` (by a run on the CPU), restored onto this process's CPU device: orbax
  refuses a restore without a target where the devices differ from the run's (a GPU test process)."""
  import orbax.checkpoint as ocp
  ck = ocp.StandardCheckpointer()
  cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=cpu), ck.metadata(path).item_metadata)
  return ck.restore(path, target)


@pytest.mark.slow
@pytest.mark.xdist_group("default_runs")  # one worker runs the module fixture, once
def test_eval_says_which_step_it_scores_when_the_newest_checkpoint_folder_is_incomplete(default_runs, tmp_path):
  """It quietly scored an older step when the newest checkpoint had lost its state/ folder."""
  import shutil
  run = tmp_path / "run"
  shutil.copytree(default_runs["full"], run)
  shutil.rmtree(run / "checkpoints" / "4" / "state")
  r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "eval.py"), "--config=configs/default.py",
                      f"--workdir={run}", "--limit=4", "--max_new_tokens=24"],
                     cwd=ROOT, env=_env(tmp_path / "cache"), capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert ("warning: checkpoints/[4] are incomplete (no state/ or meta/); evaluating step 3, the newest complete one"
          in r.stderr), r.stderr[-3000:]
  assert (run / "eval_3.json").exists()


@pytest.mark.slow
@pytest.mark.xdist_group("default_runs")  # one worker runs the module fixture, once
def test_sigkill_after_second_checkpoint_resumes_bit_for_bit(default_runs):
  full, killed = default_runs["full"], default_runs["killed"]
  at_kill = default_runs["steps_at_kill"]
  assert len(at_kill) >= 2 and max(at_kill) < 4, at_kill  # killed mid-run, not after the end
  assert f"resuming from the checkpoint at step {max(at_kill)}" in default_runs["resume_stderr"]
  a, b = metrics_lib.read_metrics(full), metrics_lib.read_metrics(killed)
  assert _deterministic(a) == _deterministic(b)
  ca = ckpt_lib.Checkpointer(os.path.join(full, "checkpoints"))
  cb = ckpt_lib.Checkpointer(os.path.join(killed, "checkpoints"))
  assert ca.latest_step() == cb.latest_step() == 4
  ra, rb = (_restore_on_cpu(os.path.join(run, "checkpoints", "4", "state")) for run in (full, killed))
  la, lb = jax.tree_util.tree_leaves(ra), jax.tree_util.tree_leaves(rb)
  assert len(la) == len(lb) > 4
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(ra)[0]]
  assert any("'a'" in p for p in paths) and any("input_norm" in p for p in paths)  # LoRA + norms
  assert not any("embed" in p or "'q'" in p and "'a'" not in p and "'b'" not in p for p in paths)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  ca.close()
  cb.close()


def test_unfinished_save_is_ignored_and_cleaned(tmp_path):
  """A save killed before orbax's final rename leaves '<step>.orbax-checkpoint-tmp': not a checkpoint."""
  import shutil
  d = tmp_path / "checkpoints"
  c = ckpt_lib.Checkpointer(d, keep=3)
  state = {"w": np.arange(4, dtype=np.float32)}
  c.save(1, state, {"step": 1})
  c.save(2, {"w": state["w"] + 1}, {"step": 2})
  c.close()
  shutil.copytree(d / "2", d / "3.orbax-checkpoint-tmp")  # what a kill mid-save leaves
  c = ckpt_lib.Checkpointer(d, keep=3)
  assert c.latest_step() == 2 and c.all_steps() == [1, 2]
  restored, meta = c.restore(None, state)
  np.testing.assert_array_equal(restored["w"], [1, 2, 3, 4])
  assert meta == {"step": 2}
  c.close()
  assert not (d / "3.orbax-checkpoint-tmp").exists()


def test_a_numbered_folder_without_the_items_is_not_a_checkpoint(tmp_path):
  """orbax counts any numbered folder as a step: a '99/' made by hand stopped every resume with
  KeyError: 'Item "meta" was not found'."""
  d = tmp_path / "checkpoints"
  c = ckpt_lib.Checkpointer(d, keep=3, async_save=False)
  c.save(2, {"w": np.arange(3, dtype=np.float32)}, {"step": 2})
  c.close()
  (d / "99").mkdir()
  (d / "7" / "state").mkdir(parents=True)  # one item of two, as a partial copy leaves it
  c = ckpt_lib.Checkpointer(d, read_only=True)
  assert c.all_steps() == [2] and c.latest_step() == 2 and c.restore_meta() == {"step": 2}
  assert c.incomplete_steps() == [7, 99]
  restored, meta = c.restore(None, {"w": np.zeros(3, np.float32)})
  np.testing.assert_array_equal(restored["w"], [0, 1, 2])
  c.close()


def test_metrics_logger_resume_drops_lines_that_are_not_rows(tmp_path):
  """A JSON line that is not an object (or has no integer step) raised AttributeError on resume."""
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "a": 1}\n[1, 2]\n{"step": 3, "a": 3}\n{"a": 9}\n{"step": "2"}\n'
                  '{"step": 2, "a": 2}\n{"step": 4, "a')
  metrics_lib.MetricsLogger(str(tmp_path), resume_step=2, tensorboard=False).close()
  assert [json.loads(line) for line in path.read_text().splitlines()] == [{"a": 1, "step": 1}, {"a": 2, "step": 2}]


def test_train_refuses_a_workdir_it_cannot_use_before_the_model_loads(tmp_path):
  """Each refusal is a RunSetupError naming the problem, raised before load_policy (the policy here is None:
  loading 'toy' would fail with another error), and leaves what was in the workdir as it was."""
  config = toy.toy_config()
  f = tmp_path / "a_file"
  f.write_text("x")
  with pytest.raises(trainer.RunSetupError, match=f"workdir '{f}' is a file, not a folder"):
    trainer.train(config, str(f), progress=False)
  model = tmp_path / "model"  # a Hugging Face folder given as the workdir: its config.json was overwritten
  model.mkdir()
  (model / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 64}')
  with pytest.raises(trainer.RunSetupError, match="holds a config.json that is not a training run's"):
    trainer.train(config, str(model), progress=False)
  assert json.loads((model / "config.json").read_text()) == {"model_type": "qwen2", "hidden_size": 64}
  assert sorted(os.listdir(model)) == ["config.json"]
  if os.geteuid() != 0:  # root may write anywhere
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(trainer.RunSetupError, match="is not writable"):
      trainer.train(config, str(ro), progress=False)


def test_resume_with_other_lora_shapes_or_too_few_prompts_is_one_clear_error(tmp_path):
  config = toy.toy_config()
  wd = str(tmp_path / "run")
  _toy_run(config, wd, stop_after=2)
  other = toy.toy_config()
  other.lora.rank = 16  # the checkpoint's is 32: 83 lines of orbax shape errors before, never naming the key
  with pytest.raises(trainer.RunSetupError, match=r"lora.rank=16 \(the checkpoint has 32\); the trained state's "
                     "shapes differ"):
    _toy_run(other, wd)
  policy = toy.toy_policy(config)  # a state of another shape than the saved one, with the same config

  def init_state(key):
    return policy.init_state(key)._replace(params={"logits": np.zeros(toy.V + 1, np.float32)})

  import dataclasses
  with pytest.raises(trainer.RunSetupError, match="cannot resume from the checkpoint at step 2 .*its saved state "
                     "does not fit this config's"):
    trainer.train(config, wd, policy=dataclasses.replace(policy, init_state=init_state),
                  datasets=toy.toy_datasets(), reward_fns=(toy.contains_answer, None), progress=False)
  train, evals = toy.toy_datasets()
  with pytest.raises(trainer.RunSetupError, match=r"data.train='toy' has 1 usable prompt\(s\), fewer than one step "
                     r"takes \(rl.batch_size / rl.num_generations = 2\)"):
    trainer.train(config, str(tmp_path / "few"), policy=policy, datasets=(train[:1], evals),
                  reward_fns=(toy.contains_answer, None), progress=False)
  assert not os.path.exists(tmp_path / "few" / "checkpoints")  # no checkpointer was opened
  _toy_run(config, wd)  # the same config still resumes
  assert ckpt_lib.Checkpointer(os.path.join(wd, "checkpoints"), read_only=True).latest_step() == 6


def test_a_second_run_in_a_workdir_in_use_is_refused_and_a_finished_one_is_not_rewritten(tmp_path, capsys):
  """Two runs started in one workdir cut each other's metrics back and wrote the same checkpoints; resuming with
  total_steps below the steps done rewrote config.json with it."""
  config = toy.toy_config()
  wd = str(tmp_path / "run")
  os.makedirs(wd)
  held = trainer._lock_workdir(wd)  # what a training process holds for its whole run
  try:
    with pytest.raises(trainer.RunSetupError, match=f"workdir '{wd}' is in use by another training run \\(pid "
                       f"{os.getpid()} on "):
      _toy_run(config, wd)
  finally:
    held.close()
  assert _toy_run(config, wd)["steps"] == 6  # free again; and the run released its own lock at the end
  trainer._lock_workdir(wd).close()
  saved = json.load(open(os.path.join(wd, "config.json")))
  shorter = toy.toy_config()
  shorter.train.total_steps = 3
  capsys.readouterr()
  _toy_run(shorter, wd)
  assert "the checkpoint is at step 6, past train.total_steps=3: nothing to train" in capsys.readouterr().err
  assert json.load(open(os.path.join(wd, "config.json"))) == saved


def test_a_damaged_checkpoint_is_named_as_possibly_damaged(tmp_path):
  config = toy.toy_config()
  wd = str(tmp_path / "run")
  _toy_run(config, wd, stop_after=2)
  state = os.path.join(wd, "checkpoints", "2", "state")
  for root, _, files in os.walk(state):  # every data file of the state's array store truncated
    for name in files:
      if name not in ("_METADATA", "_sharding", "commit_success.txt"):
        open(os.path.join(root, name), "wb").close()
  with pytest.raises(trainer.RunSetupError, match="cannot resume from the checkpoint at step 2 .*or its files are "
                     "damaged .*delete that step's folder to resume from the one before"):
    _toy_run(config, wd)
  _lock = trainer._lock_workdir(wd)  # the failed start released its lock
  _lock.close()


def test_a_run_that_raises_mid_way_keeps_its_last_checkpoint_and_resumes(tmp_path):
  """An exception in step 4 (out of memory, say) leaves the step-2 checkpoint complete when train() returns
  (the save was in flight: train waits for it before the exception goes on), and the same call resumes."""
  import dataclasses
  config = toy.toy_config()
  policy = toy.toy_policy(config)

  def update(state, batch, noise, step, key):
    if step == 3:
      raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
    return policy.update(state, batch, noise, step, key)

  wd = str(tmp_path / "run")
  with pytest.raises(RuntimeError, match="out of memory"):
    trainer.train(config, wd, policy=dataclasses.replace(policy, update=update), datasets=toy.toy_datasets(),
                  reward_fns=(toy.contains_answer, None), progress=False)
  assert ckpt_lib.Checkpointer(os.path.join(wd, "checkpoints"), read_only=True).all_steps() == [2]
  assert _toy_run(config, wd)["steps"] == 6
  full = str(tmp_path / "full")
  _toy_run(config, full)
  assert _deterministic(metrics_lib.read_metrics(wd)) == _deterministic(metrics_lib.read_metrics(full))


def test_a_run_that_raises_before_its_first_step_releases_the_workdir(tmp_path, monkeypatch):
  """An exception between the setup and the loop (the step-0 evaluation out of memory, say) kept the workdir's
  lock and the checkpointer open: a retry in the same process (a notebook) was refused as "in use by another
  training run" naming its own pid."""
  config = toy.toy_config()
  wd = str(tmp_path / "run")
  real = trainer.evaluate

  def oom(*args, **kw):
    raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

  monkeypatch.setattr(trainer, "evaluate", oom)
  with pytest.raises(RuntimeError, match="out of memory") as raised:
    _toy_run(config, wd)
  last_traceback = raised.value.__traceback__  # kept alive, as a notebook's last traceback is (its frames too)
  monkeypatch.setattr(trainer, "evaluate", real)
  assert _toy_run(config, wd)["steps"] == 6
  assert last_traceback is not None


def _default_config():
  import importlib.util
  spec = importlib.util.spec_from_file_location("default_recipe", os.path.join(ROOT, "configs", "default.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def test_data_that_cannot_serve_stops_the_run_before_the_model_loads(tmp_path, monkeypatch):
  """With the tokenizer loaded alone (hf.load_tokenizer), a data set with no usable row or too few prompts is
  refused in a second, where it took the model's loading first (minutes at 7B)."""
  def no_model(config, **kw):
    raise AssertionError("the model was loaded before the data were checked")

  monkeypatch.setattr(trainer, "load_policy", no_model)
  config = _default_config()
  config.data.max_prompt_length = 8  # every synthetic prompt has more tokens with the chat template
  with pytest.raises(trainer.RunSetupError, match=r"data 'synthetic:train:4000:1': no usable rows \(0 malformed, "
                     r"4000 too long\)"):
    trainer.train(config, str(tmp_path / "long"), progress=False)
  config = _default_config()
  config.data.train = "synthetic:train:3"  # 4 prompts a step
  with pytest.raises(trainer.RunSetupError, match="has 3 usable prompt"):
    trainer.train(config, str(tmp_path / "few"), progress=False)


def test_a_run_whose_updates_all_go_non_finite_says_so_and_saves_no_nan(tmp_path, capsys):
  """optim.learning_rate=inf (which validate now refuses) gave NaN updates: they were applied, the saved adapter
  held NaN and the run ended with status 'ok'."""
  config = toy.toy_config()
  config.optim.learning_rate = float("inf")
  wd = str(tmp_path / "inf")
  summary = _toy_run(config, wd)
  assert summary["status"] == "non-finite" and summary["skipped_updates"] == 6
  assert json.load(open(os.path.join(wd, "summary.json")))["status"] == "non-finite"
  state, _ = _final_params(wd, config, toy.toy_policy(config))
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(state.params))
  assert "warning: 6 updates were skipped for a NaN or infinite loss, gradient or update" in capsys.readouterr().err


def test_rewards_that_fail_or_hang_leave_the_run_going_and_say_so(tmp_path, monkeypatch, capsys):
  import threading
  release = threading.Event()

  def hangs(completions, answers):
    release.wait(30)
    return [1.0] * len(completions)

  monkeypatch.setattr(trainer, "REWARD_TIMEOUT_S", 0.05)
  config = toy.toy_config()
  try:
    summary = trainer.train(config, str(tmp_path / "hang"), policy=toy.toy_policy(config),
                            datasets=toy.toy_datasets(), reward_fns=(hangs, None), progress=False)
  finally:
    release.set()
  assert summary["status"] == "rewards-missing" and summary["steps"] == 6
  assert summary["missing_rewards"] == 6 * config.rl.batch_size
  rows = metrics_lib.read_metrics(str(tmp_path / "hang"))
  assert [r["eval/missing_rewards"] for r in rows if "eval/missing_rewards" in r] == [8, 8, 8]  # 8 prompts, 3 evals
  assert "warning: 48 completions got no reward" in capsys.readouterr().err


def test_read_only_checkpointer_leaves_a_save_in_progress(tmp_path, caplog):
  """Evaluation opens a run's checkpoints read-only: a '<step>.orbax-checkpoint-tmp' folder (a save the training
  process is writing at that moment) survives, while the newest complete checkpoint restores; saving raises.
  Opening for training still cleans it (test above). A missing folder is not created."""
  import shutil
  d = tmp_path / "checkpoints"
  c = ckpt_lib.Checkpointer(d, keep=3)
  state = {"w": np.arange(4, dtype=np.float32)}
  c.save(1, state, {"step": 1})
  c.close()
  shutil.copytree(d / "1", d / "2.orbax-checkpoint-tmp")
  from absl import logging as absl_logging
  with caplog.at_level("WARNING"):
    r = ckpt_lib.Checkpointer(d, read_only=True)
    absl_logging.warning("another warning")
  # orbax's notice that the folder is read only (what was asked for) is dropped; other warnings pass
  assert [m for m in caplog.messages if "read only" in m] == [] and "another warning" in caplog.messages
  assert r.latest_step() == 1
  restored, meta = r.restore(None, state)
  np.testing.assert_array_equal(restored["w"], [0, 1, 2, 3])
  assert meta == {"step": 1}
  with pytest.raises(PermissionError, match="read-only"):
    r.save(3, state, {"step": 3})
  r.close()
  assert (d / "2.orbax-checkpoint-tmp").is_dir()
  config = toy.toy_config()
  with pytest.raises(FileNotFoundError):
    trainer.restore_train_state(config, toy.toy_policy(config), str(tmp_path / "no_run"))
  assert not (tmp_path / "no_run").exists()


def test_evaluate_greedy_and_pass_at_k_on_the_toy_policy():
  config = toy.toy_config()
  policy = toy.toy_policy(config)
  logits = np.full((toy.V,), -5.0, np.float32)
  logits[1] = 5.0  # greedy emits token 1 = the digit '0' at every position: "000"
  params = {"logits": jax.numpy.asarray(logits)}
  _, prompts = toy.toy_datasets(n_eval=8)
  expected = np.mean([p.answer == "0" for p in prompts])  # "000" contains only the answer 0
  assert expected == 3 / 8
  ev = trainer.evaluate(policy, params, prompts, toy.contains_answer, batch_size=3,
                        max_new_tokens=toy.T, prompt_length=3)
  assert ev["accuracy"] == expected and ev["num_prompts"] == 8 and len(ev["completions"]) == 8
  assert set(ev["completions"]) == {"000"}
  # pass@k: a prompt counts when any of its k samples is right; never below the per-sample mean
  params = {"logits": jax.numpy.zeros((toy.V,))}
  ev = trainer.evaluate(policy, params, prompts, toy.contains_answer, batch_size=4,
                        max_new_tokens=toy.T, prompt_length=3, num_samples=4,
                        key=jax.random.PRNGKey(1))
  assert ev["sample_accuracy"] <= ev["accuracy"] <= 1.0 and ev["accuracy"] > 0


def test_a_rerun_with_nothing_to_train_prints_the_summary_rows_in_a_fresh_runs_order(tmp_path, capsys):
  """A re-run of a finished run printed its summary table in alphabetical order (summary.json is written with
  sorted keys), not a fresh run's order with status first."""
  config = toy.toy_config()
  wd = str(tmp_path / "run")

  def table_rows():
    out = capsys.readouterr().out
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| ")]

  kw = dict(datasets=toy.toy_datasets(), reward_fns=(toy.contains_answer, None), progress=False)
  capsys.readouterr()
  trainer.run(config, wd, policy=toy.toy_policy(config), **kw)
  fresh = table_rows()
  # summarize's keys in the order it builds them, then the wall time; workdir and None values are not printed
  assert [k for k, _ in fresh] == ["status", "steps", "skipped_updates", "missing_rewards", "initial_accuracy",
                                   "final_accuracy", "best_accuracy", "final_reward", "mean_entropy_first_quarter",
                                   "mean_step_time_s", "wall_time_s"]
  trainer.run(config, wd, policy=toy.toy_policy(config), **kw)  # nothing to train: summary.json as it is
  assert table_rows() == fresh


def test_a_rerun_with_nothing_to_train_keeps_the_summary(tmp_path, capsys):
  """A re-run of a finished run rewrote summary.json: its wall time grew by the re-run's seconds, and with a
  smaller total_steps its metrics were recomputed over that many steps; it also warned that the config differs."""
  config = toy.toy_config()
  wd = str(tmp_path / "run")
  first = _toy_run(config, wd)
  path = os.path.join(wd, "summary.json")
  before = open(path).read()
  assert json.loads(before) == first
  for total, said in ((6, "the run is complete (step 6 of train.total_steps=6): nothing to train"),
                      (3, "the checkpoint is at step 6, past train.total_steps=3: nothing to train")):
    again = toy.toy_config()
    again.train.total_steps = total
    capsys.readouterr()
    assert _toy_run(again, wd) == first
    err = capsys.readouterr().err
    assert said in err and "differs" not in err, err
    assert open(path).read() == before
  again = toy.toy_config()  # another key changed: the message says it changes nothing, and nothing is rewritten
  again.optim.learning_rate = 0.2
  capsys.readouterr()
  assert _toy_run(again, wd) == first
  err = capsys.readouterr().err
  assert ("the run is complete (step 6 of train.total_steps=6): nothing to train; raise --config.train.total_steps "
          "to continue it; the config differs from the checkpoint's (optim.learning_rate: 0.1 -> 0.2), which changes "
          "nothing here: give a new --workdir to train with it") in err, err
  assert open(path).read() == before
  os.remove(path)  # a run stopped between its last checkpoint and summary.json: made from the metrics now
  remade = _toy_run(config, wd)
  assert {k: v for k, v in remade.items() if k != "wall_time_s"} == {k: v for k, v in first.items()
                                                                      if k != "wall_time_s"}


def test_summary_entropy_leaves_out_a_step_whose_loss_counted_no_token(tmp_path, monkeypatch):
  """With rl.mask_truncated_completions (the default), a step whose completions are all truncated counts no token:
  its entropy is logged as 0, a placeholder, and the summary's mean_entropy_first_quarter averaged it in."""
  config = toy.toy_config()
  config.train.total_steps = 8  # first quarter: steps 1 and 2
  policy = toy.toy_policy(config)
  calls = []

  def generate(params, noise, pt, pm, key, *, greedy, **kw):
    ro = toy._generate(params, noise, pt, pm, key, greedy=greedy, **kw)
    if not greedy:
      calls.append(1)
    if not greedy and len(calls) == 1:  # step 1: no completion ends within T tokens
      tokens = jax.numpy.where(ro.tokens == 0, 1, ro.tokens)
      n = tokens.shape[0]
      ro = dataclasses.replace(ro, tokens=tokens, mask=jax.numpy.ones_like(ro.mask),
                               lengths=jax.numpy.full((n,), toy.T), truncated=jax.numpy.ones((n,), bool),
                               finished=jax.numpy.zeros((n,), bool))
    return ro

  wd = str(tmp_path / "run")
  trainer.train(config, wd, policy=dataclasses.replace(policy, generate=generate), datasets=toy.toy_datasets(),
                reward_fns=(toy.contains_answer, None), progress=False, stop_after=2)
  rows = {r["step"]: r for r in metrics_lib.read_metrics(wd) if "loss" in r}
  assert rows[1]["num_tokens"] == 0 and rows[1]["entropy"] == 0.0 and rows[1]["completions/clipped_ratio"] == 1.0
  assert rows[2]["num_tokens"] > 0 and rows[2]["entropy"] > 0.1  # ten digits near uniform: about ln(11)
  assert trainer.summarize(wd, 8)["mean_entropy_first_quarter"] == pytest.approx(rows[2]["entropy"])
  assert trainer.summarize(wd, 4)["mean_entropy_first_quarter"] is None  # the first quarter is step 1 alone
  # a relative workdir is reported as the absolute path the final line prints
  monkeypatch.chdir(tmp_path)
  assert trainer.summarize("run", 8)["workdir"] == wd


def test_a_resume_with_more_total_steps_names_the_schedule_jump(tmp_path, capsys):
  """Raising total_steps on resume restretches the cosine learning rate and the AQN stages; the warning only
  said the run would not match an uninterrupted one, while the rate jumped from 0 to most of its peak."""
  config = toy.toy_config()
  wd = str(tmp_path / "run")
  _toy_run(config, wd)
  longer = toy.toy_config()
  longer.train.total_steps = 10
  capsys.readouterr()
  _toy_run(longer, wd, stop_after=1)
  err = capsys.readouterr().err
  # by hand: 6 updates done; warmup ceil(0.1 * steps) = 1 update; cosine to 0 at the total
  lr_new = 0.1 * 0.5 * (1 + np.cos(np.pi * (6 - 1) / (10 - 1)))
  # the paper's stages (K = 10): stage floor(6 * 10 / total); stage k >= 1 is 1e-2 * (5e-4 / 1e-2) ** ((k - 1) / 8)
  sigma_new = 1e-2 * (5e-4 / 1e-2) ** ((6 - 1) / 8)  # stage 6 of 10 steps; the old schedule is at stage 9: 5e-4
  assert (f"from step 7 the learning rate is {lr_new:.3g} (was 0) and the AQN sigma {sigma_new:.3g} (was 0.0005)."
          in " ".join(err.split())), err


@pytest.mark.parametrize("on_before,on_now", [(False, True), (True, False), (False, False)])
def test_a_resume_with_more_total_steps_says_when_aqn_was_or_is_off(tmp_path, capsys, on_before, on_now):
  """A run with aqn.enabled=False resumed with AQN on and more total_steps was told "the AQN sigma 0.00154 (was
  0.0005)": the checkpoint's sigma came from this config's AQN, while its run drew no noise. The note now uses
  the checkpoint's aqn values and says where AQN was off (or is off now)."""
  config = toy.toy_config()
  config.aqn.enabled = on_before
  wd = str(tmp_path / "run")
  _toy_run(config, wd, stop_after=2)  # a checkpoint at step 2 of 6
  longer = toy.toy_config()
  longer.aqn.enabled = on_now
  longer.train.total_steps = 10
  capsys.readouterr()
  _toy_run(longer, wd, stop_after=1)
  err = " ".join(capsys.readouterr().err.split())
  # by hand: 2 updates done; warmup 1 update; cosine to 0 at the total
  lr_new, lr_old = (0.1 * 0.5 * (1 + np.cos(np.pi * (2 - 1) / (n - 1))) for n in (10, 6))
  lr = f"from step 3 the learning rate is {lr_new:.3g} (was {lr_old:.3g})"
  # the paper's stages (K = 10): stage floor(2 * 10 / total); stage k >= 1 is 1e-2 * (5e-4 / 1e-2) ** ((k - 1) / 8)
  sigma_new = 1e-2 * (5e-4 / 1e-2) ** ((2 - 1) / 8)  # stage 2 of 10 steps
  sigma_old = 1e-2 * (5e-4 / 1e-2) ** ((3 - 1) / 8)  # stage 3 of 6 steps
  if on_now:
    assert f"{lr}; AQN was off (no noise) and is now on, at sigma {sigma_new:.3g}." in err, err
  elif on_before:
    assert f"{lr}; AQN is now off (no noise; it was at sigma {sigma_old:.3g})." in err, err
  else:
    assert f"sets the learning-rate schedule, which now stretches to 10 steps: {lr}." in err, err
  assert "AQN sigma" not in err, err


def test_a_resume_with_more_total_steps_and_another_learning_rate_gives_the_checkpoints_rate(tmp_path, capsys):
  """The note's "was" learning rate came from this config's optim values, so a resume that also changed
  optim.learning_rate reported the new peak's rate as the checkpoint's."""
  config = toy.toy_config()
  config.aqn.enabled = False
  wd = str(tmp_path / "run")
  _toy_run(config, wd, stop_after=2)  # a checkpoint at step 2 of 6, peak 0.1
  longer = toy.toy_config()
  longer.aqn.enabled = False
  longer.train.total_steps = 10
  longer.optim.learning_rate = 0.05
  capsys.readouterr()
  _toy_run(longer, wd, stop_after=1)
  err = " ".join(capsys.readouterr().err.split())
  # by hand: 2 updates done; warmup 1 update; cosine to 0 at the total; each schedule at its own peak
  lr_new = 0.05 * 0.5 * (1 + np.cos(np.pi * (2 - 1) / (10 - 1)))
  lr_old = 0.1 * 0.5 * (1 + np.cos(np.pi * (2 - 1) / (6 - 1)))
  assert f"from step 3 the learning rate is {lr_new:.3g} (was {lr_old:.3g})." in err, err


def test_a_resume_with_another_config_names_the_flags_that_restore_the_checkpoints(tmp_path, capsys):
  """The config-diff warning told the user to "pass the first run's --config overrides again", which is wrong
  where a default changed since the checkpoint (model.attn_impl "xla" -> "auto" in session 43): it now gives the
  flags with the checkpoint's values, and resuming with them warns no more."""
  config = toy.toy_config()
  wd = str(tmp_path / "run")
  _toy_run(config, wd, stop_after=2)
  changed = toy.toy_config()
  changed.rl.epsilon = 0.3
  changed.rl.loss_type = "dapo"
  capsys.readouterr()
  _toy_run(changed, wd, stop_after=1)
  lines = capsys.readouterr().err.splitlines()
  (i,) = [i for i, line in enumerate(lines) if line.startswith("warning: resuming with a config that differs")]
  assert lines[i].endswith("To continue it unchanged, pass the checkpoint's values:"), lines[i]
  # the flags alone on the next line (a full stop after the last one went with it when copied: "grpo." or, for
  # total_steps, "6." which the command line refuses); copied as printed, they parse to the checkpoint's values
  assert lines[i + 1] == "  --config.rl.epsilon=0.2 --config.rl.loss_type=grpo"
  import shlex
  parsed = _parse_config_flags(shlex.split(lines[i + 1]))
  assert (parsed["rl"]["epsilon"], parsed["rl"]["loss_type"]) == (0.2, "grpo")
  assert trainer._override_flags([("lora.target_modules", ["q", "k"], ["q"]), ("model.path", "a b", "c"),
                                  ("rl.mask_truncated_completions", True, False)]) == (
      "'--config.lora.target_modules=('\"'\"'q'\"'\"', '\"'\"'k'\"'\"')' '--config.model.path=a b' "
      "--config.rl.mask_truncated_completions=True")
  changed.rl.epsilon, changed.rl.loss_type = 0.2, "grpo"  # what those flags set
  _toy_run(changed, wd, stop_after=1)
  assert "differs from the checkpoint" not in capsys.readouterr().err


def _parse_config_flags(argv):
  """The config experiments/train.py's command line parser (absl + ml_collections' DEFINE_config_file on
  configs/default.py) builds from ``argv`` (``--config.<key>=<value>`` flags), as a JSON dict; or the parser's
  error (a string)."""
  code = ("import json, sys\n"
          "from absl import flags\n"
          "from ml_collections import config_flags\n"
          "c = config_flags.DEFINE_config_file('config', None, '', lock_config=True)\n"
          "try:\n"
          "  flags.FLAGS(sys.argv)\n"
          "except Exception as e:\n"
          "  print(json.dumps(f'{type(e).__name__}: {e}')); sys.exit()\n"
          "print(c.value.to_json_best_effort())\n")
  r = subprocess.run([sys.executable, "-c", code, f"--config={os.path.join(ROOT, 'configs', 'default.py')}", *argv],
                     capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": _pythonpath()})
  assert r.returncode == 0, r.stderr[-2000:]
  return json.loads(r.stdout)


def test_the_resume_warning_restores_a_saved_none_with_a_flag_the_command_line_takes(tmp_path, capsys):
  """A config file may set rl.epsilon_high or rl.rollout_correction_clip_min to None; the command line cannot (a
  float key: "could not convert string to float: 'None'"), yet the warning told the user to pass
  --config.rl.epsilon_high=None. It now passes the value None means (epsilon; 0), and a None against that value
  is no difference: clip_min None and 0.0 train alike, so they no longer warn that the run will not match."""
  import shlex
  config = toy.toy_config()
  config.rl.epsilon, config.rl.epsilon_high = 0.2, None
  config.rl.rollout_correction, config.rl.rollout_correction_clip_min = "token_truncate", None
  train_config.validate(config, check_paths=False)
  policy = dataclasses.replace(toy.toy_policy(config), old_logprobs=_offset_old_logprobs([0.1, -0.2, 0.3]))
  kw = dict(policy=policy, datasets=toy.toy_datasets(), reward_fns=(toy.contains_answer, None), progress=False)
  wd = str(tmp_path / "run")
  trainer.train(config, wd, stop_after=2, **kw)
  resumed = toy.toy_config()  # the command line's defaults: epsilon_high 0.28, clip_min 0.0
  resumed.rl.rollout_correction = "token_truncate"
  capsys.readouterr()
  trainer.train(resumed, wd, stop_after=1, **kw)
  err = " ".join(capsys.readouterr().err.split())
  assert "(rl.epsilon_high: None -> 0.28); the run will not match" in err, err
  assert err.endswith("pass the checkpoint's values: --config.rl.epsilon_high=0.2 resuming from the checkpoint at "
                      f"step 2 in {os.path.join(wd, 'checkpoints')}"), err
  parsed = _parse_config_flags(shlex.split("--config.rl.epsilon_high=0.2"))
  assert parsed["rl"]["epsilon_high"] == 0.2
  resumed.rl.epsilon_high = parsed["rl"]["epsilon_high"]
  trainer.train(resumed, wd, stop_after=1, **kw)
  assert "differs from the checkpoint" not in capsys.readouterr().err
  # the other way, a None in this run's config file: ml_collections cannot override it, so the file must change
  assert trainer._override_flags([("rl.epsilon_high", 0.28, None), ("rl.epsilon", 0.2, 0.3)]) == (
      "--config.rl.epsilon=0.2 and, in the config file (the command line cannot set None, nor override a key that "
      "is None there): rl.epsilon_high = 0.28")
  # a saved None with no command-line equivalent is named for the file too, never passed as the text "None"
  saved = json.loads(toy.toy_config().to_json_best_effort())
  assert trainer._override_flags([("data.eval", None, "x.jsonl"), ("model.remat", None, True)], saved) == (
      "--config.data.eval= and, in the config file (the command line cannot set None, nor override a key that is "
      "None there): model.remat = None")
  assert _parse_config_flags(["--config.data.eval="])["data"]["eval"] == ""
  assert "could not convert string to float: 'None'" in _parse_config_flags(["--config.rl.epsilon_high=None"])


def test_a_resume_with_the_lora_modules_reordered_is_the_same_run(tmp_path, capsys):
  """lora.LoRAConfig keeps target_modules in its own order, once each, so ('v', 'q', ...) builds the adapter of
  ('q', 'v', ...); the resume refused it as "the trained state's shapes differ" (a tuple is compared as a list)."""
  from qerl_jax import lora
  modules = ("q", "k", "v", "o", "gate", "up", "down")
  reordered = ("down", "v", "q", "q", "up", "gate", "o", "k")
  assert lora.LoRAConfig(target_modules=reordered) == lora.LoRAConfig(target_modules=modules)
  config = toy.toy_config()
  config.lora.target_modules = modules
  wd = str(tmp_path / "run")
  _toy_run(config, wd, stop_after=2)
  again = toy.toy_config()
  again.lora.target_modules = reordered
  capsys.readouterr()
  _toy_run(again, wd, stop_after=1)
  err = capsys.readouterr().err
  assert "differs from the checkpoint" not in err and "resuming from the checkpoint at step 2" in err, err
  again.lora.target_modules = ("q", "k", "v")  # other modules: other shapes, still refused
  with pytest.raises(trainer.RunSetupError, match=r"lora.target_modules=\['q', 'k', 'v'\] \(the checkpoint has "):
    _toy_run(again, wd, stop_after=1)


def test_recompute_old_logprobs_feeds_the_update_and_logs_the_sampler_difference(tmp_path):
  """rl.recompute_old_logprobs: the update's old log-probs come from policy.old_logprobs (here the sampler's
  plus 0.25 nats on every completion token), and the step logs how far the sampler's were from them."""
  config = toy.toy_config()
  config.rl.recompute_old_logprobs = True
  seen = []
  policy = toy.toy_policy(config)
  inner = policy.update

  def update(state, batch, noise, step, key):
    seen.append((np.asarray(batch["old_logprobs"]), np.asarray(batch["completion_mask"])))
    return inner(state, batch, noise, step, key)

  shifted = lambda params, batch, noise: batch["old_logprobs"] + 0.25 * batch["completion_mask"]
  run = dataclasses.replace(policy, update=update, old_logprobs=shifted)
  kw = dict(datasets=toy.toy_datasets(), reward_fns=(toy.contains_answer, None), progress=False)
  trainer.train(config, str(tmp_path / "on"), policy=run, stop_after=2, **kw)
  rows = [r for r in metrics_lib.read_metrics(str(tmp_path / "on")) if "loss" in r]
  assert [r["sampling/sampling_logp_difference/mean"] for r in rows] == pytest.approx([0.25, 0.25], abs=1e-6)
  assert [r["sampling/sampling_logp_difference/max"] for r in rows] == pytest.approx([0.25, 0.25], abs=1e-6)
  plain = []
  policy_off = dataclasses.replace(policy, update=lambda s, b, *a: (plain.append(np.asarray(b["old_logprobs"])),
                                                                    inner(s, b, *a))[1])
  config_off = toy.toy_config()
  trainer.train(config_off, str(tmp_path / "off"), policy=policy_off, stop_after=2, **kw)
  for (old, mask), sampler in zip(seen, plain):  # same seed, same rollouts: exactly 0.25 more where it counts
    np.testing.assert_allclose(old, sampler + 0.25 * mask, atol=1e-6)
  with pytest.raises(trainer.RunSetupError, match=r"rl.recompute_old_logprobs=True \(or .*\) needs a policy with "):
    trainer.train(config, str(tmp_path / "none"), policy=policy, **kw)


def test_policy_old_logprobs_are_the_training_forward_with_the_adapter():
  """load_policy's old_logprobs: a micro-batched forward with the adapter and the noise, at the sampling
  temperature, equal to one whole-batch token_logprobs call (random:tiny, NVFP4)."""
  from qerl_jax import lora, models
  from qerl_jax.trainer import _load_base
  c = toy.toy_config()
  c.model.path = "random:tiny"
  c.model.quant = "nvfp4"
  c.rl.micro_batch_size = 2
  c.sampling.temperature = 0.8
  policy = trainer.load_policy(c)
  cfg, base, _, _ = _load_base(c)
  params = policy.init_state(jax.random.key(0)).params
  params = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), params)
  noise = policy.noise(40)
  rng = np.random.default_rng(0)
  n, p, t = 4, 3, 5
  prompt = rng.integers(3, cfg.vocab_size, (n, p)).astype(np.int32)
  pmask = np.ones((n, p), np.int32)
  pmask[1, :1] = 0
  comp = rng.integers(3, cfg.vocab_size, (n, t)).astype(np.int32)
  cmask = np.ones((n, t), np.int32)
  cmask[3, 2:] = 0
  batch = {"prompt_tokens": prompt, "prompt_mask": pmask, "completion_tokens": comp, "completion_mask": cmask}
  got = np.asarray(policy.old_logprobs(params, batch, noise))
  full, fmask = np.concatenate([prompt, comp], 1), np.concatenate([pmask, cmask], 1)
  scale = lora.scale(lora.LoRAConfig(r=int(c.lora.rank), lora_alpha=float(c.lora.alpha)))
  lp, _ = models.token_logprobs(cfg, base, jax.numpy.asarray(full), models.positions_from_mask(fmask),
                                attn_mask=jax.numpy.asarray(fmask), remat=False, lora=params, lora_cfg=scale,
                                norm_noise=noise, temperature=0.8)
  want = np.asarray(lp)[:, p:]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  without = np.asarray(policy.ref_logprobs(batch, None))
  assert np.abs(got - without).max() > 1e-3  # the adapter and the noise are in it


def test_rollout_only_aqn_takes_the_update_policy_as_the_old_one(tmp_path):
  """With AQN in the rollout only, the sampler's log-probs are a noisy policy's: as QeRL's TRL loop, the update
  gets no old log-probs with one iteration (its own detached ones: ratio 1), and recomputed ones with two."""
  kw = dict(datasets=toy.toy_datasets(), reward_fns=(toy.contains_answer, None), progress=False)
  for iterations in (1, 2):
    config = toy.toy_config()
    config.aqn.enabled, config.aqn.rollout_only, config.rl.num_iterations = True, True, iterations
    seen = []
    policy = toy.toy_policy(config)
    inner = policy.update

    def update(state, batch, noise, step, key, seen=seen, inner=inner):
      seen.append(None if "old_logprobs" not in batch else np.asarray(batch["old_logprobs"]))
      return inner(state, batch, noise, step, key)

    recomputed = lambda params, batch, noise: jax.numpy.full_like(batch["old_logprobs"], -0.5)
    if iterations == 2:
      with pytest.raises(trainer.RunSetupError, match=r"aqn.rollout_only with rl.num_iterations > 1\) needs"):
        trainer.train(config, str(tmp_path / "none"), policy=dataclasses.replace(policy, update=update), **kw)
    run = dataclasses.replace(policy, update=update, old_logprobs=recomputed)
    trainer.train(config, str(tmp_path / f"it{iterations}"), policy=run, stop_after=1, **kw)
    if iterations == 1:
      assert seen == [None]
    else:
      assert len(seen) == 2 and all((s == -0.5).all() for s in seen)


def _validation_problems(**kw) -> list[str]:
  """train_config.validate's problem lines for the toy config with ``section__name=value`` overrides ([] if none)."""
  c = toy.toy_config()
  for key, value in kw.items():
    section, name = key.split("__")
    c[section][name] = value
  try:
    train_config.validate(c, check_paths=False)
  except ValueError as e:
    return str(e).splitlines()[1:]
  return []


def test_validate_rollout_correction_keys():
  """rl.rollout_correction: TRL's four modes and verl's two geometric ones (grpo's), bounds 0 <= clip_min < clip_max, no effect with "none", and
  refused with rollout-only AQN; it needs no rl.recompute_old_logprobs=True (it implies the recompute)."""
  from qerl_jax import grpo
  assert train_config.ROLLOUT_CORRECTIONS == ("none",) + grpo.ROLLOUT_CORRECTION_MODES

  problems = _validation_problems

  for mode in grpo.ROLLOUT_CORRECTION_MODES:
    for clip_min in (0.0, None, 0.5):
      assert problems(rl__rollout_correction=mode, rl__rollout_correction_clip_min=clip_min) == []
  assert problems(rl__rollout_correction="token_mask", rl__rollout_correction_clip_max=10) == []
  assert problems(rl__rollout_correction="tis") == [
      "  - rl.rollout_correction='tis' is not one of ('none', 'token_truncate', 'token_mask', 'sequence_truncate', "
      "'sequence_mask', 'geometric_truncate', 'geometric_mask')"]
  assert problems(rl__rollout_correction="token_mask", rl__rollout_correction_clip_max=0.0) == [
      "  - rl.rollout_correction_clip_max=0.0 must be a number > 0 (the upper bound of the importance ratio rho)"]
  assert problems(rl__rollout_correction="token_mask", rl__rollout_correction_clip_max=None) == [
      "  - rl.rollout_correction_clip_max=None must be a number > 0 (the upper bound of the importance ratio rho)"]
  assert problems(rl__rollout_correction="token_mask", rl__rollout_correction_clip_min=-0.5) == [
      "  - rl.rollout_correction_clip_min=-0.5 must be a number >= 0, or None (0 and None: no lower bound)"]
  assert problems(rl__rollout_correction="sequence_mask", rl__rollout_correction_clip_min=3.0) == [
      "  - rl.rollout_correction_clip_min=3.0 must be < rl.rollout_correction_clip_max=3.0"]
  assert problems(rl__rollout_correction="token_mask", rl__rollout_correction_clip_max=float("nan")) == [
      "  - rl.rollout_correction_clip_max=nan must be a finite number (within float32's range)"]  # once
  assert problems(rl__rollout_correction_clip_max=2.0, rl__rollout_correction_clip_min=0.5) == [
      "  - rl.rollout_correction_clip_min=0.5 and rl.rollout_correction_clip_max=2.0 have no effect with "
      "rl.rollout_correction='none'; choose a mode too"]
  (msg,) = problems(rl__rollout_correction="token_truncate", aqn__enabled=True, aqn__rollout_only=True)
  assert msg.startswith("  - rl.rollout_correction='token_truncate' cannot be used with aqn.rollout_only=True: the "
                        "sampler's log-probs are then the noisy rollout policy's")
  # a config saved before the keys existed reads them as their legacy values: no config-diff warning on resume
  c = toy.toy_config()
  saved = json.loads(c.to_json_best_effort())
  for key in ("rollout_correction", "rollout_correction_clip_max", "rollout_correction_clip_min"):
    del saved["rl"][key]
  assert trainer._config_diff(saved, json.loads(c.to_json_best_effort())) == []


def test_importance_sampling_level_reaches_the_update_and_is_validated():
  """rl.importance_sampling_level ("sequence": GSPO) is TRL's field of that name in the update's options, a bad
  value is named by validate, and a config saved before the key existed reads it as "token"."""
  c = toy.toy_config()
  assert trainer.update_config(c)["importance_sampling_level"] == "token"
  c.rl.importance_sampling_level = "sequence"
  train_config.validate(c, check_paths=False)
  assert trainer.update_config(c)["importance_sampling_level"] == "sequence"
  c.rl.importance_sampling_level = "seq"
  with pytest.raises(ValueError, match=r"rl.importance_sampling_level='seq' is not one of \('token', 'sequence'\)"):
    train_config.validate(c, check_paths=False)
  fresh = toy.toy_config()
  saved = json.loads(fresh.to_json_best_effort())
  del saved["rl"]["importance_sampling_level"]
  assert trainer._config_diff(saved, json.loads(fresh.to_json_best_effort())) == []


def test_delta_and_top_entropy_quantile_reach_the_update_and_are_validated():
  """rl.delta (INTELLECT-2's cap; 0 or None: off) and rl.top_entropy_quantile are TRL's delta and
  top_entropy_quantile in the update's options; validate names bad values once each."""
  c = toy.toy_config()  # epsilon 0.2, epsilon_high 0.28
  opts = trainer.update_config(c)
  assert opts["delta"] is None and opts["top_entropy_quantile"] == 1.0
  c.rl.delta, c.rl.top_entropy_quantile = 4.0, 0.2
  train_config.validate(c, check_paths=False)
  opts = trainer.update_config(c)
  assert opts["delta"] == 4.0 and opts["top_entropy_quantile"] == 0.2
  c.rl.delta = None  # a config file's None: off, as 0
  train_config.validate(c, check_paths=False)
  assert trainer.update_config(c)["delta"] is None

  problems = lambda **kw: _validation_problems(**{f"rl__{key}": value for key, value in kw.items()})

  assert problems(delta=1.2) == ["  - rl.delta=1.2 must be 0 (off) or a number > 1 + rl.epsilon_high (INTELLECT-2's "
                                 "cap on the unclipped importance ratio)"]
  assert problems(delta=1.29) == []
  assert problems(top_entropy_quantile=0.0) == []  # TRL's lower end: the highest-entropy token (and ties) only
  assert problems(top_entropy_quantile=-0.1) == ["  - rl.top_entropy_quantile=-0.1 must be in [0, 1] (1: every token; 0: "
                                                 "the highest-entropy token and its ties)"]
  assert problems(top_entropy_quantile=1.5) == ["  - rl.top_entropy_quantile=1.5 must be in [0, 1] (1: every token; 0: "
                                                "the highest-entropy token and its ties)"]
  assert problems(delta=float("nan")) == ["  - rl.delta=nan must be a finite number (within float32's range)"]
  # cispo: rl.epsilon_high is its absolute cap; the recipes' 0.28 would shrink every weight, and delta has no branch
  assert problems(loss_type="cispo") == [
      "  - rl.loss_type='cispo' takes rl.epsilon_high as its cap epsilon_max on the importance weight, and 0.28 < 1 "
      "would shrink every on-policy token's weight: set it, e.g. --config.rl.epsilon_high=5.0 (TRL's and ScaleRL's "
      "recommendation)"]
  assert problems(loss_type="cispo", epsilon_high=5.0) == []
  # sapo: its gate temperatures (TRL's defaults pass), no delta
  assert problems(loss_type="sapo") == []
  assert problems(loss_type="sapo", sapo_temperature_neg=0.0) == [
      "  - rl.sapo_temperature_neg=0.0 must be > 0 (SAPO's gate temperature)"]
  assert problems(loss_type="sapo", delta=4.0) == [
      "  - rl.delta=4.0 caps the clipped losses' unclipped branch; rl.loss_type='sapo' has none: leave rl.delta=0"]
  c = toy.toy_config()
  c.rl.loss_type, c.rl.sapo_temperature_pos = "sapo", 2.0
  assert (trainer.update_config(c)["sapo_temperature_pos"], trainer.update_config(c)["sapo_temperature_neg"]) == (
      2.0, 1.05)
  assert problems(loss_type="cispo", epsilon_high=5.0, delta=7.0) == [
      "  - rl.delta=7.0 caps the clipped losses' unclipped branch; rl.loss_type='cispo' has none (its cap is "
      "rl.epsilon_high): leave rl.delta=0"]
  saved = json.loads(toy.toy_config().to_json_best_effort())
  for key in ("delta", "top_entropy_quantile", "sapo_temperature_pos", "sapo_temperature_neg"):
    del saved["rl"][key]
  assert trainer._config_diff(saved, json.loads(toy.toy_config().to_json_best_effort())) == []


def _offset_old_logprobs(offsets):
  """A Policy.old_logprobs that returns the sampler's log-probs plus ``offsets[t]`` on completion token ``t`` (the
  toy's sampler and training forward agree bitwise on the CPU: rho would be exactly 1)."""
  return lambda params, batch, noise: (batch["old_logprobs"]
                                       + jax.numpy.asarray(offsets, np.float32)[None] * batch["completion_mask"])


@pytest.mark.parametrize("mode,clip_min,clip_max", [("token_truncate", 0.5, 3.0), ("sequence_mask", None, 2.0),
                                                     ("geometric_truncate", 0.5, 1.29)])
def test_rollout_correction_weights_the_update_and_logs_trl_ratio_metrics(tmp_path, mode, clip_min, clip_max):
  """rl.rollout_correction recomputes the old log-probs (without rl.recompute_old_logprobs) and hands the update
  rho = the trainer's over the sampler's probability, truncated or masked, with TRL's ratio metrics; the loss
  then differs from the uncorrected run's on the same rollout, and with no mismatch (rho = 1) the run is the
  uncorrected one exactly."""
  offsets = [1.5, -1.0, 0.3]  # ratios e^1.5 = 4.5 (above clip_max), e^-1 = 0.37 (below 0.5), e^0.3 = 1.35
  kw = dict(datasets=toy.toy_datasets(), reward_fns=(toy.contains_answer, None), progress=False, stop_after=2)

  def run(name, correction, old_logprobs):
    config = toy.toy_config()
    config.rl.recompute_old_logprobs = correction == "none"
    config.rl.rollout_correction = correction
    if correction != "none":
      config.rl.rollout_correction_clip_min, config.rl.rollout_correction_clip_max = clip_min, clip_max
    train_config.validate(config, check_paths=False)
    policy = toy.toy_policy(config)
    seen, inner = [], policy.update

    def update(state, batch, noise, step, key):
      seen.append({k: np.asarray(v) for k, v in batch.items()})
      return inner(state, batch, noise, step, key)

    trainer.train(config, str(tmp_path / name), policy=dataclasses.replace(policy, update=update,
                                                                           old_logprobs=old_logprobs), **kw)
    return [r for r in metrics_lib.read_metrics(str(tmp_path / name)) if "loss" in r], seen

  rows, seen = run("on", mode, _offset_old_logprobs(offsets))
  plain_rows, plain_seen = run("off", "none", _offset_old_logprobs(offsets))
  p = "sampling/importance_sampling_ratio/"
  assert len(rows) == len(seen) == len(plain_rows) == 2
  for row, batch in zip(rows, seen):
    counted = (batch["completion_mask"] > 0) & ~batch["truncated"][:, None]  # mask_truncated_completions=True
    d = np.where(counted, np.asarray(offsets)[None], 0.0)
    if mode == "token_truncate":
      want = np.where(counted, np.clip(np.exp(d), clip_min, clip_max), 0.0)
      values = want[counted]
    elif mode == "geometric_truncate":  # e^(mean of the row's counted offsets), clipped
      seq = np.clip(np.exp(d.sum(1) / np.maximum(counted.sum(1), 1)), clip_min, clip_max)
      want = np.where(counted, seq[:, None], 0.0)
      values = seq[counted.any(1)]
    else:
      seq = np.exp(d.sum(1))
      seq = np.where(seq <= clip_max, seq, 0.0)
      want = np.where(counted, seq[:, None], 0.0)
      values = seq[counted.any(1)]
    np.testing.assert_allclose(batch["rollout_is_weights"], want, rtol=1e-6)
    assert values.size and all(math.isfinite(row[p + k]) for k in ("min", "mean", "max"))
    np.testing.assert_allclose([row[p + k] for k in ("min", "mean", "max")],
                               [values.min(), values.mean(), values.max()], rtol=1e-6)
    assert (clip_min or 0.0) <= row[p + "min"] <= row[p + "max"] <= clip_max
    assert row["sampling/sampling_logp_difference/max"] == pytest.approx(1.5, abs=1e-6)
  assert all("rollout_is_weights" not in b for b in plain_seen)
  assert not any(k.startswith(p) for r in plain_rows for k in r)
  # the first step samples the same rollout with the same old log-probs: only the weights differ
  np.testing.assert_array_equal(seen[0]["old_logprobs"], plain_seen[0]["old_logprobs"])
  assert rows[0]["loss"] != plain_rows[0]["loss"]
  # no mismatch (the recompute gives the sampler's values): rho is exactly 1 and the run is the uncorrected one
  same = lambda params, batch, noise: batch["old_logprobs"]
  ones, ones_seen = run("ones", mode, same)
  plain, _ = run("plain", "none", same)
  assert all(r[p + k] == 1.0 for r in ones for k in ("min", "mean", "max"))
  assert all(np.all(b["rollout_is_weights"][(b["completion_mask"] > 0) & ~b["truncated"][:, None]] == 1.0)
             for b in ones_seen)
  strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(p)} for r in _deterministic(rs)]
  assert strip(ones) == strip(plain)


def test_rollout_correction_with_rollout_only_aqn_is_refused_by_the_trainer_too(tmp_path):
  config = toy.toy_config()
  config.aqn.enabled, config.aqn.rollout_only, config.rl.rollout_correction = True, True, "token_mask"
  policy = dataclasses.replace(toy.toy_policy(config), old_logprobs=_offset_old_logprobs([0.0, 0.0, 0.0]))
  with pytest.raises(trainer.RunSetupError, match=r"rl.rollout_correction='token_mask' cannot be used with "
                                                  r"aqn.rollout_only=True"):
    trainer.train(config, str(tmp_path / "wd"), policy=policy, datasets=toy.toy_datasets(),
                  reward_fns=(toy.contains_answer, None), progress=False)
  config.aqn.rollout_only = False  # and a policy that cannot recompute is named
  with pytest.raises(trainer.RunSetupError, match=r"rl.rollout_correction other than 'none'.* needs a policy with "):
    trainer.train(config, str(tmp_path / "wd2"), policy=toy.toy_policy(config), datasets=toy.toy_datasets(),
                  reward_fns=(toy.contains_answer, None), progress=False)


def test_format_reward_kind_chooses_the_bonus():
  """rl.format_reward_kind picks the form the format bonus checks; think_answer is QeRL's released term."""
  c = toy.toy_config()
  c.data.task = "gsm8k"
  c.rl.format_reward_weight = 0.1
  c.rl.format_reward_kind = "think_answer"
  _, bonus = trainer.make_reward_fns(c)
  assert bonus(["<think>6 * 3</think>\n<answer>18</answer>", "#### 18", "<answer>18</answer>"],
               ["18"] * 3) == [0.1, 0.0, 0.0]
  c.rl.format_reward_kind = "any"
  _, bonus = trainer.make_reward_fns(c)
  assert bonus(["<think>6 * 3</think>\n<answer>18</answer>", "#### 18", "18"], ["18"] * 3) == [0.1, 0.1, 0.0]
  c.rl.format_reward_kind = "thinking"
  with pytest.raises(ValueError, match="rl.format_reward_kind='thinking' is not one of"):
    train_config.validate(c)
