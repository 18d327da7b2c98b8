"""Tests for qerl_jax.lora: scale, init, the adapter math, merging, PEFT I/O."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qerl_jax import hf, models, nvfp4
from qerl_jax import lora as L


@dataclasses.dataclass(frozen=True)
class TinyCfg:
  """Stand-in for the model's ModelConfig (only the fields LoRA reads)."""
  num_layers: int = 2
  hidden_size: int = 32
  intermediate_size: int = 48
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 8


def _random_lora(key, cfg, lora_cfg, base=None):
  """An adapter with non-zero B, so tests see the adapter's effect."""
  t = L.init_lora(key, cfg, lora_cfg, base)
  leaves, treedef = jax.tree_util.tree_flatten(t)
  keys = jax.random.split(jax.random.fold_in(key, 99), len(leaves))
  leaves = [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  return jax.tree_util.tree_unflatten(treedef, leaves)


# ------------------------------------------------------------------ config ---

def test_scale_plain_and_rslora():
  assert L.scale(L.LoRAConfig(r=16, lora_alpha=16)) == 1.0
  assert L.scale(L.LoRAConfig(r=16, lora_alpha=16, use_rslora=True)) == 4.0
  assert L.scale(L.LoRAConfig(r=8, lora_alpha=32)) == 4.0
  assert L.scale(L.LoRAConfig(r=8, lora_alpha=32, use_rslora=True)) == pytest.approx(32 / math.sqrt(8))


def test_config_validation_and_canonical_order():
  c = L.LoRAConfig(target_modules=["down", "q"])
  assert c.target_modules == ("q", "down")
  hash(c)  # usable as a jit static argument
  with pytest.raises(ValueError, match="q_proj"):
    L.LoRAConfig(target_modules=("q_proj",))
  with pytest.raises(TypeError, match="string"):
    L.LoRAConfig(target_modules="q")
  with pytest.raises(ValueError, match="r=0"):
    L.LoRAConfig(r=0)
  for alpha in (0.0, float("nan"), float("inf")):  # inf was accepted: inf * (B = 0) made the first forward NaN
    with pytest.raises(ValueError, match=f"lora_alpha={alpha}; must be a finite number > 0"):
      L.LoRAConfig(lora_alpha=alpha)


# -------------------------------------------------------------------- init ---

def test_init_shapes_subset_and_zero_b():
  cfg = TinyCfg()
  t = L.init_lora(jax.random.key(0), cfg, L.LoRAConfig(r=4, target_modules=("q", "v", "down")))
  shapes = jax.tree_util.tree_map(lambda x: x.shape, t)
  assert shapes == {"layers": {"attn": {"q": {"a": (2, 32, 4), "b": (2, 4, 32)},
                                        "v": {"a": (2, 32, 4), "b": (2, 4, 16)}},
                               "mlp": {"down": {"a": (2, 48, 4), "b": (2, 4, 32)}}}}
  for leaf_path, x in jax.tree_util.tree_leaves_with_path(t):
    assert x.dtype == jnp.float32
    if leaf_path[-1].key == "b":
      assert not np.any(np.asarray(x))
  # Module draws do not depend on which other modules are targeted.
  t_all = L.init_lora(jax.random.key(0), cfg, L.LoRAConfig(r=4))
  np.testing.assert_array_equal(np.asarray(t["layers"]["attn"]["v"]["a"]),
                                np.asarray(t_all["layers"]["attn"]["v"]["a"]))
  assert not np.array_equal(np.asarray(t_all["layers"]["attn"]["q"]["a"][0]),
                            np.asarray(t_all["layers"]["attn"]["q"]["a"][1]))


def test_init_a_matches_torch_kaiming_uniform():
  torch = pytest.importorskip("torch")
  k_in, r = 512, 64
  cfg = TinyCfg(num_layers=1, hidden_size=k_in, num_heads=8, head_dim=64)
  a = np.asarray(L.init_lora(jax.random.key(1), cfg, L.LoRAConfig(r=r, target_modules=("q",)))
                 ["layers"]["attn"]["q"]["a"][0], np.float64)
  # What PEFT does for its [r, K] lora_A.weight.
  ref = torch.empty(r, k_in, dtype=torch.float64)
  torch.manual_seed(0)
  torch.nn.init.kaiming_uniform_(ref, a=math.sqrt(5))
  ref = ref.numpy().T
  bound = 1 / math.sqrt(k_in)
  assert np.abs(a).max() <= bound
  assert np.abs(a).max() > 0.99 * bound and np.abs(ref).max() > 0.99 * bound
  assert np.abs(ref).max() <= bound * (1 + 1e-12)
  assert a.std() == pytest.approx(ref.std(), rel=0.02)  # both ~ bound / sqrt(3)
  assert a.std() == pytest.approx(bound / math.sqrt(3), rel=0.02)


def test_init_train_norms_copies_base_norms():
  cfg = TinyCfg()
  base_layers = {"input_norm": 1 + 0.1 * jnp.arange(64, dtype=jnp.float32).reshape(2, 32),
                 "post_attn_norm": jnp.full((2, 32), 0.5, jnp.bfloat16)}
  c = L.LoRAConfig(r=2, target_modules=("q",), train_norms=True)
  t = L.init_lora(jax.random.key(0), cfg, c, {"layers": base_layers})
  np.testing.assert_array_equal(np.asarray(t["layers"]["input_norm"]), np.asarray(base_layers["input_norm"]))
  assert t["layers"]["post_attn_norm"].dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(t["layers"]["post_attn_norm"]), 0.5)
  with pytest.raises(ValueError, match="train_norms"):
    L.init_lora(jax.random.key(0), cfg, c)


