"""Hugging Face import/export: tiny random checkpoints written by transformers, NVFP4 checkpoints
written by the test from known codes and scales, and the loader's named errors."""

import functools
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qerl_jax import _packing, hf, models, nvfp4
from tests._model_utils import left_padded_batch, make_hf_model, torch_logits


@functools.lru_cache(maxsize=None)
def _saved(arch, tied, tmp_root):
  """A transformers checkpoint (several safetensors shards + index) and its torch model."""
  m = make_hf_model(arch, tied=tied, seed=11)
  folder = pathlib.Path(tmp_root) / f"{arch}-{'tied' if tied else 'untied'}"
  m.save_pretrained(folder, max_shard_size="150KB")
  gen = {"eos_token_id": [151645, 151643], "pad_token_id": 151643, "temperature": 0.7}
  (folder / "generation_config.json").write_text(json.dumps(gen))
  return m, folder


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
  return str(tmp_path_factory.mktemp("hf"))


def _copy(folder, dst):
  return pathlib.Path(shutil.copytree(folder, dst))


@pytest.mark.parametrize("arch,tied", [("qwen2", False), ("llama", True), ("qwen3", False)])
def test_load_sharded_checkpoint_matches_transformers(arch, tied, tmp_root):
  m, folder = _saved(arch, tied, tmp_root)
  assert (folder / "model.safetensors.index.json").is_file()
  assert len(list(folder.glob("model-*.safetensors"))) >= 2
  cfg, base, tok, gen = hf.load_pretrained(folder, quant="none", dtype=jnp.float32,
                                           compute_dtype="float32")
  assert tok is None and ("lm_head" in base) == (not tied)
  assert gen["eos_token_ids"][:2] == [151645, 151643] and gen["temperature"] == 0.7
  tokens, mask = left_padded_batch(cfg.vocab_size, seed=2)
  ref = torch_logits(m, tokens, mask)
  logits, _ = jax.jit(lambda b, t, mk: models.forward(cfg, b, t, models.positions_from_mask(mk),
                                                      attn_mask=mk))(base, jnp.asarray(tokens), jnp.asarray(mask))
  real = mask.astype(bool)
  assert np.abs(np.asarray(logits) - ref)[real].max() < 1e-4
  assert (np.asarray(logits).argmax(-1) == ref.argmax(-1))[real].all()


def test_load_quantizes_each_linear_like_quantize_base(tmp_root):
  m, folder = _saved("qwen2", False, tmp_root)
  cfg, base, _, _ = hf.load_pretrained(folder, quant="nvfp4", dtype=jnp.float32, compute_dtype="float32")
  q = base["layers"]["mlp"]["down"]
  assert isinstance(q, nvfp4.NVFP4Tensor) and q.packed.shape == (2, 64, 64) and q.global_scale.shape == (2,)
  ref = models.quantize_base(hf.base_from_state_dict(cfg, m.state_dict()), "nvfp4")
  for group, name in models.LINEARS:
    a, b = base["layers"][group][name], ref["layers"][group][name]
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
      np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
  nf, _ = hf.load_pretrained(folder, quant="nf4", load_tokenizer=False)[1], None
  assert type(nf["layers"]["attn"]["q"]).__name__ == "NF4Tensor"
  assert nf["embed"].dtype == jnp.bfloat16


