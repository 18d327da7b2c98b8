r"""Pretrains the embedded default model: a tiny Qwen2 on the synthetic GSM8K-like task.

Builds the task (:mod:`qerl_jax.synthetic`), trains a byte-level BPE tokenizer on
it, trains a small Qwen2-architecture decoder (this project's
:mod:`qerl_jax.models`, optax AdamW) by supervised learning on prompt ->
worked solution, and stops *part of the way*: as soon as greedy accuracy on the
held-out split reaches ``--stop_at_accuracy`` (checked every ``--eval_every``
steps), so that reinforcement learning has room to improve it. Then writes a
Hugging Face folder (config.json, model.safetensors, tokenizer, generation_config.json)
that ``transformers`` loads, plus ``metrics.json``.

Usage (CPU, a few minutes on 2 cores)::

  PYTHONPATH=$PWD python experiments/pretrain_tiny.py --out=assets/tiny-gsm
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import sys
import time

# transformers warns at import that PyTorch is absent; the project never needs PyTorch.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from qerl_jax import hf, models, synthetic  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "assets/tiny-gsm", "output folder (Hugging Face layout)")
flags.DEFINE_integer("seed", 0, "seed of the data, the init and the batch order")
flags.DEFINE_integer("num_train", 20000, "training problems")
flags.DEFINE_integer("num_eval", 200, "held-out problems for the greedy accuracy")
flags.DEFINE_integer("vocab_size", 512, "BPE vocabulary size")
flags.DEFINE_integer("hidden_size", 128, "model width (a multiple of 64 for NF4/NVFP4 blocks)")
flags.DEFINE_integer("intermediate_size", 256, "MLP width (a multiple of 64)")
flags.DEFINE_integer("num_layers", 3, "decoder layers")
flags.DEFINE_integer("head_dim", 32, "attention head size")
flags.DEFINE_integer("num_kv_heads", 2, "key/value heads (GQA)")
flags.DEFINE_integer("batch_size", 32, "sequences per step")
flags.DEFINE_integer("max_steps", 3000, "step limit")
flags.DEFINE_float("learning_rate", 3e-3, "peak AdamW learning rate (linear warmup, then constant)")
flags.DEFINE_integer("warmup_steps", 100, "linear warmup steps")
flags.DEFINE_integer("eval_every", 100, "steps between held-out greedy evaluations")
flags.DEFINE_float("stop_at_accuracy", 0.3, "stop once held-out greedy accuracy >= this (fraction)")
flags.DEFINE_integer("max_new_tokens", 96, "greedy decode length for evaluation")


README = """# tiny-gsm: the embedded default model

A {params}-parameter Qwen2-architecture decoder (hidden {d}, MLP {f}, {L} layers, {h} query heads /
{kv} key-value heads of {hd}, tied embeddings, vocabulary {v}) trained by supervised learning on
the synthetic GSM8K-like task of `qerl_jax/synthetic.py` (2-3 step arithmetic word problems
with a worked solution and a final `#### <number>` line). It was stopped **part of the way on
purpose** (at the first evaluation with held-out greedy accuracy >= {stop}), so that
reinforcement learning has room to improve it.

Made with (CPU, {time:.0f} s wall time on a shared 2-core machine):

    {command}

| what | value |
| --- | --- |
| seed | {seed} |
| training problems / steps / batch | {n_train} / {steps} / {batch} sequences |
| optimizer | AdamW (optax), peak lr {lr}, linear warmup then constant, grad-norm clip 1.0 |
| final training loss (nats/token, solution tokens) | {loss:.3f} |
| held-out greedy accuracy, float32 weights | {acc:.3f} ({n_eval} problems of the `test` split, seed {seed}) |
| held-out greedy accuracy, bf16 weights (this checkpoint) | {acc_bf16:.3f} |
| held-out greedy accuracy, NVFP4 linears | {acc_nvfp4:.3f} |