# -------------------------------------------------------------------- math ---

@pytest.mark.parametrize("use_rslora,want_scale", [(False, 1.0), (True, 4.0)])
def test_hand_example_r16_alpha16_a_b_point_one(use_rslora, want_scale):
  """x @ W + scale * x @ A @ B with A = B = 0.1, against float64 numpy."""
  rng = np.random.default_rng(0)
  k_in, n_out, r = 32, 8, 16
  x = rng.standard_normal((3, k_in)).astype(np.float32)
  w = (0.1 * rng.standard_normal((k_in, n_out))).astype(np.float32)
  a = np.full((k_in, r), 0.1, np.float32)
  b = np.full((r, n_out), 0.1, np.float32)
  c = L.LoRAConfig(r=16, lora_alpha=16, use_rslora=use_rslora, target_modules=("q",))
  s = L.scale(c)
  assert s == want_scale

  x64, w64, a64, b64 = (v.astype(np.float64) for v in (x, w, a, b))
  want = x64 @ w64 + want_scale * (x64 @ a64) @ b64
  # Hand check of the structure: every column of (x @ A) @ B equals r * 0.1 * 0.1 * sum(x)
  # (0.1 as stored in float32).
  p1 = float(np.float32(0.1))
  np.testing.assert_allclose((x64 @ a64) @ b64, np.repeat(16 * p1 * p1 * x64.sum(1, keepdims=True), n_out, 1),
                             rtol=1e-12)

  # The model's one linear dispatch, float32 operands.
  y = models.linear(jnp.asarray(x), jnp.asarray(w), lora={"a": jnp.asarray(a), "b": jnp.asarray(b)},
                    lora_scale=s)
  assert y.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)

  # bf16 activations (operands bf16, float32 accumulation): within bf16 rounding.
  y16 = models.linear(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w),
                      lora={"a": jnp.asarray(a), "b": jnp.asarray(b)}, lora_scale=s)
  assert y16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(y16, np.float64), want, rtol=2e-2, atol=2e-2 * want_scale)

  # A 4-bit W: the adapter adds to the dequantized weight's product.
  wq = nvfp4.quantize(jnp.asarray(w))
  yq = models.linear(jnp.asarray(x), wq, lora={"a": jnp.asarray(a), "b": jnp.asarray(b)}, lora_scale=s)
  wq64 = np.asarray(nvfp4.dequantize(wq, jnp.float32), np.float64)
  np.testing.assert_allclose(np.asarray(yq), x64 @ wq64 + want_scale * (x64 @ a64) @ b64, rtol=1e-5, atol=1e-5)

  # Merging into a float32 base gives the same output to 1e-6.
  base = {"layers": {"attn": {"q": jnp.asarray(w)[None]}}}
  tree = {"layers": {"attn": {"q": {"a": jnp.asarray(a)[None], "b": jnp.asarray(b)[None]}}}}
  merged = L.merge(base, tree, c)["layers"]["attn"]["q"][0]
  assert merged.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(merged), w64 + want_scale * a64 @ b64, rtol=0, atol=1e-6)
  y_merged = models.linear(jnp.asarray(x), merged)
  np.testing.assert_allclose(np.asarray(y_merged), np.asarray(y), rtol=0, atol=1e-6 * max(1.0, want_scale))
  np.testing.assert_allclose(np.asarray(y_merged), want, rtol=1e-6, atol=1e-6 * max(1.0, want_scale))