def test_shared_fused_global_scale(tmp_root):
  """Each layer's q/k/v (gate/up) get the smallest of their own global scales, 448 * 6 / amax,
  computed here from the PyTorch weights; the codes are those of quantizing with that scale."""
  m, folder = _saved("qwen3", False, tmp_root)
  _, base, _, _ = hf.load_pretrained(folder, quant="nvfp4", share_fused_global_scale=True)
  sd = {k: v.detach().numpy().astype(np.float32) for k, v in m.state_dict().items()}
  for group, parts, hf_names in (("attn", "qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                                 ("mlp", ("gate", "up"), ("mlp.gate_proj", "mlp.up_proj"))):
    for i in range(m.config.num_hidden_layers):
      ws = [sd[f"model.layers.{i}.{h}.weight"].T for h in hf_names]  # [K, N]
      want = min(np.float32(448 * 6) * (np.float32(1) / np.abs(w).max()) for w in ws)
      for name, w in zip(parts, ws):
        t = jax.tree_util.tree_map(lambda a: a[i], base["layers"][group][name])
        np.testing.assert_allclose(float(t.global_scale), want, rtol=1e-6)
        ref = nvfp4.quantize(jnp.asarray(w), global_scale=t.global_scale)
        np.testing.assert_array_equal(np.asarray(t.packed), np.asarray(ref.packed))
        np.testing.assert_array_equal(np.asarray(t.block_scale).view(np.uint8),
                                      np.asarray(ref.block_scale).view(np.uint8))
    own = [float(jax.tree_util.tree_map(lambda a: a[0], base["layers"][group][n]).global_scale) for n in parts]
    assert len(set(own)) == 1
  # without sharing each matrix keeps its own scale, so at least one part differs somewhere
  _, plain, _, _ = hf.load_pretrained(folder, quant="nvfp4")
  assert any(not np.array_equal(np.asarray(plain["layers"]["attn"][n].global_scale),
                                np.asarray(base["layers"]["attn"][n].global_scale)) for n in "qkv")


def test_shared_global_scale_checkpoint_fuses_to_the_same_logits(tmp_root):
  """The documented path: load with shared global scales, fuse q/k/v and gate/up, same logits."""
  _, folder = _saved("qwen2", False, tmp_root)
  cfg, base, _, _ = hf.load_pretrained(folder, quant="nvfp4", share_fused_global_scale=True, dtype=jnp.float32,
                                       compute_dtype="float32", load_tokenizer=False)
  fused = models.fuse_projections(base)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
  pos = jnp.tile(jnp.arange(9, dtype=jnp.int32), (2, 1))
  a, _ = models.forward(cfg, base, tokens, pos)
  b, _ = models.forward(cfg, fused, tokens, pos)
  np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="different global scales"):  # without sharing: a clear error
    models.fuse_projections(hf.load_pretrained(folder, quant="nvfp4", load_tokenizer=False)[1])


E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _known_nvfp4(rng, n, k):
  """Codes [N, K], E4M3 block scales [N, K/16] from exactly representable values, and a global
  scale whose float32 reciprocal round-trips (so both checkpoint conventions are exact)."""
  codes = rng.integers(0, 16, size=(n, k)).astype(np.uint8)
  scale_vals = rng.choice(np.array([0.125, 0.5, 1.0, 1.5, 3.0, 10.0, 52.0, 448.0], np.float32), size=(n, k // 16))
  scales = scale_vals.astype(ml_dtypes.float8_e4m3fn)
  assert (scales.astype(np.float32) == scale_vals).all()
  while True:
    gs = np.float32(rng.uniform(50, 3000))
    if np.float32(1) / (np.float32(1) / gs) == gs:
      break
  packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
  # Expected dequantized weight in the HF [N, K] layout: e2m1 * (scale / global_scale) in float32.
  expected = E2M1[codes] * np.repeat(scales.astype(np.float32) / gs, 16, axis=1)
  return packed, scales, gs, expected


def codes_of(packed):
  """Unpacks [N, K/2] bytes to [N, K] codes, low nibble first (independent of qerl_jax)."""
  codes = np.empty((packed.shape[0], packed.shape[1] * 2), np.uint8)
  codes[:, 0::2] = packed & 0xF
  codes[:, 1::2] = packed >> 4
  return codes


def _write_nvfp4_checkpoint(tmp_path, m, style, seed=0):
  """Rewrites the tiny model's linears as NVFP4 (compressed-tensors or ModelOpt) tensors."""
  rng = np.random.default_rng(seed)
  sd = {k: v.detach().numpy() for k, v in m.state_dict().items()}
  expected = {}
  out = {}
  for key, v in sd.items():
    if key.endswith("_proj.weight"):
      prefix = key[:-len(".weight")]
      n, k = v.shape
      packed, scales, gs, exp = _known_nvfp4(rng, n, k)
      expected[prefix] = (codes_of(packed), scales, gs, exp)
      if style == "compressed":
        out[prefix + ".weight_packed"] = packed
        out[prefix + ".weight_scale"] = scales
        out[prefix + ".weight_global_scale"] = np.array([gs], np.float32)
      else:
        out[prefix + ".weight"] = packed
        out[prefix + ".weight_scale"] = scales
        out[prefix + ".weight_scale_2"] = np.array(np.float32(1) / gs, np.float32)
        out[prefix + ".input_scale"] = np.array(1.0, np.float32)
    else:
      out[key] = v.astype(ml_dtypes.bfloat16)
  folder = tmp_path / style
  folder.mkdir()
  keys = sorted(out)
  half = len(keys) // 2
  shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
  for name, ks in shards.items():
    hf.save_safetensors(folder / name, {k: out[k] for k in ks}, {"format": "pt"})
  (folder / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {}, "weight_map": {k: n for n, ks in shards.items() for k in ks}}))
  config = m.config.to_dict()
  if style == "compressed":
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"format": "nvfp4-pack-quantized", "targets": ["Linear"],
                                      "input_activations": None,
                                      "weights": {"num_bits": 4, "type": "float", "group_size": 16,
                                                  "strategy": "tensor_group", "symmetric": True}}}}
  else:
    (folder / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                                             "exclude_modules": ["lm_head"]}}))
  (folder / "config.json").write_text(json.dumps(config))
  return folder, expected


