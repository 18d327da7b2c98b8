"""Tests for qerl_jax.aqn: the noise schedule and the noise draw."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qerl_jax import aqn

PAPER = dict(sigma_start=1e-2, sigma_end=5e-4, num_stages=10)


# ---------------------------------------------------------------- schedule ---

@pytest.mark.parametrize("total_steps", [100, 1000, 37])
def test_sigma_stage_values_hand_computed(total_steps):
  t, kk = total_steps, 10
  # First step of stage k is ceil(k * T / K); the last is ceil((k+1) * T / K) - 1.
  first = lambda k: -(-k * t // kk)
  cases = {
      0: 0.0,
      1: 1e-2,
      5: 1e-2 * 0.05 ** 0.5,  # exponent (5 - 1) / (10 - 2) = 1/2
      9: 5e-4,
  }
  for k, want in cases.items():
    for step in (first(k), first(k + 1) - 1):
      got = aqn.sigma(step, total_steps=t, **PAPER)
      assert got == pytest.approx(want, rel=1e-12, abs=0.0), (k, step, got)
  # Stage 2 by hand: 1e-2 * 0.05 ** (1/8).
  assert aqn.sigma(first(2), total_steps=t, **PAPER) == pytest.approx(
      1e-2 * 0.05 ** 0.125, rel=1e-12)


def test_sigma_past_the_end_stays_at_sigma_end():
  for step in (100, 101, 150, 10_000):
    assert aqn.sigma(step, total_steps=100, **PAPER) == pytest.approx(5e-4, rel=1e-12)


def test_sigma_jnp_matches_python_traced():
  steps = np.arange(0, 2300, 7)
  f = jax.jit(lambda s: aqn.sigma_jnp(s, total_steps=2000, **PAPER))
  got = np.asarray(f(jnp.asarray(steps, jnp.int32)))
  want = np.array([aqn.sigma(int(s), total_steps=2000, **PAPER) for s in steps], np.float32)
  np.testing.assert_array_equal(got, want)
  assert got.dtype == np.float32


def test_exponential_and_off():
  c = aqn.AQNConfig(kind="exponential", total_steps=101)
  assert aqn.schedule_sigma(c, 0) == pytest.approx(1e-2, rel=1e-12)
  assert aqn.schedule_sigma(c, 50) == pytest.approx(1e-2 * 0.05 ** 0.5, rel=1e-12)
  assert aqn.schedule_sigma(c, 100) == pytest.approx(5e-4, rel=1e-12)
  assert aqn.schedule_sigma(c, 500) == pytest.approx(5e-4, rel=1e-12)
  traced = jax.jit(lambda s: aqn.schedule_sigma(c, s))(jnp.int32(50))
  assert float(traced) == pytest.approx(1e-2 * 0.05 ** 0.5, rel=1e-6)
  off = aqn.AQNConfig(kind="off")
  assert aqn.schedule_sigma(off, 7) == 0.0
  assert aqn.metrics(aqn.AQNConfig(total_steps=10), 9) == {"aqn/sigma": pytest.approx(5e-4)}


def test_bad_inputs_raise():
  with pytest.raises(ValueError, match="kind"):
    aqn.AQNConfig(kind="linear")
  with pytest.raises(ValueError, match="num_stages"):
    aqn.AQNConfig(num_stages=2)
  with pytest.raises(ValueError, match="total_steps"):
    aqn.schedule_sigma(aqn.AQNConfig(), 3)
  with pytest.raises(ValueError, match="step=-1"):
    aqn.sigma(-1, total_steps=10)
  with pytest.raises(TypeError, match="sigma_jnp"):
    aqn.sigma(1.5, total_steps=10)
  with pytest.raises(ValueError, match="sigma_start"):
    aqn.AQNConfig(sigma_start=0.0)


# -------------------------------------------------------------------- draw ---

SHAPES = {"input_norm": (3, 64), "post_attn_norm": (3, 64)}
CFG = aqn.AQNConfig(total_steps=100)


def test_noise_shapes_dtype_and_determinism():
  key = jax.random.key(0)
  a = aqn.noise(key, 42, SHAPES, CFG)
  b = aqn.noise(key, 42, SHAPES, CFG)
  c = jax.jit(lambda k, s: aqn.noise(k, s, SHAPES, CFG))(key, jnp.int32(42))
  assert set(a) == {"input_norm", "post_attn_norm"}
  for name in a:
    assert a[name].shape == (3, 64) and a[name].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))
    # Eager and jit (as in the sampler's and the update's programs) agree bit for bit.
    np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(c[name]))
  # Different step -> different noise; layers and norms are not copies of each other.
  d = aqn.noise(key, 43, SHAPES, CFG)
  assert not np.array_equal(np.asarray(a["input_norm"]), np.asarray(d["input_norm"]))
  z = np.asarray(a["input_norm"])
  assert not np.array_equal(z[0], z[1])
  assert not np.array_equal(z, np.asarray(a["post_attn_norm"]))
  # Different key -> different noise.
  e = aqn.noise(jax.random.key(1), 42, SHAPES, CFG)
  assert not np.array_equal(z, np.asarray(e["input_norm"]))


def test_noise_adding_a_layer_keeps_other_layers():
  key = jax.random.key(3)
  a = aqn.noise(key, 60, {"input_norm": (2, 16)}, CFG)["input_norm"]
  b = aqn.noise(key, 60, {"input_norm": (4, 16)}, CFG)["input_norm"]
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b[:2]))


@pytest.mark.parametrize("step", [10, 55, 99])
def test_noise_empirical_std_within_2_percent(step):
  want = aqn.sigma(step, total_steps=100, **PAPER)
  z = aqn.noise(jax.random.key(7), step, {"input_norm": (64, 1024), "post_attn_norm": (64, 1024)}, CFG)
  for name, arr in z.items():
    arr = np.asarray(arr, np.float64)
    # 65536 samples: the std estimate's relative standard error is ~0.3%.
    assert abs(arr.std() / want - 1) < 0.02, (name, arr.std(), want)
    assert abs(arr.mean()) < 0.02 * want


def test_noise_is_zero_at_stage_zero_and_when_off():
  z = aqn.noise(jax.random.key(0), 3, SHAPES, CFG)  # stage 0
  off = aqn.noise(jax.random.key(0), 50, SHAPES, aqn.AQNConfig(kind="off"))
  for name in SHAPES:
    assert not np.any(np.asarray(z[name]))
    assert not np.any(np.asarray(off[name]))


def test_noise_accepts_a_model_config_and_rejects_bad_shapes():
  @dataclasses.dataclass(frozen=True)
  class Cfg:
    num_layers: int = 2
    hidden_size: int = 8

  z = aqn.noise(jax.random.key(0), 50, Cfg(), CFG)
  assert {k: v.shape for k, v in z.items()} == {"input_norm": (2, 8), "post_attn_norm": (2, 8)}
  with pytest.raises(ValueError, match="input_norm"):
    aqn.noise(jax.random.key(0), 50, {"input_norm": (8,)}, CFG)


def test_noise_rejects_a_non_config_schedule_and_negative_steps_for_every_kind():
  """As its docstring says: TypeError for a schedule that is not an AQNConfig, ValueError for step < 0."""
  for bad in ({"kind": "stages", "total_steps": 100}, None):
    with pytest.raises(TypeError, match="AQNConfig"):
      aqn.noise(jax.random.key(0), 5, SHAPES, bad)
  for cfg in (CFG, aqn.AQNConfig(kind="off"), aqn.AQNConfig(kind="exponential", total_steps=100)):
    with pytest.raises(ValueError, match="step=-1"):
      aqn.noise(jax.random.key(0), -1, SHAPES, cfg)
  # 55.7 drew step 55's noise (while sigma refused it), 2**32 overflowed uint32 in the key, (-1, 4) gave (0, 4)
  for step in (55.7, jnp.float32(3.0), True):
    with pytest.raises(TypeError, match="step must be an integer"):
      aqn.noise(jax.random.key(0), step, SHAPES, CFG)
  with pytest.raises(ValueError, match="step=4294967296 must be < 2\\*\\*32"):
    aqn.noise(jax.random.key(0), 2**32, SHAPES, CFG)
  with pytest.raises(ValueError, match="expected \\(num_layers, hidden\\), both >= 0"):
    aqn.noise(jax.random.key(0), 5, {"input_norm": (-1, 4)}, CFG)
  z = aqn.noise(jax.random.key(0), np.int64(50), SHAPES, CFG)  # NumPy and JAX integers are steps
  np.testing.assert_array_equal(np.asarray(z["input_norm"]),
                                np.asarray(aqn.noise(jax.random.key(0), jnp.int32(50), SHAPES, CFG)["input_norm"]))


def test_update_noise_switch():
  z = aqn.noise(jax.random.key(0), 50, SHAPES, CFG)
  assert aqn.update_noise(z, CFG) is z
  paper = dataclasses.replace(CFG, noise_in_update=False)
  assert aqn.update_noise(z, paper) is None


# ------------------------------------------------------- noise in the model ---

@pytest.fixture(scope="module")
def tiny():
  """A tiny random bf16 decoder (init once per module: eager init is slow on 2 cores)."""
  from qerl_jax import models
  cfg = models.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
  base = models.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16, std=0.1)
  # Trained norm scales are not exactly 1 (see the bf16 note in docs/lora_aqn.md).
  lay = dict(base["layers"])
  for i, name in enumerate(aqn.NORM_NAMES):
    lay[name] = (1 + 0.1 * jax.random.normal(jax.random.key(10 + i), lay[name].shape)).astype(jnp.bfloat16)
  base = dict(base, layers=lay)
  tokens = jax.random.randint(jax.random.key(1), (2, 7), 0, 96, jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (2, 7))
  fwd = jax.jit(models.forward, static_argnums=0)
  return fwd, cfg, base, tokens, positions, models


@pytest.mark.parametrize("quant", ["none", "nvfp4"])
def test_sigma_zero_leaves_forward_bit_identical(quant, tiny):
  fwd, cfg, base, tokens, positions, models = tiny
  if quant != "none":
    base = models.quantize_base(base, quant)
  shapes = aqn.norm_shapes_of(cfg)
  ref, _ = fwd(cfg, base, tokens, positions)
  for z in (aqn.noise(jax.random.key(0), 2, shapes, CFG),                    # stage 0
            aqn.noise(jax.random.key(0), 50, shapes, aqn.AQNConfig(kind="off"))):
    got, _ = fwd(cfg, base, tokens, positions, norm_noise=z)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
  # Even the last stage's sigma (5e-4) moves the bf16 model's logits.
  z = aqn.noise(jax.random.key(0), 99, shapes, CFG)
  got, _ = fwd(cfg, base, tokens, positions, norm_noise=z)
  assert np.abs(np.asarray(got) - np.asarray(ref)).max() > 1e-3


def test_noise_equals_float32_norm_weights_plus_z(tiny):
  """forward(noise=z) == forward with the norm weights replaced by w + z (float32 model)."""
  fwd, cfg, base, tokens, positions, _ = tiny
  cfg = cfg.replace(dtype="float32")
  base = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), base)
  z = aqn.noise(jax.random.key(4), 15, aqn.norm_shapes_of(cfg), CFG)
  got, _ = fwd(cfg, base, tokens, positions, norm_noise=z)
  noisy = dict(base, layers=dict(base["layers"]))
  for name in aqn.NORM_NAMES:
    noisy["layers"][name] = base["layers"][name] + z[name]
  want, _ = fwd(cfg, noisy, tokens, positions)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  plain, _ = fwd(cfg, base, tokens, positions)
  assert np.abs(np.asarray(got) - np.asarray(plain)).max() > 1e-4
  # In float32 compute even the last stage's sigma (5e-4) reaches the logits.
  z = aqn.noise(jax.random.key(4), 99, aqn.norm_shapes_of(cfg), CFG)
  got, _ = fwd(cfg, base, tokens, positions, norm_noise=z)
  assert np.abs(np.asarray(got) - np.asarray(plain)).max() > 1e-6