def test_merge_bf16_and_nvfp4_and_norms():
  cfg = TinyCfg()
  rng = np.random.default_rng(0)
  w_q = jnp.asarray(rng.standard_normal((2, 32, 32)) * 0.05, jnp.bfloat16)
  w_up = nvfp4.quantize(jnp.asarray(rng.standard_normal((2, 32, 48)) * 0.05, jnp.float32))
  base = {"embed": jnp.zeros((4, 32), jnp.bfloat16),
          "layers": {"input_norm": jnp.ones((2, 32), jnp.bfloat16),
                     "post_attn_norm": jnp.ones((2, 32), jnp.bfloat16),
                     "attn": {"q": w_q, "k": jnp.zeros((2, 32, 16), jnp.bfloat16)},
                     "mlp": {"up": w_up}}}
  c = L.LoRAConfig(r=4, lora_alpha=8, target_modules=("q", "up"), train_norms=True)
  t = _random_lora(jax.random.key(2), cfg, c, base)
  with pytest.raises(TypeError, match="dequantize_4bit"):
    L.merge(base, t, c)
  m = L.merge(base, t, c, dequantize_4bit=True)
  a, b = (np.asarray(t["layers"]["mlp"]["up"][n], np.float64) for n in "ab")
  want_up = np.asarray(nvfp4.dequantize(w_up, jnp.float32), np.float64) + 2.0 * a @ b
  assert m["layers"]["mlp"]["up"].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(m["layers"]["mlp"]["up"], np.float64), want_up, rtol=2 ** -8, atol=1e-6)
  a, b = (np.asarray(t["layers"]["attn"]["q"][n], np.float64) for n in "ab")
  want_q = np.asarray(w_q, np.float64) + 2.0 * a @ b
  assert m["layers"]["attn"]["q"].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(m["layers"]["attn"]["q"], np.float64), want_q, rtol=2 ** -8, atol=1e-6)
  assert m["layers"]["attn"]["k"] is base["layers"]["attn"]["k"]  # untargeted: shared
  assert m["layers"]["input_norm"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(m["layers"]["input_norm"]),
                                np.asarray(t["layers"]["input_norm"].astype(jnp.bfloat16)))
  assert base["layers"]["attn"]["q"] is w_q  # input not mutated


# -------------------------------------------------------------------- PEFT ---

def _tiny_hf_qwen2(seed=0):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(seed)
  hf_cfg = transformers.Qwen2Config(
      vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
      tie_word_embeddings=True)
  return transformers.Qwen2ForCausalLM(hf_cfg).float().eval()