@pytest.mark.parametrize("style", ["compressed", "modelopt"])
def test_prequantized_nvfp4_checkpoint_loads_bit_exactly(style, tmp_path):
  m = make_hf_model("qwen2", tied=False, seed=5)
  folder, expected = _write_nvfp4_checkpoint(tmp_path, m, style)
  cfg, base, _, _ = hf.load_pretrained(folder, quant="nvfp4", load_tokenizer=False)
  for i in range(cfg.num_layers):
    for (group, name), hf_name in hf.HF_LINEARS.items():
      t = base["layers"][group][name]
      assert isinstance(t, nvfp4.NVFP4Tensor)
      layer = jax.tree_util.tree_map(lambda a: a[i], t)
      codes, scales, gs, exp = expected[f"model.layers.{i}.{hf_name}"]
      # The stored representation is bit-exact: codes, E4M3 block scale bytes, global scale.
      np.testing.assert_array_equal(np.asarray(_packing.unpack_nibbles(layer.packed)), codes.T)
      np.testing.assert_array_equal(np.asarray(layer.block_scale).view(np.uint8), scales.T.view(np.uint8))
      assert np.asarray(layer.global_scale).view(np.uint32) == np.float32(gs).view(np.uint32)
      # ... and dequantizes to e2m1 * scale / global_scale (XLA may round the division by 1 ulp).
      got = np.asarray(nvfp4.dequantize(layer, jnp.float32))  # [K, N]
      np.testing.assert_allclose(got, exp.T, rtol=3e-7, atol=0)
  # quant="none" dequantizes to the same float32 weights
  _, fbase, _, _ = hf.load_pretrained(folder, quant="none", dtype=jnp.float32, load_tokenizer=False)
  np.testing.assert_allclose(np.asarray(fbase["layers"]["attn"]["o"][1]),
                             expected["model.layers.1.self_attn.o_proj"][3].T, rtol=3e-7, atol=0)


def test_both_nvfp4_conventions_give_identical_weights(tmp_path):
  m = make_hf_model("llama", tied=False, seed=6)
  f1, e1 = _write_nvfp4_checkpoint(tmp_path, m, "compressed", seed=3)
  f2, e2 = _write_nvfp4_checkpoint(tmp_path, m, "modelopt", seed=3)
  b1 = hf.load_pretrained(f1, load_tokenizer=False).base
  b2 = hf.load_pretrained(f2, load_tokenizer=False).base
  for group, name in models.LINEARS:
    for x, y in zip(jax.tree_util.tree_leaves(b1["layers"][group][name]),
                    jax.tree_util.tree_leaves(b2["layers"][group][name])):
      np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def test_export_round_trips_through_transformers(tmp_root, tmp_path):
  torch = pytest.importorskip("torch", reason="PyTorch (a dev extra) runs the exported checkpoint")
  import transformers
  _, folder = _saved("qwen3", False, tmp_root)
  cfg, base, _, gen = hf.load_pretrained(folder, quant="nvfp4", dtype=jnp.float32, compute_dtype="float32")
  out = tmp_path / "export"
  hf.save_pretrained(out, cfg, base, dtype=np.float32, generation_config=gen, max_shard_bytes=100_000)
  assert (out / "model.safetensors.index.json").is_file()
  sd = hf.to_hf_state_dict(cfg, base, np.float32)
  assert sd["model.layers.0.mlp.down_proj.weight"].shape == (cfg.hidden_size, cfg.intermediate_size)
  assert "model.layers.1.self_attn.q_norm.weight" in sd
  m2 = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  tokens, mask = left_padded_batch(cfg.vocab_size, seed=4)
  ref = torch_logits(m2, tokens, mask)
  logits, _ = models.forward(cfg, base, jnp.asarray(tokens), models.positions_from_mask(jnp.asarray(mask)),
                             attn_mask=jnp.asarray(mask))
  assert np.abs(np.asarray(logits) - ref)[mask.astype(bool)].max() < 1e-4
  assert hf.load_generation_config(out)["eos_token_ids"][:2] == [151645, 151643]


def test_load_tokenizer_and_generation_config_of_real_qwen25(fixtures_dir):
  folder = fixtures_dir / "qwen2.5-0.5b-instruct"
  gen = hf.load_generation_config(folder)
  assert gen["eos_token_ids"] == [151645, 151643] and gen["top_k"] == 20
  tok = hf._load_tokenizer(folder)
  assert tok.eos_token == "<|im_end|>"
  assert tok.convert_tokens_to_ids("<|im_end|>") == 151645


