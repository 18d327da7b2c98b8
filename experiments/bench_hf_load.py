"""Peak host memory of `qerl_jax.hf.load_pretrained` on a synthetic multi-shard bf16 checkpoint.

Writes a Qwen2-shaped random checkpoint of a few GB (safetensors shards + index)
unless it exists, then loads it in a fresh subprocess per quantization mode and
prints a table: checkpoint bytes, loaded model bytes, peak resident set size
(VmHWM of the child), and the peak over a baseline process that only
imports jax and qerl_jax.

  PYTHONPATH=$PWD python experiments/bench_hf_load.py --dir /tmp/synth_ckpt --layers 20
"""

import json
import pathlib
import subprocess
import sys
import time

from absl import app, flags
import ml_dtypes
import numpy as np

FLAGS = flags.DEFINE_string("dir", "/tmp/qerl_synth_ckpt", "checkpoint folder (created if missing)")
flags.DEFINE_integer("layers", 20, "decoder layers")
flags.DEFINE_integer("hidden", 2560, "hidden size")
flags.DEFINE_integer("intermediate", 9728, "MLP size")
flags.DEFINE_integer("vocab", 32000, "vocabulary")
flags.DEFINE_integer("shard_mb", 1000, "max shard size, MB")
flags.DEFINE_list("quant", ["nvfp4", "none"], "modes to measure")
F = flags.FLAGS

_CHILD = r"""
import resource, sys, time, jax
import qerl_jax.hf as hf
t0 = time.time()
if sys.argv[2] != "baseline":
  cfg, base, tok, gen = hf.load_pretrained(sys.argv[1], quant=sys.argv[2], load_tokenizer=False)
  jax.block_until_ready(base)
  nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(base))
else:
  nbytes = 0
# VmHWM: this process's own peak RSS (ru_maxrss can carry the parent's peak over fork/exec).
hwm_kb = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
print(nbytes, time.time() - t0, hwm_kb * 1024)
"""


def write_checkpoint(folder: pathlib.Path):
  from qerl_jax import hf
  d, f, v, L = F.hidden, F.intermediate, F.vocab, F.layers
  heads, kv = d // 128, max(1, d // 128 // 5)
  config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": v,
            "hidden_size": d, "intermediate_size": f, "num_hidden_layers": L,
            "num_attention_heads": heads, "num_key_value_heads": kv, "rms_norm_eps": 1e-6,
            "rope_theta": 1e6, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
  rng = np.random.default_rng(0)
  shapes = {"self_attn.q_proj": (d, d), "self_attn.k_proj": (kv * 128, d),
            "self_attn.v_proj": (kv * 128, d), "self_attn.o_proj": (d, d),
            "mlp.gate_proj": (f, d), "mlp.up_proj": (f, d), "mlp.down_proj": (d, f)}
  proto = {k: (0.02 * rng.standard_normal(s, np.float32)).astype(ml_dtypes.bfloat16) for k, s in shapes.items()}
  tensors = [("model.embed_tokens.weight", lambda: (0.02 * rng.standard_normal((v, d), np.float32)).astype(ml_dtypes.bfloat16)),
             ("lm_head.weight", lambda: (0.02 * rng.standard_normal((v, d), np.float32)).astype(ml_dtypes.bfloat16)),
             ("model.norm.weight", lambda: np.ones((d,), ml_dtypes.bfloat16))]
  for i in range(L):
    scale = ml_dtypes.bfloat16(1.0 + 0.01 * i)
    for k, s in shapes.items():
      tensors.append((f"model.layers.{i}.{k}.weight", lambda k=k, scale=scale: proto[k] * scale))
      if k in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
        tensors.append((f"model.layers.{i}.{k}.bias", lambda s=s: np.zeros((s[0],), ml_dtypes.bfloat16)))
    for nm in ("input_layernorm", "post_attention_layernorm"):
      tensors.append((f"model.layers.{i}.{nm}.weight", lambda: np.ones((d,), ml_dtypes.bfloat16)))
  folder.mkdir(parents=True, exist_ok=True)
  shards, cur, size, limit = [], [], 0, F.shard_mb << 20
  for name, make in tensors:
    arr = make()
    if cur and size + arr.nbytes > limit:
      shards.append(cur)
      cur, size = [], 0
    cur.append((name, arr))
    size += arr.nbytes
    if size >= limit:
      shards.append(cur)
      cur, size = [], 0
  if cur:
    shards.append(cur)
  weight_map, total = {}, 0
  for j, shard in enumerate(shards):
    fname = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
    hf.save_safetensors(folder / fname, dict(shard), {"format": "pt"})
    for name, arr in shard:
      weight_map[name] = fname
      total += arr.nbytes
  (folder / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {"total_size": total}, "weight_map": weight_map}))
  (folder / "config.json").write_text(json.dumps(config))


def main(argv):
  del argv
  folder = pathlib.Path(F.dir)
  if not (folder / "config.json").is_file():
    t0 = time.time()
    write_checkpoint(folder)
    print(f"wrote {folder} in {time.time() - t0:.0f} s")
  ckpt = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
  n_shards = len(list(folder.glob("*.safetensors")))
  rows = []
  for mode in ["baseline"] + list(F.quant):
    out = subprocess.run([sys.executable, "-c", _CHILD, str(folder), mode], check=True,
                         capture_output=True, text=True).stdout.split()
    rows.append((mode, int(out[0]), float(out[1]), int(out[2])))
  base_rss = rows[0][3]
  print(f"\ncheckpoint: {ckpt / 2**30:.2f} GiB bf16 in {n_shards} shards, {F.layers} layers, "
        f"hidden {F.hidden}, intermediate {F.intermediate}, vocab {F.vocab}")
  print(f"{'quant':>9} | {'model GiB':>9} | {'load s':>7} | {'peak RSS GiB':>12} | {'peak - baseline GiB':>19}")
  for mode, nbytes, secs, rss in rows:
    print(f"{mode:>9} | {nbytes / 2**30:9.2f} | {secs:7.1f} | {rss / 2**30:12.2f} | {(rss - base_rss) / 2**30:19.2f}")


if __name__ == "__main__":
  app.run(main)