def test_load_adapter_written_by_peft(tmp_path):
  torch = pytest.importorskip("torch")
  peft = pytest.importorskip("peft")
  hf = _tiny_hf_qwen2()
  pc = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["v_proj", "gate_proj"])
  pm = peft.get_peft_model(hf, pc)
  with torch.no_grad():
    for name, p in pm.named_parameters():
      if "lora_B" in name:
        p.normal_()
  pm.save_pretrained(str(tmp_path))
  t, c = L.load_peft_adapter(str(tmp_path))
  assert c == L.LoRAConfig(r=4, lora_alpha=16, target_modules=("v", "gate"))
  assert L.scale(c) == 4.0
  gate = pm.base_model.model.model.layers[0].mlp.gate_proj
  np.testing.assert_array_equal(np.asarray(t["layers"]["mlp"]["gate"]["a"][0]),
                                gate.lora_A["default"].weight.detach().numpy().T)
  np.testing.assert_array_equal(np.asarray(t["layers"]["mlp"]["gate"]["b"][0]),
                                gate.lora_B["default"].weight.detach().numpy().T)
  assert t["layers"]["attn"]["v"]["a"].shape == (2, 32, 4)
  assert t["layers"]["attn"]["v"]["b"].shape == (2, 4, 16)


def test_load_rejects_unsupported(tmp_path):
  cfg = TinyCfg()
  c = L.LoRAConfig(r=2, target_modules=("q",))
  L.save_peft_adapter(str(tmp_path), L.init_lora(jax.random.key(0), cfg, c), cfg, c, "x")
  conf = json.loads((tmp_path / "adapter_config.json").read_text())
  conf["use_dora"] = True
  (tmp_path / "adapter_config.json").write_text(json.dumps(conf))
  with pytest.raises(ValueError, match="use_dora"):
    L.load_peft_adapter(str(tmp_path))
  with pytest.raises(FileNotFoundError):
    L.load_peft_adapter(str(tmp_path / "missing"))
  with pytest.raises(ValueError, match="lacks targeted module"):
    L.save_peft_adapter(str(tmp_path), {"layers": {}}, cfg, c, "x")


@pytest.mark.parametrize("field,value", [
    ("init_lora_weights", "pissa"), ("init_lora_weights", "pissa_niter_4"), ("init_lora_weights", "olora"),
    ("init_lora_weights", "loftq"), ("init_lora_weights", "corda"), ("use_qalora", True),
    ("layer_replication", [[0, 2], [1, 2]]), ("alora_invocation_tokens", [5, 6])])
def test_load_rejects_peft_variants_that_change_the_function(tmp_path, field, value):
  """PEFT features whose adapter, loaded as plain LoRA on the original base, computes something else."""
  cfg = TinyCfg()
  c = L.LoRAConfig(r=2, target_modules=("q",))
  L.save_peft_adapter(str(tmp_path), L.init_lora(jax.random.key(0), cfg, c), cfg, c, "x")
  conf = json.loads((tmp_path / "adapter_config.json").read_text())
  (tmp_path / "adapter_config.json").write_text(json.dumps(dict(conf, **{field: value})))
  with pytest.raises(ValueError, match=field):
    L.load_peft_adapter(str(tmp_path))
  # The plain values PEFT writes for an ordinary adapter still load.
  plain = dict(conf, init_lora_weights="gaussian", use_qalora=False, layer_replication=None,
               alora_invocation_tokens=None)
  (tmp_path / "adapter_config.json").write_text(json.dumps(plain))
  assert L.load_peft_adapter(str(tmp_path))[1] == c