# ----------------------------------------------------------------------------- errors

def test_error_unsupported_architecture(tmp_root, tmp_path):
  _, folder = _saved("qwen2", False, tmp_root)
  f = _copy(folder, tmp_path / "c")
  config = json.loads((f / "config.json").read_text())
  config["architectures"] = ["MixtralForCausalLM"]
  (f / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r"MixtralForCausalLM.*supported: Qwen2ForCausalLM, Qwen3ForCausalLM, LlamaForCausalLM"):
    hf.load_pretrained(f)


ASSET = pathlib.Path(__file__).resolve().parents[1] / "assets" / "tiny-gsm"


def test_error_integer_dtype_extra_layers_and_a_corrupt_weights_file(tmp_path):
  """From an adversarial probe: dtype=int32 cast every weight to 0; a config with fewer layers than the checkpoint
  dropped the rest; a truncated or garbage safetensors file raised a bare JSONDecodeError or OverflowError."""
  with pytest.raises(ValueError, match="dtype must be a floating dtype .*, got int32"):
    hf.load_pretrained(ASSET, dtype=np.int32)
  f = _copy(ASSET, tmp_path / "fewer")
  config = json.loads((f / "config.json").read_text())
  layers = config["num_hidden_layers"]
  config["num_hidden_layers"] = layers - 1
  (f / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=f"the checkpoint has layers up to {layers - 1} but config.json's "
                                       f"num_hidden_layers is {layers - 1}"):
    hf.load_pretrained(f)
  g = _copy(ASSET, tmp_path / "corrupt")
  blob = (g / "model.safetensors").read_bytes()
  for name, data in (("truncated", blob[:100]), ("garbage", bytes(range(256)) * 4), ("short", b"abc")):
    (g / "model.safetensors").write_bytes(data)
    with pytest.raises(ValueError, match=f"{g / 'model.safetensors'}: not a safetensors file"):
      hf.load_pretrained(g)


def test_error_missing_local_folder(tmp_path):
  """A local path that does not exist is named as such, not sent to the hub as a repo id
  (which raised huggingface_hub's 'Repo id must be in the form ...')."""
  missing = tmp_path / "Qwen2.5-7B-Instruct"
  for arg in (missing, str(missing), "./no-such-dir/model", "~/no-such-dir-qerl/model"):
    with pytest.raises(FileNotFoundError, match="no such checkpoint folder"):
      hf.load_pretrained(arg)


def test_error_untied_without_lm_head(tmp_root, tmp_path):
  _, folder = _saved("qwen2", False, tmp_root)
  f = _copy(folder, tmp_path / "c")
  index = json.loads((f / "model.safetensors.index.json").read_text())
  shard = index["weight_map"].pop("lm_head.weight")
  st = hf.SafetensorsFile(f / shard)
  hf.save_safetensors(f / shard, {k: st.read(k) for k in st.keys() if k != "lm_head.weight"})
  (f / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(ValueError, match="no 'lm_head.weight'"):
    hf.load_pretrained(f)


def test_error_shape_mismatch_names_tensor_and_shapes(tmp_root, tmp_path):
  _, folder = _saved("llama", True, tmp_root)
  f = _copy(folder, tmp_path / "c")
  config = json.loads((f / "config.json").read_text())
  config["intermediate_size"] = 192
  (f / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \[128, 64\] "
                                       r"but the config implies \[192, 64\]"):
    hf.load_pretrained(f, quant="none")


def test_error_missing_shard_and_pickle_only(tmp_root, tmp_path):
  _, folder = _saved("qwen2", False, tmp_root)
  f = _copy(folder, tmp_path / "c")
  victim = sorted(f.glob("model-*.safetensors"))[1]
  victim.unlink()
  with pytest.raises(FileNotFoundError, match=victim.name):
    hf.load_pretrained(f)
  g = tmp_path / "pickle"
  g.mkdir()
  shutil.copy(f / "config.json", g / "config.json")
  (g / "pytorch_model.bin").write_bytes(b"not read")
  with pytest.raises(FileNotFoundError, match="never pickle"):
    hf.load_pretrained(g)


def test_error_unsupported_compressed_tensors_format(tmp_root, tmp_path):
  _, folder = _saved("qwen2", False, tmp_root)
  f = _copy(folder, tmp_path / "c")
  config = json.loads((f / "config.json").read_text())
  config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "mixed-precision",
                                   "config_groups": {"group_0": {"format": "float-quantized"},
                                                     "group_1": {"format": "nvfp4-pack-quantized"}}}
  (f / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r"\['float-quantized'\] are not supported"):
    hf.load_pretrained(f)


