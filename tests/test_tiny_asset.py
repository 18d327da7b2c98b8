"""The embedded default model (assets/tiny-gsm): transformers loads it, generates with it, and
our decoder's greedy completions agree with transformers' (an independent implementation)."""

import json
import pathlib

import numpy as np
import pytest

ASSET = pathlib.Path(__file__).resolve().parents[1] / "assets" / "tiny-gsm"

pytestmark = pytest.mark.skipif(not (ASSET / "model.safetensors").is_file(), reason="assets/tiny-gsm not built")


def test_asset_files_and_size():
  for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "generation_config.json", "README.md"):
    assert (ASSET / name).is_file(), name
  assert (ASSET / "model.safetensors").stat().st_size < 8 * 2**20  # a few MB, fine for git
  cfg = json.loads((ASSET / "config.json").read_text())
  assert cfg["architectures"] == ["Qwen2ForCausalLM"]
  assert cfg["hidden_size"] % 64 == 0 and cfg["intermediate_size"] % 64 == 0  # NF4 blocks of 64 along K


def _prompts(tok, n):
  from qerl_jax import data, synthetic
  probs = synthetic.make_split("test", n, seed=0)
  return probs, [tok(data.build_prompt(tok, p["question"]), add_special_tokens=False)["input_ids"] for p in probs]


def test_transformers_generates_and_matches_our_decoder():
  import jax
  import jax.numpy as jnp
  torch = pytest.importorskip("torch", reason="PyTorch (a dev extra) runs transformers' generate")
  from transformers import AutoModelForCausalLM, AutoTokenizer

  from qerl_jax import hf, sampling

  tok = AutoTokenizer.from_pretrained(str(ASSET))
  model = AutoModelForCausalLM.from_pretrained(str(ASSET), dtype=torch.float32).eval()
  gen = json.loads((ASSET / "generation_config.json").read_text())
  im_end = tok.convert_tokens_to_ids("<|im_end|>")
  assert im_end in gen["eos_token_id"]

  probs, prompts = _prompts(tok, 4)
  n_new = 24
  theirs = []
  for ids in prompts:
    with torch.no_grad():
      out = model.generate(torch.tensor([ids]), max_new_tokens=n_new, do_sample=False,
                           eos_token_id=gen["eos_token_id"], pad_token_id=tok.pad_token_id)
    theirs.append(out[0, len(ids):].tolist())
  text = tok.decode(theirs[0], skip_special_tokens=True)
  assert len(theirs[0]) > 5 and text.strip(), text  # it writes something (a worked solution)

  pre = hf.load_pretrained(str(ASSET), quant="none", dtype=jnp.float32, compute_dtype="float32")
  P = max(map(len, prompts))
  toks = np.full((len(prompts), P), tok.pad_token_id, np.int32)
  mask = np.zeros_like(toks)
  for i, ids in enumerate(prompts):
    toks[i, P - len(ids):] = ids
    mask[i, P - len(ids):] = 1
  scfg = sampling.SamplingConfig(max_new_tokens=n_new, eos_token_ids=tuple(gen["eos_token_id"]),
                                 pad_id=tok.pad_token_id, temperature=0.0, num_generations=1,
                                 cache_dtype=jnp.float32)
  ours = sampling.generate(pre.cfg, pre.base, jnp.asarray(toks), jnp.asarray(mask), jax.random.PRNGKey(0), scfg)
  for row, n, ref in zip(np.asarray(ours.tokens), np.asarray(ours.lengths), theirs):
    assert row[:n].tolist() == ref[:n]


def test_metrics_record_accuracy_in_range():
  m = json.loads((ASSET / "metrics.json").read_text())
  # Trained part of the way on purpose: RL needs room to improve.
  assert 0.15 <= m["heldout_greedy_accuracy_bf16"] <= 0.6