def test_load_rejects_rank_or_shape_mismatch(tmp_path):
  """A file whose lora_A/lora_B rank is not the config's r must not load (the scale would be wrong)."""
  from safetensors.numpy import load_file, save_file
  cfg = TinyCfg()
  c = L.LoRAConfig(r=4, lora_alpha=8, target_modules=("q", "v"))
  L.save_peft_adapter(str(tmp_path), _random_lora(jax.random.key(0), cfg, c), cfg, c, "x")
  conf_path, st_path = tmp_path / "adapter_config.json", tmp_path / "adapter_model.safetensors"
  conf, sd = json.loads(conf_path.read_text()), load_file(str(st_path))
  # Sanity: the untouched files load with r = 4 and scale 8 / 4 = 2 (PEFT's lora_alpha / r).
  t, c2 = L.load_peft_adapter(str(tmp_path))
  assert c2.r == 4 and L.scale(c2) == 2.0 and t["layers"]["attn"]["q"]["a"].shape == (2, 32, 4)
  # The config says r = 8 but the tensors have rank 4: loading it would scale by 8 / 8 = 1, not 2.
  conf_path.write_text(json.dumps(dict(conf, r=8)))
  with pytest.raises(ValueError, match=r"r=8"):
    L.load_peft_adapter(str(tmp_path))
  conf_path.write_text(json.dumps(conf))
  # One layer's lora_A has another rank: a clear error naming the module, not numpy's.
  bad = dict(sd)
  bad["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"] = np.zeros((3, 32), np.float32)
  save_file(bad, str(st_path))
  with pytest.raises(ValueError, match=r"\('q', 'A'\) layer 1 has shape \(3, 32\)"):
    L.load_peft_adapter(str(tmp_path))
  # lora_B with the wrong rank.
  bad = dict(sd)
  for i in range(2):
    bad[f"base_model.model.model.layers.{i}.self_attn.v_proj.lora_B.weight"] = np.zeros((16, 5), np.float32)
  save_file(bad, str(st_path))
  with pytest.raises(ValueError, match=r"\('v', 'B'\) layer 0 has shape \(16, 5\)"):
    L.load_peft_adapter(str(tmp_path))
  # Norm weights without modules_to_save in the config are not silently dropped.
  bad = dict(sd)
  for i in range(2):
    bad[f"base_model.model.model.layers.{i}.input_layernorm.weight"] = np.ones((32,), np.float32)
  save_file(bad, str(st_path))
  with pytest.raises(ValueError, match="modules_to_save"):
    L.load_peft_adapter(str(tmp_path))


def test_export_rejects_tree_entries_the_config_does_not_list(tmp_path):
  """The forward applies every adapter in the tree; the PEFT export must not drop some silently."""
  cfg = TinyCfg()
  trained = L.LoRAConfig(r=2, target_modules=("q", "v"), train_norms=True)
  base = {"layers": {n: jnp.ones((2, 32), jnp.float32) for n in L.NORM_NAMES}}
  t = _random_lora(jax.random.key(0), cfg, trained, base)
  L.save_peft_adapter(str(tmp_path / "ok"), t, cfg, trained, "x")  # the matching config exports
  assert len(L.peft_state_dict(t, trained)) == 2 * 2 * 2 + 2 * 2
  with pytest.raises(ValueError, match=r"attn\.v"):
    L.save_peft_adapter(str(tmp_path / "a"), t, cfg, dataclasses.replace(trained, target_modules=("q",)), "x")
  with pytest.raises(ValueError, match="input_norm"):
    L.save_peft_adapter(str(tmp_path / "b"), t, cfg, dataclasses.replace(trained, train_norms=False), "x")


# ------------------------------------------------------ adapters in the model ---

@pytest.fixture(scope="module")
def tiny():
  """A tiny random decoder (bf16 base), its jitted forward and a batch."""
  cfg = models.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True,
                           attention_bias=True)
  base = models.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16, std=0.1)
  tokens = jax.random.randint(jax.random.key(1), (2, 7), 0, 96, jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (2, 7))
  fwd = jax.jit(models.forward, static_argnums=0, static_argnames="lora_cfg")
  return fwd, cfg, base, tokens, positions