def test_error_unsupported_quantization(fixtures_dir, tmp_path):
  config = json.loads((fixtures_dir / "configs" / "qwen2.5-7b-instruct-mlx4bit" / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="quant_method"):
    hf.load_pretrained(tmp_path)


def test_modelopt_quant_algo_in_config_json(fixtures_dir, tmp_root, tmp_path):
  """ModelOpt 0.37 writes quantization_config (with quant_algo) into config.json, as in the real
  nvidia/Gemma-4-31B-IT-NVFP4 config: NVFP4 passes the check, another algorithm (here FP8, as
  ModelOpt's FP8 export names it) is refused by name instead of loading as if unquantized."""
  real = json.loads((fixtures_dir / "nvfp4" / "modelopt" / "nvidia-Gemma-4-31B-IT-NVFP4" / "config.json")
                    .read_text())["quantization_config"]
  assert real["quant_method"] == "modelopt" and real["quant_algo"] == "NVFP4"
  hf._check_quantization_config({"quantization_config": real}, tmp_path)  # accepted
  _, folder = _saved("qwen2", False, tmp_root)
  f = _copy(folder, tmp_path / "c")
  config = json.loads((f / "config.json").read_text())
  fp8 = json.loads(json.dumps(real))
  fp8["quant_algo"] = "FP8"
  for part in ("weights", "input_activations"):
    fp8["config_groups"]["group_0"][part] = {"dynamic": False, "num_bits": 8, "type": "float"}
  config["quantization_config"] = fp8
  (f / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="quant_algo 'FP8'"):
    hf.load_pretrained(f, load_tokenizer=False)


def test_real_modelopt_header_layout(fixtures_dir, tmp_path):
  """The header of nvidia/Llama-3.1-8B-Instruct-NVFP4 shard 1, as a sparse file with known bytes
  written into layer 0's q_proj: detected as ModelOpt, shapes checked against the 8B config, row 0
  dequantizes to e2m1 * weight_scale * weight_scale_2."""
  src = fixtures_dir / "nvfp4" / "modelopt" / "nvidia-Llama-3.1-8B-Instruct-NVFP4"
  header_bytes = (src / "model-00001-of-00002.safetensors.header.json").read_bytes()
  header = json.loads(header_bytes)
  path = tmp_path / "model-00001-of-00002.safetensors"
  data_start = 8 + len(header_bytes)
  end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
  with open(path, "wb") as f:
    f.write(len(header_bytes).to_bytes(8, "little"))
    f.write(header_bytes)
    f.truncate(data_start + end)  # sparse: no real data on disk
  rng = np.random.default_rng(0)
  pre = "model.layers.0.self_attn.q_proj"
  codes = rng.integers(0, 16, 4096).astype(np.uint8)  # row 0 (output feature 0), K = 4096
  row_bytes = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)
  scale_row = np.full(256, 3.0, np.float32).astype(ml_dtypes.float8_e4m3fn)
  ws2 = np.float32(0.25)
  with open(path, "r+b") as f:
    for key, blob in ((pre + ".weight", row_bytes), (pre + ".weight_scale", scale_row),
                      (pre + ".weight_scale_2", np.array(ws2, np.float32))):
      f.seek(data_start + header[key]["data_offsets"][0])
      f.write(blob.tobytes())
  st = hf.SafetensorsFile(path)
  reader = hf.CheckpointReader.__new__(hf.CheckpointReader)
  reader._files, reader._where = {path.name: st}, {k: path.name for k in st.keys()}
  cfg = models.ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                           num_heads=32, num_kv_heads=8, head_dim=128, architecture="LlamaForCausalLM")
  for (group, name), hf_name in hf.HF_LINEARS.items():
    src_kind = hf._linear_source(reader, f"model.layers.0.{hf_name}")
    assert src_kind.kind == "modelopt"
    k, n = cfg.linear_shapes()[(group, name)]
    assert reader.shape(src_kind.prefix + ".weight") == (n, k // 2)
    assert reader.shape(src_kind.prefix + ".weight_scale") == (n, k // 16)
  t = hf._read_nvfp4(reader, hf._linear_source(reader, pre), 4096, 4096)
  assert float(t.global_scale) == 4.0
  col0 = np.asarray(nvfp4.dequantize(t, jnp.float32))[:, 0]  # output feature 0 over K
  np.testing.assert_array_equal(col0, E2M1[codes] * np.float32(3.0) * ws2)
