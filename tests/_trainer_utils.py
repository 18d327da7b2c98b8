"""A toy policy for fast trainer tests: a categorical distribution over 10 digit tokens.

It plugs into ``trainer.train(policy=...)`` and exercises the real loop, the real GRPO update
step (``qerl_jax.update``), checkpointing and logging in well under a second per step, with no
model. Token 0 is the end token (and pad); tokens 1..10 are the digits '0'..'9'.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax import trainer, update

V = 11
T = 3


class DigitTokenizer:
  """Token 0 = end/pad; token d + 1 = the digit d; any other character -> token 10 + 1."""

  pad_token_id = 0
  eos_token_id = 0

  def __call__(self, text, add_special_tokens=False):
    return {"input_ids": [int(ch) + 1 if ch.isdigit() else V - 1 for ch in text]}

  def decode(self, ids, skip_special_tokens=True):
    return "".join(str(int(i) - 1) for i in ids if int(i) != 0)


@dataclasses.dataclass
class ToyRollout:
  tokens: jax.Array
  mask: jax.Array
  lengths: jax.Array
  truncated: jax.Array
  finished: jax.Array
  policy_logprobs: jax.Array
  logprobs: jax.Array


def _generate(params, noise, prompt_tokens, prompt_mask, key, *, num_generations, greedy,
              max_new_tokens, temperature=None):
  n = prompt_tokens.shape[0] * num_generations
  logits = params["logits"] + (0.0 if noise is None else noise["bias"])
  if greedy:
    toks = jnp.broadcast_to(jnp.argmax(logits), (n, T)).astype(jnp.int32)
  else:
    toks = jax.random.categorical(key, logits, shape=(n, T)).astype(jnp.int32)
  is_end = toks == 0
  first = jnp.where(is_end.any(1), jnp.argmax(is_end, 1), T)
  mask = (jnp.arange(T)[None] <= first[:, None]).astype(jnp.int32)
  toks = jnp.where(mask == 1, toks, 0)
  lp = jnp.take(jax.nn.log_softmax(logits), toks) * mask
  return ToyRollout(tokens=toks, mask=mask, lengths=mask.sum(1), truncated=first >= T,
                    finished=first < T, policy_logprobs=lp, logprobs=lp)


def toy_policy(config) -> trainer.Policy:
  upd_cfg = trainer.update_config(config)

  def logprob_fn(params, mb):
    logits = params["logits"] + mb["shared"]["bias"]
    logp = jax.nn.log_softmax(logits)
    ent = -jnp.sum(jnp.exp(logp) * logp)
    lp = jnp.take(logp, mb["completion_tokens"])
    return lp, jnp.full(lp.shape, ent)

  step_fn = update.make_update_step(logprob_fn, upd_cfg)

  def noise(step):
    return {"bias": jnp.full((V,), 1e-3 * (step % 3), jnp.float32)}

  def do_update(state, batch, noise_, step, key):
    batch = {k: v for k, v in batch.items() if k not in ("prompt_tokens", "prompt_mask")}
    return step_fn(state, {**batch, "shared": noise_}, step, key)

  return trainer.Policy(
      tokenizer=DigitTokenizer(), pad_id=0,
      init_state=lambda key: update.make_train_state(
          {"logits": 0.1 * jax.random.normal(key, (V,), jnp.float32)},
          update.make_optimizer(upd_cfg)),
      noise=noise, update_noise=lambda z: z, sigma=lambda step: 1e-3 * (step % 3),
      generate=_generate, ref_logprobs=lambda batch, z: jnp.zeros_like(batch["old_logprobs"]),
      update=do_update, description="toy")


def toy_datasets(n_train=40, n_eval=8):
  rng = np.random.default_rng(0)
  mk = lambda i: trainer.Prompt(text=f"q{i}", answer=str(int(rng.integers(0, 10))))
  return [mk(i) for i in range(n_train)], [mk(i) for i in range(n_eval)]


def contains_answer(completions, answers):
  return [1.0 if a in c else 0.0 for c, a in zip(completions, answers)]


def toy_config():
  from qerl_jax import train_config
  c = train_config.base_config()
  c.model.path = "toy"
  c.data.train = "toy"
  c.data.max_prompt_length = 3
  c.rl.num_generations = 4
  c.rl.batch_size = 8
  c.rl.micro_batch_size = 4
  c.sampling.max_completion_length = T
  c.optim.learning_rate = 0.1
  c.optim.max_grad_norm = 1.0
  c.train.total_steps = 6
  c.train.save_every = 2
  c.train.eval_every = 3
  c.train.eval_batch_size = 4
  c.train.log_samples_every = 2
  c.train.async_checkpointing = True
  c.train.plot = False
  return c