@pytest.mark.parametrize("quant", ["none", "nvfp4"])
def test_fresh_adapter_leaves_output_bit_identical(tiny, quant):
  fwd, cfg, base, tokens, positions = tiny
  if quant != "none":
    base = models.quantize_base(base, quant)
  ref, _ = fwd(cfg, base, tokens, positions)
  c = L.LoRAConfig(r=4, lora_alpha=8, train_norms=True)
  adapter = L.init_lora(jax.random.key(2), cfg, c, base)
  got, _ = fwd(cfg, base, tokens, positions, lora=adapter, lora_cfg=c)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
  # ...and a trained (non-zero B) adapter does change it.
  got, _ = fwd(cfg, base, tokens, positions, lora=_random_lora(jax.random.key(2), cfg, c, base), lora_cfg=c)
  assert np.abs(np.asarray(got) - np.asarray(ref)).max() > 1e-3


def test_merged_model_matches_adapter_forward(tiny):
  fwd, cfg, base, tokens, positions = tiny
  cfg = cfg.replace(dtype="float32")
  base = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), base)
  c = L.LoRAConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=("q", "v", "o", "gate", "down"),
                   train_norms=True)
  adapter = _random_lora(jax.random.key(3), cfg, c, base)
  with_adapter, _ = fwd(cfg, base, tokens, positions, lora=adapter, lora_cfg=c)
  merged, _ = fwd(cfg, L.merge(base, adapter, c), tokens, positions)
  np.testing.assert_allclose(np.asarray(merged), np.asarray(with_adapter), rtol=0, atol=1e-5)
  plain, _ = fwd(cfg, base, tokens, positions)
  assert np.abs(np.asarray(plain) - np.asarray(with_adapter)).max() > 1e-2