Files: `config.json` (Qwen2ForCausalLM), `model.safetensors` (bf16), `tokenizer.json` +
`tokenizer_config.json` (byte-level BPE, digits single tokens, ChatML template without a
system turn; eos `<|im_end|>`, pad `<|endoftext|>`), `generation_config.json`, `metrics.json`
(the evaluation history). Prompts are the chat template applied to one user turn holding the
question (`qerl_jax.synthetic.prompt_messages`). Load with `transformers.AutoModelForCausalLM`
/ `AutoTokenizer`, or `qerl_jax.hf.load_pretrained("assets/tiny-gsm")`.
"""


def encode(tokenizer, record: dict) -> tuple[list[int], list[int]]:
  """(prompt ids with the chat template and generation prompt, solution ids + <|im_end|>)."""
  prompt = tokenizer.apply_chat_template(synthetic.prompt_messages(record["question"]),
                                         add_generation_prompt=True, tokenize=True, return_dict=False)
  answer = tokenizer(record["answer"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
  return list(prompt), list(answer)


def make_batch(pairs, idx, pad_id: int, seq_len: int) -> dict:
  """Right-padded SFT batch: tokens/mask int32 [B, seq_len], loss_mask f32 [B, seq_len] on
  solution targets (one fixed shape: one compilation)."""
  t = seq_len
  tokens = np.full((len(idx), t), pad_id, np.int32)
  mask = np.zeros((len(idx), t), np.int32)
  loss_mask = np.zeros((len(idx), t), np.float32)
  for r, i in enumerate(idx):
    p, a = pairs[i]
    tokens[r, :len(p) + len(a)] = p + a
    mask[r, :len(p) + len(a)] = 1
    loss_mask[r, len(p):len(p) + len(a)] = 1.0  # position j predicts token j (shifted below)
  return {"tokens": tokens, "mask": mask, "loss_mask": loss_mask}


def sft_loss(params, cfg, batch):
  """Mean next-token cross-entropy (nats) over solution tokens."""
  tokens, mask = batch["tokens"], batch["mask"]
  logits, _ = models.forward(cfg, params, tokens, models.positions_from_mask(mask), attn_mask=mask)
  logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  tgt = tokens[:, 1:]
  nll = -jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
  w = batch["loss_mask"][:, 1:]
  return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "eos_id"))
def greedy_decode(cfg, params, prompt, prompt_mask, *, max_new_tokens: int, eos_id: int):
  """Greedy completions int32 [B, max_new_tokens] of left-padded prompts [B, P] (KV cache)."""
  b, p = prompt.shape
  cache = models.init_cache(cfg, b, p + max_new_tokens, dtype=jnp.float32)
  pos = models.positions_from_mask(prompt_mask)
  hidden, cache = models.forward(cfg, params, prompt, pos, attn_mask=prompt_mask, cache=cache,
                                 return_hidden=True)
  first = jnp.argmax(models.lm_head_logits(cfg, params, hidden[:, -1]), -1).astype(jnp.int32)

  def step(carry, _):
    tok, last_pos, cache, done = carry
    logits, cache = models.forward(cfg, params, tok[:, None], (last_pos + 1)[:, None], cache=cache)
    nxt = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
    done = done | (tok == eos_id)
    nxt = jnp.where(done, eos_id, nxt)
    return (nxt, last_pos + 1, cache, done), tok

  init = (first, pos[:, -1], cache, jnp.zeros((b,), bool))
  _, toks = jax.lax.scan(step, init, None, length=max_new_tokens)
  return toks.T


def greedy_accuracy(cfg, params, tokenizer, records, *, max_new_tokens: int, batch_size: int = 100,
                    prompt_len: int = 96):
  """Fraction of ``records`` whose greedy completion's ``####`` answer equals the gold one,
  and the completions. Prompts are left-padded to ``prompt_len`` tokens (one compilation)."""
  eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
  pad_id = tokenizer.pad_token_id
  correct, samples = 0, []
  for start in range(0, len(records), batch_size):
    chunk = records[start:start + batch_size]
    prompts = [encode(tokenizer, r)[0] for r in chunk]
    p = max([prompt_len] + [len(x) for x in prompts])
    toks = np.full((len(chunk), p), pad_id, np.int32)
    mask = np.zeros((len(chunk), p), np.int32)
    for i, ids in enumerate(prompts):
      toks[i, p - len(ids):] = ids
      mask[i, p - len(ids):] = 1
    out = np.asarray(greedy_decode(cfg, params, jnp.asarray(toks), jnp.asarray(mask),
                                   max_new_tokens=max_new_tokens, eos_id=eos_id))
    for r, row in zip(chunk, out):
      ids = row.tolist()
      if eos_id in ids:
        ids = ids[:ids.index(eos_id)]
      text = tokenizer.decode(ids, skip_special_tokens=True)
      correct += synthetic.extract_answer(text) == r["gold"]
      samples.append(text)
  return correct / max(len(records), 1), samples


def main(argv):
  del argv
  t0 = time.time()
  out = pathlib.Path(FLAGS.out)
  train = synthetic.make_split("train", FLAGS.num_train, FLAGS.seed)
  test = synthetic.make_split("test", FLAGS.num_eval, FLAGS.seed)
  tokenizer = synthetic.build_tokenizer(synthetic.training_texts(train[:5000]), FLAGS.vocab_size)
  pairs = [encode(tokenizer, r) for r in train]
  lengths = np.array([len(p) + len(a) for p, a in pairs])
  seq_len = -(-int(lengths.max()) // 16) * 16
  short_len = -(-int(np.percentile(lengths, 75)) // 16) * 16
  short_idx, long_idx = np.nonzero(lengths <= short_len)[0], np.nonzero(lengths > short_len)[0]
  d = FLAGS.hidden_size
  if d % 64 or FLAGS.intermediate_size % 64:
    raise ValueError(f"hidden_size ({d}) and intermediate_size ({FLAGS.intermediate_size}) must be "
                     "multiples of 64 (NF4 blocks of 64 along K)")
  num_heads = d // FLAGS.head_dim
  hf_config = {
      "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
      "vocab_size": len(tokenizer), "hidden_size": d, "intermediate_size": FLAGS.intermediate_size,
      "num_hidden_layers": FLAGS.num_layers, "num_attention_heads": num_heads,
      "num_key_value_heads": FLAGS.num_kv_heads, "head_dim": FLAGS.head_dim,
      "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
      "max_position_embeddings": 512, "tie_word_embeddings": True, "use_sliding_window": False,
      "bos_token_id": None, "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
      "pad_token_id": tokenizer.pad_token_id,
  }
  cfg = models.ModelConfig.from_hf(hf_config, dtype="float32")
  key = jax.random.PRNGKey(FLAGS.seed)
  params = models.init_params(cfg, key, dtype=jnp.float32)
  params["layers"]["attn"] = {k: (jnp.zeros_like(v) if k.endswith("_bias") else v)
                              for k, v in params["layers"]["attn"].items()}
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  print(f"model: {n_params} parameters, {cfg}", flush=True)

  sched = optax.join_schedules([optax.linear_schedule(0.0, FLAGS.learning_rate, FLAGS.warmup_steps),
                                optax.constant_schedule(FLAGS.learning_rate)], [FLAGS.warmup_steps])
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
  opt_state = opt.init(params)

  @jax.jit
  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(sft_loss)(params, cfg, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(FLAGS.seed)
  history = []
  acc, step, loss = 0.0, 0, float("nan")
  for step in range(1, FLAGS.max_steps + 1):
    # Two length buckets (two compilations), each batch from one bucket, chosen by bucket size.
    bucket = short_idx if rng.random() < len(short_idx) / len(pairs) else long_idx
    idx = bucket[rng.integers(0, len(bucket), FLAGS.batch_size)]
    batch = make_batch(pairs, idx, tokenizer.pad_token_id, short_len if bucket is short_idx else seq_len)
    params, opt_state, loss = train_step(params, opt_state, batch)
    if step % 25 == 0:
      print(f"step {step}: loss {float(loss):.3f} ({time.time() - t0:.0f} s)", flush=True)
    if step % FLAGS.eval_every == 0 or step == FLAGS.max_steps:
      acc, samples = greedy_accuracy(cfg, params, tokenizer, test, max_new_tokens=FLAGS.max_new_tokens)
      history.append({"step": step, "loss": float(loss), "accuracy": acc, "time_s": time.time() - t0})
      print(f"step {step}: loss {float(loss):.3f} held-out greedy accuracy {acc:.3f} "
            f"({time.time() - t0:.0f} s)\n  sample: {samples[0]!r}", flush=True)
      if acc >= FLAGS.stop_at_accuracy:
        break

  # Export in bf16 (what the trainer loads) and report the accuracy of what was written.
  params_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)
  acc_bf16, _ = greedy_accuracy(cfg, params_bf16, tokenizer, test, max_new_tokens=FLAGS.max_new_tokens)
  acc_nvfp4, _ = greedy_accuracy(cfg, models.quantize_base(params_bf16, "nvfp4"), tokenizer, test,
                                 max_new_tokens=FLAGS.max_new_tokens)
  gen = {"eos_token_ids": [hf_config["eos_token_id"], tokenizer.pad_token_id],
         "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None, "do_sample": False,
         "max_new_tokens": FLAGS.max_new_tokens}
  hf.save_pretrained(out, cfg.replace(dtype="bfloat16"), params, dtype=ml_dtypes.bfloat16,
                     tokenizer=tokenizer, generation_config=gen)
  # The chat template also inside tokenizer_config.json, and a tokenizer class that
  # transformers 4.x knows too (5.x writes chat_template.jinja and "TokenizersBackend").
  tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
  tok_cfg.update({"chat_template": synthetic.CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"})
  (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
  config_json = json.loads((out / "config.json").read_text())  # add the token ids transformers reads
  config_json.update({k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id",
                                               "use_sliding_window")})
  (out / "config.json").write_text(json.dumps(config_json, indent=2))
  metrics = {"command": "python experiments/pretrain_tiny.py " + " ".join(sys.argv[1:]),
             "seed": FLAGS.seed, "steps": step, "batch_size": FLAGS.batch_size,
             "parameters": n_params, "final_loss": float(loss),
             "heldout_greedy_accuracy_f32": acc, "heldout_greedy_accuracy_bf16": acc_bf16,
             "heldout_greedy_accuracy_nvfp4": acc_nvfp4, "num_eval": FLAGS.num_eval,
             "time_s": round(time.time() - t0, 1), "history": history}
  (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
  (out / "README.md").write_text(README.format(
      command=metrics["command"], seed=FLAGS.seed, steps=step, batch=FLAGS.batch_size,
      lr=FLAGS.learning_rate, params=n_params, d=d, f=FLAGS.intermediate_size, L=FLAGS.num_layers,
      h=num_heads, kv=FLAGS.num_kv_heads, hd=FLAGS.head_dim, v=len(tokenizer), n_train=FLAGS.num_train,
      n_eval=FLAGS.num_eval, acc=acc, acc_bf16=acc_bf16, acc_nvfp4=acc_nvfp4, loss=float(loss),
      time=metrics["time_s"], stop=FLAGS.stop_at_accuracy))
  print(json.dumps({k: v for k, v in metrics.items() if k != "history"}, indent=2))


if __name__ == "__main__":
  app.run(main)