def _hf_logits(model, tokens):
  import torch
  with torch.no_grad():
    return model(input_ids=torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


@pytest.mark.parametrize("use_rslora,train_norms,targets", [
    (False, False, L.ALL_MODULES), (True, True, ("q", "k", "o", "up", "down"))])
def test_peft_round_trip_logits_match_transformers(tmp_path, use_rslora, train_norms, targets):
  """Our forward with an adapter == PeftModel.from_pretrained(transformers twin, exported adapter)."""
  torch = pytest.importorskip("torch")
  peft = pytest.importorskip("peft")
  transformers = pytest.importorskip("transformers")
  hf_model = _tiny_hf_qwen2(seed=1)
  with torch.no_grad():  # weights large enough that the adapter's effect is well above float noise
    for name, p in hf_model.named_parameters():
      p.copy_((1.0 + 0.1 * torch.randn_like(p)) if name.endswith("norm.weight") else 0.08 * torch.randn_like(p))
  hf_model.save_pretrained(str(tmp_path / "base"))
  pre = hf.load_pretrained(str(tmp_path / "base"), quant="none", dtype=jnp.float32, compute_dtype="float32",
                           load_tokenizer=False)
  cfg, base = pre.cfg, pre.base
  c = L.LoRAConfig(r=4, lora_alpha=8, use_rslora=use_rslora, target_modules=targets,
                   train_norms=train_norms)
  adapter = _random_lora(jax.random.key(4), cfg, c, base)
  tokens = jax.random.randint(jax.random.key(5), (2, 9), 0, cfg.vocab_size, jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
  ours, _ = models.forward(cfg, base, tokens, positions, lora=adapter, lora_cfg=c)
  plain, _ = models.forward(cfg, base, tokens, positions)

  L.save_peft_adapter(str(tmp_path / "adapter"), adapter, cfg, c, str(tmp_path / "base"))
  conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert conf["r"] == 4 and conf["lora_alpha"] == 8 and conf["use_rslora"] is use_rslora
  assert sorted(conf["target_modules"]) == sorted(L._HF_MODULE[m].split(".")[1] for m in targets)
  pm = peft.PeftModel.from_pretrained(hf_model, str(tmp_path / "adapter")).eval()
  # PEFT holds our matrices, transposed, and our scale.
  layer = pm.base_model.model.model.layers[1]
  for grp, m, mod in (("attn", "q", layer.self_attn.q_proj), ("mlp", "down", layer.mlp.down_proj)):
    ab = adapter["layers"][grp][m]
    np.testing.assert_array_equal(mod.lora_A["default"].weight.detach().numpy(), np.asarray(ab["a"][1]).T)
    np.testing.assert_array_equal(mod.lora_B["default"].weight.detach().numpy(), np.asarray(ab["b"][1]).T)
    assert mod.scaling["default"] == pytest.approx(L.scale(c))
  assert hasattr(layer.self_attn.v_proj, "lora_A") == ("v" in targets)
  if train_norms:
    got = layer.input_layernorm.modules_to_save["default"].weight.detach().numpy()
    np.testing.assert_array_equal(got, np.asarray(adapter["layers"]["input_norm"][1]))
  theirs = _hf_logits(pm, tokens)
  assert np.abs(np.asarray(plain) - theirs).max() > 1e-2  # the adapter matters
  np.testing.assert_allclose(np.asarray(ours), theirs, rtol=0, atol=1e-4)

  # Merged export (float32 here so the comparison is tight): plain transformers, no PEFT.
  L.save_merged_hf(str(tmp_path / "merged"), cfg, base, adapter, c, dtype=np.float32)
  merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"),
                                                             dtype=torch.float32).eval()
  np.testing.assert_allclose(_hf_logits(merged, tokens), theirs, rtol=0, atol=1e-4)

  # And back: our loader restores the tree and the config exactly.
  t2, c2 = L.load_peft_adapter(str(tmp_path / "adapter"))
  assert c2 == c
  jax.tree_util.tree_map(lambda u, v: np.testing.assert_array_equal(np.asarray(u), np.asarray(v)), adapter, t2)


def test_merged_bf16_export_of_nvfp4_base(tmp_path):
  """The default export: NVFP4 base dequantized, adapter merged, bf16 safetensors."""
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  cfg = models.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True,
                           dtype="float32")
  base = models.quantize_base(models.init_params(cfg, jax.random.key(0), dtype=jnp.float32, std=0.1), "nvfp4")
  c = L.LoRAConfig(r=4, lora_alpha=8)
  adapter = _random_lora(jax.random.key(6), cfg, c)
  L.save_merged_hf(str(tmp_path), cfg, base, adapter, c)
  m = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
  assert next(m.parameters()).dtype == torch.float32
  q = m.model.layers[1].self_attn.q_proj.weight.detach().numpy().astype(np.float64)
  ab = adapter["layers"]["attn"]["q"]
  want = (np.asarray(nvfp4.dequantize(jax.tree_util.tree_map(lambda x: x[1], base["layers"]["attn"]["q"]),
                                      jnp.float32), np.float64)
          + 2.0 * np.asarray(ab["a"][1], np.float64) @ np.asarray(ab["b"][1], np.float64))
  np.testing.assert_allclose(q, want.T, rtol=2 ** -8, atol=1e-6)  # bf16 storage


def test_fresh_adapter_gradients_flow_to_b_and_norms_not_a(tiny):
  """At init (B = 0): dL/dA = 0 exactly, dL/dB != 0, and trainable norms get gradient."""
  _, cfg, base, tokens, positions = tiny
  c = L.LoRAConfig(r=4, lora_alpha=8, target_modules=("q", "down"), train_norms=True)
  adapter = L.init_lora(jax.random.key(7), cfg, c, base)

  def loss(ad):
    logits, _ = models.forward(cfg, base, tokens, positions, lora=ad, lora_cfg=c)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

  g = jax.jit(jax.grad(loss))(adapter)
  for grp, m in (("attn", "q"), ("mlp", "down")):
    assert not np.any(np.asarray(g["layers"][grp][m]["a"]))
    assert np.abs(np.asarray(g["layers"][grp][m]["b"])).max() > 0
  for name in L.NORM_NAMES:
    assert g["layers"][name].shape == (2, 32)
    assert np.abs(np.asarray(g["layers"][name])).max() > 0
