"""The training job: rollout -> reward -> advantage -> update, checkpointed and resumable.

One step of :func:`train` (QeRL, arXiv:2510.11696, Alg. 1 with GRPO, Shao et al. 2024):

1. take the step's batch of prompts from a seeded order of the training set;
2. draw that step's AQN noise for the RMSNorm scales (``aqn.noise``; sigma from the schedule);
3. sample ``num_generations`` completions per prompt with the 4-bit base + LoRA + noise
   (``sampling.generate``);
4. score each completion on the host (bounded time, one float each; a failed score is missing,
   NaN, and gets advantage 0), plus DAPO's overlong penalty when ``rl.overlong_buffer_length``
   is set; with ``rl.dynamic_sampling`` (DAPO), steps 1, 3 and 4 repeat on the next batches of
   prompts until ``batch_size / G`` groups carry signal (some answers right, some wrong) or
   ``rl.max_sampling_rounds`` rollouts were made (each of ``rl.oversample_factor`` batches of
   prompts), and the update takes those groups;
5. group-normalised advantages (``grpo.group_advantages``);
6. the old log-probs of the importance ratio recomputed by the training forward when
   ``rl.recompute_old_logprobs`` or ``rl.rollout_correction`` (else the sampler's), and with the latter TRL's
   importance weights of the sampler's mismatch (``grpo.rollout_importance_weights``); reference log-probs with
   LoRA off when ``rl.beta > 0``;
7. ``num_iterations`` updates over micro-batches (``grpo`` objective, optax AdamW);
8. log; checkpoint every ``train.save_every`` steps; greedy evaluation every ``train.eval_every``.

Reproducibility: every random draw derives from ``(config.seed, step)`` through
:func:`step_keys`, and the data order from ``(config.seed, epoch)``, so a run resumed from a
checkpoint reproduces an uninterrupted run bit for bit on the CPU.

Public: :func:`run` (config, workdir) -> summary dict, :func:`train`, :func:`evaluate`,
:func:`load_policy`, :func:`load_prompts`, :func:`restore_train_state`, :func:`step_keys`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import shlex
import socket
import sys
import time
import types
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from qerl_jax import checkpoint as ckpt_lib
from qerl_jax import data as data_lib
from qerl_jax import grpo
from qerl_jax import metrics as metrics_lib
from qerl_jax import train_config

__all__ = ["run", "train", "evaluate", "load_policy", "load_prompts", "restore_train_state",
           "step_keys", "Policy", "Prompt", "RunSetupError", "REWARD_TIMEOUT_S"]


# ---------------------------------------------------------------------------------- randomness

_AQN_STREAM = 0xA0   # fold_in(PRNGKey(seed), _AQN_STREAM): the run's AQN key (aqn.noise folds the step)
_LORA_STREAM = 0x1A0A  # fold_in(PRNGKey(seed), _LORA_STREAM): the LoRA initialisation key


@dataclasses.dataclass(frozen=True)
class StepKeys:
  """PRNG keys of one step, derived from ``(seed, step)``: rollout sampling, update.

  (The step's AQN noise comes from ``aqn.noise(fold_in(PRNGKey(seed), 0xA0), step, ...)``,
  also a pure function of the seed and the step.)
  """
  sample: jax.Array
  update: jax.Array


def step_keys(seed: int, step: int) -> StepKeys:
  """The keys of training step ``step`` (0-based): ``fold_in(fold_in(PRNGKey(seed), step), i)``.

  Pure function of ``(seed, step)``: a resumed run draws exactly the keys of an uninterrupted one.
  """
  k = jax.random.fold_in(jax.random.PRNGKey(int(seed)), int(step))
  return StepKeys(sample=jax.random.fold_in(k, 1), update=jax.random.fold_in(k, 2))


# ---------------------------------------------------------------------------------- data

@dataclasses.dataclass(frozen=True)
class Prompt:
  """One prompt of a data set: the chat-formatted text and the gold answer."""
  text: str
  answer: str


def _prompt_batch(tokenizer, prompts: Sequence[Prompt], length: int, pad_id: int):
  """``(tokens int32 [B, length], mask int32 [B, length])``, left-padded (``data.tokenize_prompts``).

  A fixed ``length`` (``data.max_prompt_length``) keeps the jitted rollout and update at one
  compiled shape per run.
  """
  b = data_lib.tokenize_prompts(tokenizer, [p.text for p in prompts], pad_to=length, pad_id=pad_id)
  return b.tokens, b.mask


# ---------------------------------------------------------------------------------- rewards

# Seconds a reward function passed to :func:`train` (``reward_fns``) may take on one batch; the library's own
# (make_reward_fns: the GSM8K check, math-verify, the format bonus) bound their time themselves.
REWARD_TIMEOUT_S = 600.0


def score(reward_fn: Callable, completions: Sequence[str], answers: Sequence[str], *,
          timeout_s: float | None = None) -> tuple[np.ndarray, int]:
  """Host-side rewards via ``rewards.safe_reward``: ``(float32 [N] with NaN = missing, #missing)``.

  A reward function that raises, returns a bad value or (with ``timeout_s``, seconds) runs too long costs
  only the affected completions: their reward is missing (NaN), which ``grpo.group_advantages`` turns
  into advantage 0.

  Raises:
    ValueError: ``completions`` and ``answers`` differ in length (a caller bug).
  """
  from qerl_jax import rewards as rewards_lib
  r, _ = rewards_lib.safe_reward(reward_fn, list(completions), list(answers), timeout_s=timeout_s)
  return r, int(np.isnan(r).sum())


# ---------------------------------------------------------------------------------- the policy

@dataclasses.dataclass
class Policy:
  """The frozen model and the functions the loop calls on it (built by :func:`load_policy`).

  Attributes:
    tokenizer: a transformers tokenizer (``decode``).
    pad_id: id written into left padding and after a completion's end.
    init_state: ``key -> update.TrainState`` (trainable tree, optax state, counters).
    noise: ``step -> norm_noise`` (AQN, float32 ``{"input_norm": [L, D], ...}``) or None.
    update_noise: ``(noise) -> noise`` used by the update (None for the paper's rollout-only AQN).
    sigma: ``step -> float``, the AQN sigma (0 when off).
    generate: ``(params, noise, prompt_tokens [B, P], prompt_mask [B, P], key, *,
      num_generations, greedy, max_new_tokens, temperature=None) -> sampling.Rollout`` with
      ``B * G`` rows (``params=None``: LoRA off; ``temperature=None``: the config's).
    ref_logprobs: ``(batch, noise) -> float32 [N, T]`` with LoRA off (for the KL term), computed
      ``rl.micro_batch_size`` rows at a time (one jitted ``lax.map``), so that its activations are a
      micro-batch's, as in the update.
    update: ``(state, batch, noise, step, key) -> (state, metrics)``: one optimizer step over the
      whole batch (micro-batched inside), ``batch`` as built by :func:`_update_batch`.
    old_logprobs: ``(params, batch, noise) -> float32 [N, T]``, the completions' log-probs under the
      training forward with adapter ``params`` and ``noise`` (``rl.recompute_old_logprobs``), computed as
      ``ref_logprobs`` is; None when the policy cannot (then that option is refused).
  """
  tokenizer: Any
  pad_id: int
  init_state: Callable[[jax.Array], dict]
  noise: Callable[[int], Any]
  update_noise: Callable[[Any], Any]
  sigma: Callable[[int], float]
  generate: Callable[..., Any]
  ref_logprobs: Callable[[dict, Any], jax.Array]
  update: Callable[..., tuple[Any, dict]]
  description: str = ""
  old_logprobs: Optional[Callable[[Any, dict, Any], jax.Array]] = None


@dataclasses.dataclass
class _Round:
  """One rollout of a step and its rewards (``N = len(prompts) * G`` rows)."""
  prompts: list            # [len(prompts)] Prompt
  prompt_tokens: Any       # int32 [len(prompts), P]
  prompt_mask: Any         # int32 [len(prompts), P]
  rollout: Any             # sampling.Rollout with N rows
  completions: list        # [N] str
  answers: list            # [N] str
  correct: np.ndarray      # float32 [N], the answer check (NaN: missing)
  rewards: np.ndarray      # float32 [N], the training reward (+ bonus, + overlong penalty)

  @functools.cached_property
  def informative(self) -> np.ndarray:
    """bool ``[len(prompts)]``: the groups whose answer checks are not all equal, some right and some
    wrong (DAPO eq. 11, ``0 < #correct < G``; verl's ``filter_groups.metric="acc"``), by
    ``grpo.informative_groups`` on ``correct``, not on the shaped reward: a format bonus or an overlong
    penalty alone must not make an all-wrong group count. Computed once a round for the stopping test and
    the group selection."""
    group_size = len(self.correct) // len(self.prompts)
    return np.asarray(grpo.informative_groups(jnp.asarray(self.correct), group_size))


def _recomputed_old_logprobs(policy: Policy, params, batch: dict, noise) -> tuple[jax.Array, dict]:
  """``(old_logprobs [N, T] float32, metrics)``: the completions' log-probs under the training forward
  (:attr:`Policy.old_logprobs`), and how far the sampler's (``batch["old_logprobs"]``) were from them over
  the completion tokens, in TRL's names: ``sampling/sampling_logp_difference/mean`` and ``/max`` (nats)."""
  old = jax.block_until_ready(policy.old_logprobs(params, batch, noise))
  mask = np.asarray(batch["completion_mask"]) > 0
  diff = np.abs(np.asarray(old, np.float64) - np.asarray(batch["old_logprobs"], np.float64))[mask]
  return old, {"sampling/sampling_logp_difference/mean": float(diff.mean()) if diff.size else 0.0,
               "sampling/sampling_logp_difference/max": float(diff.max()) if diff.size else 0.0}


def _rollout_correction(config, batch: dict, sampler_logprobs) -> tuple[jax.Array, dict]:
  """``(rho [N, T] float32, metrics)``: TRL's correction of the sampler's training-inference mismatch
  (``vllm_importance_sampling_correction``; Yao et al. 2025, truncated importance sampling), the update's weight
  of each completion token's clipped loss, and its ``sampling/importance_sampling_ratio/min``, ``/mean``,
  ``/max`` (over the tokens, or the sequences in the sequence and geometric modes, that count in the loss).

  Args:
    config: the run's config; ``rl.rollout_correction`` (a mode, not "none"), ``rl.rollout_correction_clip_min``
      (0 or None: no bound), ``rl.rollout_correction_clip_max``, ``rl.mask_truncated_completions``.
    batch: the update batch, whose ``old_logprobs`` [N, T] are already the training forward's (recomputed).
    sampler_logprobs: float32 [N, T], the rollout's (``Rollout.policy_logprobs``) for the same tokens.

  Returns: rho from ``grpo.rollout_importance_weights`` (0 on tokens outside the loss) and a dict of floats.
  """
  rl = config.rl
  mode = str(rl.rollout_correction)
  # the tokens the loss counts (with mask_truncated_completions, TRL's completion_mask drops truncated rows too)
  counted = dict(truncated=batch["truncated"], mask_truncated_completions=bool(rl.mask_truncated_completions))
  clip_min = rl.get("rollout_correction_clip_min", None)
  rho = grpo.rollout_importance_weights(batch["old_logprobs"], sampler_logprobs, batch["completion_mask"],
                                        mode=mode, clip_min=float(clip_min) if clip_min else None,
                                        clip_max=float(rl.rollout_correction_clip_max), **counted)
  return rho, _scalar_metrics(grpo.rollout_importance_metrics(rho, batch["completion_mask"], mode=mode,
                                                              **counted))


def _select_groups(rounds: Sequence[_Round], num_groups: int, group_size: int, *, dynamic: bool):
  """The groups one update takes from a step's rollouts: ``(rows, prompts, informative)``.

  Without dynamic sampling (one round): every group of it. With it: the first ``num_groups`` groups
  with some right and some wrong answers (:attr:`_Round.informative`), in sampling order; when the rounds
  hold fewer, the earliest other groups fill the batch, last (the loop masks them out of the loss), so its
  shape stays
  fixed. ``rows``: ``(round, first row)`` of each taken group; ``prompts``: their ``(round, prompt)``;
  ``informative``: how many taken groups carry signal.
  """
  if not dynamic:
    (r,) = rounds
    n = len(r.prompts)
    return [(0, i * group_size) for i in range(n)], [(0, i) for i in range(n)], None
  good, rest = [], []
  for ri, r in enumerate(rounds):
    for gi, ok in enumerate(r.informative):
      (good if ok else rest).append((ri, gi))
  taken = (good + rest)[:num_groups]
  good_set = set(good)
  return [(ri, gi * group_size) for ri, gi in taken], taken, sum(t in good_set for t in taken)


def _take_rows(rounds: Sequence[_Round], rows, group_size: int, field: str):
  """``rollout.<field>`` of the taken groups' rows, concatenated (``[num_groups * G, ...]``)."""
  parts = [getattr(rounds[ri].rollout, field)[r0:r0 + group_size] for ri, r0 in rows]
  return jnp.concatenate([jnp.asarray(p) for p in parts], axis=0)


def _update_batch(prompt_tokens, prompt_mask, rollout, advantages) -> dict:
  """The arrays one update consumes, ``N = B * G`` rows (prompts repeated G times)."""
  g = rollout.tokens.shape[0] // prompt_tokens.shape[0]
  return {
      "prompt_tokens": jnp.asarray(np.repeat(prompt_tokens, g, axis=0)),
      "prompt_mask": jnp.asarray(np.repeat(prompt_mask, g, axis=0)),
      "completion_tokens": rollout.tokens,
      "completion_mask": rollout.mask,
      "old_logprobs": rollout.policy_logprobs,
      "truncated": rollout.truncated,
      "advantages": jnp.asarray(advantages, jnp.float32),
  }


def _in_row_chunks(fn: Callable[..., jax.Array], rows: int, *arrays: jax.Array) -> jax.Array:
  """``fn(*arrays)`` computed ``rows`` rows at a time under ``jax.lax.map`` (inside a jit: one loop),
  so that what ``fn`` holds at once is a chunk's, e.g. the float32 attention scores of ``rows``
  sequences rather than of the whole batch.

  Args:
    fn: ``(*arrays) -> [n, ...]``, row ``i`` of its output a function of row ``i`` of each input only.
    rows: rows a chunk (clipped to ``N``); ``N`` not a multiple of it gets zero rows appended
      (all-masked sequences), whose outputs are dropped.
    arrays: each ``[N, ...]``, the same ``N``.

  Returns:
    ``fn(*arrays)``'s ``[N, ...]``, the same numbers as one call.

  Raises:
    ValueError: ``rows < 1``, no arrays, or arrays whose leading dimensions differ.
  """
  if rows < 1:
    raise ValueError(f"rows={rows} must be >= 1")
  if not arrays or len({a.shape[0] for a in arrays}) != 1:
    raise ValueError(f"arrays must share their leading (row) dimension; got shapes {[a.shape for a in arrays]}")
  n = arrays[0].shape[0]
  per = min(rows, n)
  chunks = -(-n // per)
  if chunks == 1:
    return fn(*arrays)
  pad = chunks * per - n
  split = [jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)).reshape(chunks, per, *a.shape[1:])
           for a in arrays]
  out = jax.lax.map(lambda xs: fn(*xs), tuple(split))
  return out.reshape(chunks * per, *out.shape[2:])[:n]


# ---------------------------------------------------------------------------------- evaluation

def evaluate(policy: Policy, params: Any, examples: Sequence[Prompt], reward_fn, *,
             batch_size: int, max_new_tokens: int, key: jax.Array | None = None,
             num_samples: int = 1, temperature: float | None = None, noise: Any = None,
             prompt_length: int | None = None, progress: str | None = None,
             reward_timeout_s: float | None = None) -> dict:
  """Accuracy on ``examples``: pass@1 greedy (``num_samples=1``) or pass@k sampled.

  Greedy decoding (temperature 0) is used when ``num_samples == 1``; otherwise
  ``num_samples`` completions per prompt are sampled with ``key`` (at ``temperature``, default
  the policy's) and a prompt counts as solved when any of them is correct (pass@k with n = k
  samples, Chen et al. 2021). Correct means reward > 0 under ``reward_fn`` (the task's answer
  check). ``params=None`` evaluates the base model (LoRA off). The last batch is padded by
  repeating its last prompt, so every call compiles one shape. ``progress``: a label for a tqdm
  bar over the batches (on stderr); None shows none. ``reward_timeout_s``: as :func:`score`'s ``timeout_s``.
  A sample whose reward is missing (the reward function failed on it) counts as not correct, and is
  counted in ``missing_rewards``.

  Returns:
    ``{"accuracy": pass@k in [0, 1], "sample_accuracy": mean correctness over all samples,
    "mean_length": tokens, "num_prompts": int, "missing_rewards": int (samples), "completions": [str]
    (the first sample of each prompt), "correct": [bool] per prompt}``.

  Raises:
    ValueError: no examples, or ``batch_size``, ``num_samples`` or ``max_new_tokens`` below 1.
  """
  if not examples:
    raise ValueError("evaluate: no examples")
  bad = [f"{k}={v}" for k, v in (("batch_size", batch_size), ("num_samples", num_samples),
                                 ("max_new_tokens", max_new_tokens)) if int(v) < 1]
  if bad:
    raise ValueError(f"evaluate: {', '.join(bad)} must be >= 1")
  missing = 0
  greedy = num_samples == 1
  correct, sample_ok, lengths, texts = [], [], [], []
  starts = range(0, len(examples), batch_size)
  if progress:
    from tqdm import tqdm
    starts = tqdm(starts, desc=progress, unit="batch", dynamic_ncols=True, file=sys.stderr)
  for start in starts:
    chunk = list(examples[start:start + batch_size])
    n_real = len(chunk)
    chunk = chunk + [chunk[-1]] * (batch_size - n_real)  # one compiled shape
    pt, pm = _prompt_batch(policy.tokenizer, chunk, prompt_length, policy.pad_id)
    k = jax.random.fold_in(key if key is not None else jax.random.PRNGKey(0), start)
    ro = policy.generate(params, noise, pt, pm, k, num_generations=num_samples, greedy=greedy,
                         max_new_tokens=max_new_tokens, temperature=temperature)
    lens = np.asarray(ro.lengths)
    comps = _decode(policy.tokenizer, ro)[:n_real * num_samples]
    answers = [e.answer for e in chunk[:n_real] for _ in range(num_samples)]
    rewards, n_missing = score(reward_fn, comps, answers, timeout_s=reward_timeout_s)
    missing += n_missing
    ok = np.nan_to_num(rewards, nan=0.0).reshape(n_real, num_samples) > 0
    correct.extend(ok.any(axis=1).tolist())
    sample_ok.extend(ok.reshape(-1).tolist())
    lengths.extend(lens[:n_real * num_samples].tolist())
    texts.extend(comps[::num_samples])
  return {"accuracy": float(np.mean(correct)), "sample_accuracy": float(np.mean(sample_ok)),
          "mean_length": float(np.mean(lengths)),
          "num_prompts": len(examples), "missing_rewards": missing, "completions": texts, "correct": correct}


# ---------------------------------------------------------------------------------- the loop

def _state_to_save(state, step: int, seed: int) -> dict:
  """What a checkpoint holds: the train state (LoRA + norms, optax state, counters), step, key."""
  return {"train_state": state, "step": jnp.asarray(step, jnp.int32),
          "key": jax.random.PRNGKey(int(seed))}


def _scalar_metrics(m: dict) -> dict:
  """The scalar entries of a metrics dict as Python floats (arrays of other shapes dropped)."""
  out = {}
  for k, v in jax.device_get(m).items():
    a = np.asarray(v)
    if a.size == 1 and (np.issubdtype(a.dtype, np.number) or a.dtype == bool):
      out[k] = float(a)
  return out


def train(config: ml_collections.ConfigDict, workdir: str, *, policy: Policy | None = None,
          datasets: tuple[Sequence[Prompt], Sequence[Prompt]] | None = None,
          reward_fns: tuple[Callable, Callable | None] | None = None, stop_after: int | None = None,
          progress: bool = True) -> dict:
  """Runs (or resumes) the training loop of ``config`` in ``workdir``; returns the summary.

  Args:
    config: a validated config (``qerl_jax.train_config`` layout).
    workdir: run folder: ``checkpoints/``, ``metrics.jsonl``, ``samples.jsonl``,
      ``tensorboard/``, ``config.json``, ``summary.json``, ``plots/``. When it holds a
      checkpoint, training resumes from the newest complete one.
    policy, datasets, reward_fns: injected components (tests); default: built from ``config``
      by :func:`load_policy`, :func:`load_datasets`, :func:`make_reward_fns`. Injected reward
      functions run under :data:`REWARD_TIMEOUT_S` a batch.
    stop_after: stop after this many steps of this call (the run stays resumable).
    progress: show a tqdm bar.

  Returns:
    A summary dict: ``status`` (``"ok"``, ``"non-finite"`` or ``"rewards-missing"``, from the last
    step: :func:`summarize`), ``steps``, ``skipped_updates``, ``missing_rewards``, ``final_accuracy``,
    ``initial_accuracy``, ``best_accuracy``, ``final_reward``, ``mean_entropy_first_quarter``,
    ``mean_step_time_s``, ``wall_time_s``, ``workdir``.

  Raises:
    RunSetupError (a ValueError) before the first step, naming the problem: a workdir that is a file,
      is not writable, or holds a ``config.json`` that no training run wrote (a model folder); a
      checkpoint this config cannot resume (other LoRA shapes); the model or the data failing to load
      (:func:`load_policy`, :func:`load_prompts`: a missing file or tensor, a bad spec, no usable row); fewer
      training prompts than one step's batch (``data.DataOrder``). A reward function that fails or
      hangs does not raise: its completions count as missing rewards (:func:`score`).
  """
  # Whatever raises (a setup error, an out-of-memory in the step-0 evaluation or in a step) still releases the
  # workdir's lock, waits for a checkpoint save in flight and closes the metrics files; the exception then goes
  # on. (A lock kept open by a failed call refused the retry in the same process, a notebook's, as another run.)
  with contextlib.ExitStack() as closing:
    return _train(config, workdir, closing, policy=policy, datasets=datasets, reward_fns=reward_fns,
                  stop_after=stop_after, progress=progress)


def _train(config, workdir, closing: contextlib.ExitStack, *, policy, datasets, reward_fns, stop_after,
           progress) -> dict:
  """:func:`train`'s body; what it opens is closed through ``closing``."""
  t_start = time.perf_counter()
  seed, total = int(config.seed), int(config.train.total_steps)
  G = int(config.rl.num_generations)
  prompts_per_step = int(config.rl.batch_size) // G
  try:  # everything that can refuse the run, before its first step: one clear RunSetupError
    _check_workdir(workdir, config)  # this, and the data where the tokenizer loads alone, before the model
    lock = _lock_workdir(workdir)  # loads (minutes at 7B)
    if lock is not None:
      closing.callback(lock.close)
    if datasets is None and policy is None:
      datasets = _datasets_before_the_model(config)
    order = None if datasets is None else _data_order(config, len(datasets[0]))
    policy = policy or load_policy(config)
    # The ratio's old log-probs. The sampler's by default. With AQN in the rollout only (QeRL's variant), the
    # sampler's are a noisy policy's and the update's policy is noiseless, so, as QeRL's TRL loop does, the old
    # policy is the update's own: its detached log-probs (ratio exactly 1) with one update a rollout, a
    # recomputing forward with several. TRL's correction of the sampler's mismatch (rl.rollout_correction) needs
    # the training forward's log-probs too, so it implies the recompute (validate refuses it with rollout-only AQN).
    rollout_only_aqn = bool(config.aqn.enabled) and bool(config.aqn.get("rollout_only", False))
    correction = str(config.rl.get("rollout_correction", "none"))
    if correction != "none" and rollout_only_aqn:
      raise ValueError(f"rl.rollout_correction={correction!r} cannot be used with aqn.rollout_only=True "
                       "(train_config.validate says why)")
    recompute_old = (bool(config.rl.get("recompute_old_logprobs", False)) or correction != "none"
                     or (rollout_only_aqn and int(config.rl.num_iterations) > 1))
    detach_old = rollout_only_aqn and not recompute_old
    if recompute_old and policy.old_logprobs is None:
      raise ValueError("rl.recompute_old_logprobs=True (or rl.rollout_correction other than 'none', or "
                       "aqn.rollout_only with rl.num_iterations > 1) needs a policy with old_logprobs (load_policy's "
                       "has it; the given policy has none)")
    train_set, eval_set = datasets or load_datasets(config, policy.tokenizer)
    order = order or _data_order(config, len(train_set))
  except (ValueError, OSError, KeyError) as e:  # KeyError: a tensor the checkpoint lacks (hf.load_pretrained)
    raise RunSetupError(e.args[0] if isinstance(e, KeyError) and e.args else str(e)) from e
  correctness_fn, bonus_fn = reward_fns or make_reward_fns(config)
  reward_timeout = None if reward_fns is None else REWARD_TIMEOUT_S  # the library's rewards bound their own time
  eval_max_new = int(config.train.eval_max_completion_length or config.sampling.max_completion_length)
  max_new = int(config.sampling.max_completion_length)
  dynamic = bool(config.rl.get("dynamic_sampling", False))
  max_rounds = int(config.rl.get("max_sampling_rounds", 1)) if dynamic else 1
  oversample = int(config.rl.get("oversample_factor", 1)) if dynamic else 1  # batches of prompts a rollout
  overlong_buffer = int(config.rl.get("overlong_buffer_length", 0))

  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                       keep=int(config.train.keep_checkpoints),
                                       async_save=bool(config.train.async_checkpointing))
  closing.callback(checkpointer.close)
  prompt_length = int(config.data.max_prompt_length)
  state = policy.init_state(jax.random.fold_in(jax.random.PRNGKey(seed), _LORA_STREAM))
  start, position = 0, 0  # steps done; batches of prompts served (the data position)
  latest = checkpointer.latest_step()
  if latest is not None:
    try:
      saved, meta = checkpointer.restore(latest, _state_to_save(state, 0, seed))
    except Exception as e:  # orbax: shapes or structure that differ from this config's state, or damaged files
      detail = " ".join(str(e).split())[:160]
      raise RunSetupError(
          f"cannot resume from the checkpoint at step {latest} in {checkpointer.directory}: its saved state does "
          f"not fit this config's, or its files are damaged ({type(e).__name__}: {detail}). Resume with the config "
          "of the run that wrote it (its config.json), delete that step's folder to resume from the one before, "
          "or give a new --workdir.") from e
    state = saved["train_state"]
    start, position = int(meta["step"]), int(meta["data_position"])
    saved_config = meta.get("config", {})
    diff = _config_diff(saved_config, json.loads(config.to_json_best_effort()))
    if diff and start < total:  # (with nothing to train, a changed config changes nothing)
      shown = ", ".join(f"{key}: {a!r} -> {b!r}" for key, a, b in diff)
      # the flags on a line of their own: a sentence's full stop after the last one went with it when copied
      # (--config.train.total_steps=6. is refused; a string key's value silently gained the ".")
      print(f"warning: resuming with a config that differs from the checkpoint's ({shown}); the run will not "
            f"match an uninterrupted one.{_schedule_change_note(diff, config, int(state.num_updates), start)} "
            f"To continue it unchanged, pass the checkpoint's values:\n  {_override_flags(diff, saved_config)}",
            file=sys.stderr)
    print(f"resuming from the checkpoint at step {start} in {checkpointer.directory}", file=sys.stderr)
  if start >= total and latest is not None:  # config.json and summary.json keep the run that trained those steps
    # other keys changed on the command line change nothing here: say so, rather than let them look applied
    unused = [(key, a, b) for key, a, b in diff if key != "train.total_steps"]
    note = ("" if not unused else "; the config differs from the checkpoint's ("
            + ", ".join(f"{key}: {a!r} -> {b!r}" for key, a, b in unused)
            + "), which changes nothing here: give a new --workdir to train with it")
    print((f"warning: the checkpoint is at step {start}, past train.total_steps={total}: nothing to train"
           if start > total else f"the run is complete (step {start} of train.total_steps={total}): nothing to "
           "train; raise --config.train.total_steps to continue it") + note, file=sys.stderr)
    return _finished_summary(workdir, start, t_start)
  logger = metrics_lib.MetricsLogger(workdir, resume_step=start if start > 0 else None)
  closing.callback(logger.close)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2, sort_keys=True))

  def run_eval(step: int) -> float:
    ev = evaluate(policy, state.params, eval_set, correctness_fn,
                  batch_size=int(config.train.eval_batch_size), max_new_tokens=eval_max_new,
                  prompt_length=prompt_length, reward_timeout_s=reward_timeout)
    logger.write(step, {"eval/accuracy": ev["accuracy"], "eval/mean_length": ev["mean_length"],
                        "eval/missing_rewards": ev["missing_rewards"]})
    return ev["accuracy"]

  if start == 0 and eval_set:
    run_eval(0)

  bar = None
  if progress:
    from tqdm import tqdm
    bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True,
               file=sys.stderr)
    closing.callback(bar.close)
  last_acc = None
  end = total if stop_after is None else min(total, start + int(stop_after))
  for step in range(start, end):
    t0 = time.perf_counter()
    keys = step_keys(seed, step)
    # 1-4. the step's prompts (from the seeded order of the training set), its AQN noise, G
    #      completions per prompt, their rewards; with dynamic sampling (DAPO) again on the next
    #      prompts until enough groups carry signal
    epoch = position // order.batches_per_epoch
    noise = policy.noise(step)
    rounds, t_rollout, t_reward = [], time.perf_counter() - t0, 0.0
    for rnd in range(max_rounds):
      tr = time.perf_counter()
      batch = [train_set[i] for j in range(oversample) for i in order.batch_indices(position + j)]
      position += oversample
      prompt_tokens, prompt_mask = _prompt_batch(policy.tokenizer, batch, prompt_length, policy.pad_id)
      rollout = policy.generate(state.params, noise, prompt_tokens, prompt_mask,
                                keys.sample if rnd == 0 else jax.random.fold_in(keys.sample, rnd),
                                num_generations=G, greedy=False, max_new_tokens=max_new)
      completions = _decode(policy.tokenizer, rollout)
      t_rollout += time.perf_counter() - tr
      tr = time.perf_counter()
      # rewards on the host: one float each, failures missing (NaN); the answer check runs once and
      # the training reward adds the optional bonus (format) and DAPO's overlong penalty to it
      answers = [p.answer for p in batch for _ in range(G)]
      correct, _ = score(correctness_fn, completions, answers, timeout_s=reward_timeout)
      rewards = (correct if bonus_fn is None
                 else correct + score(bonus_fn, completions, answers, timeout_s=reward_timeout)[0])
      if overlong_buffer:
        rewards = rewards + np.asarray(grpo.overlong_penalty(
            np.asarray(rollout.lengths), max_new, overlong_buffer, float(config.rl.overlong_penalty_factor)))
      rounds.append(_Round(batch, prompt_tokens, prompt_mask, rollout, completions, answers, correct,
                           np.asarray(rewards, np.float32)))
      t_reward += time.perf_counter() - tr
      if not dynamic or sum(int(r.informative.sum()) for r in rounds) >= prompts_per_step:
        break
    t1 = t0 + t_rollout
    # 5. the update's groups (all of them without dynamic sampling) and their group-normalised
    #    advantages (NaN rewards -> advantage 0)
    rows, taken, informative = _select_groups(rounds, prompts_per_step, G, dynamic=dynamic)
    if dynamic:
      prompt_tokens = np.concatenate([rounds[ri].prompt_tokens[gi:gi + 1] for ri, gi in taken])
      prompt_mask = np.concatenate([rounds[ri].prompt_mask[gi:gi + 1] for ri, gi in taken])
      rollout = types.SimpleNamespace(**{f: _take_rows(rounds, rows, G, f)
                                         for f in ("tokens", "mask", "policy_logprobs", "truncated")})
      rewards = np.concatenate([rounds[ri].rewards[r0:r0 + G] for ri, r0 in rows])
    advantages = grpo.group_advantages(jnp.asarray(rewards), G, scale_rewards=str(config.rl.scale_rewards))
    t2 = t1 + t_reward
    # 6. reference log-probs (LoRA off) when beta > 0
    update_batch = _update_batch(prompt_tokens, prompt_mask, rollout, advantages)
    if dynamic and informative < prompts_per_step:
      # the groups that only fill the batch's shape (taken last) leave the loss: masked out, they no longer add
      # their tokens to dapo's (and a micro-batch's bnpo) normaliser, so that update is the one of the groups
      # with signal alone, as DAPO's batch of filtered groups (grpo and dr_grpo still divide by all B rows)
      kept_rows = np.repeat(np.arange(prompts_per_step) < informative, G)[:, None]
      update_batch["completion_mask"] = update_batch["completion_mask"] * jnp.asarray(
          kept_rows, update_batch["completion_mask"].dtype)
    update_noise = policy.update_noise(noise)
    t_ref, old_metrics = None, {}
    if recompute_old:  # the ratio's old log-probs from the training forward instead of the sampler's
      sampler_logprobs = update_batch["old_logprobs"]
      update_batch["old_logprobs"], old_metrics = _recomputed_old_logprobs(policy, state.params, update_batch,
                                                                          update_noise)
      if correction != "none":  # each token's loss weighted by the trainer's over the sampler's probability
        update_batch["rollout_is_weights"], is_metrics = _rollout_correction(config, update_batch, sampler_logprobs)
        old_metrics.update(is_metrics)
    elif detach_old:  # the update then takes stop_gradient of its own log-probs: the ratio is exactly 1
      del update_batch["old_logprobs"]
    if float(config.rl.beta) > 0:
      tf = time.perf_counter()
      update_batch["ref_logprobs"] = jax.block_until_ready(policy.ref_logprobs(update_batch, update_noise))
      t_ref = time.perf_counter() - tf
    # 7. num_iterations optimizer updates over micro-batches
    for it in range(int(config.rl.num_iterations)):
      state, update_metrics = policy.update(state, update_batch, update_noise, step,
                                            jax.random.fold_in(keys.update, it))
    # the update is dispatched asynchronously: wait for it, or its time lands in the next step's rollout
    jax.block_until_ready((state, update_metrics))
    t3 = time.perf_counter()
    # 8. log, checkpoint, evaluate
    done = step + 1
    # the step's reward, accuracy and completion metrics cover every completion sampled
    sampled_rewards = np.concatenate([r.rewards for r in rounds])
    sampled_correct = np.concatenate([r.correct for r in rounds])
    row = {**_scalar_metrics(update_metrics), **old_metrics,
           **_scalar_metrics(grpo.reward_metrics(jnp.asarray(sampled_rewards), G)),
           **_scalar_metrics(grpo.completion_metrics(
               jnp.concatenate([jnp.asarray(r.rollout.mask) for r in rounds]),
               jnp.concatenate([jnp.asarray(r.rollout.truncated) for r in rounds]))),
           "reward/missing": int(np.isnan(sampled_rewards).sum()),
           "accuracy": float(np.mean(np.nan_to_num(sampled_correct) > 0)),
           "aqn/sigma": float(policy.sigma(step)), "data/epoch": epoch, "data/position": position,
           "time/rollout_s": t1 - t0, "time/reward_s": t2 - t1, "time/update_s": t3 - t2,
           "time/step_s": t3 - t0,
           "perf/tokens_per_s": sum(float(np.asarray(r.rollout.lengths).sum()) for r in rounds)
                                / max(t1 - t0, 1e-9)}
    if t_ref is not None:
      row["time/reference_s"] = t_ref  # the part of time/update_s that the KL's reference pass took
    if dynamic:
      row.update({"dynamic_sampling/rounds": len(rounds), "dynamic_sampling/informative_groups": informative,
                  "dynamic_sampling/filled_groups": prompts_per_step - informative})
    mem = metrics_lib.peak_device_memory_bytes()
    if mem is not None:
      row["perf/peak_memory_bytes"] = mem
    logger.write(done, row)
    every = int(config.train.log_samples_every)
    if every and done % every == 0:
      first = rounds[0]  # the step's first rollout
      n = min(int(config.train.num_samples_logged), len(first.completions))
      prompts_text = [first.prompts[i // G].text for i in range(n)]
      logger.write_samples(done, prompts_text, first.completions[:n], first.rewards[:n].tolist(),
                           first.answers[:n])
    if (int(config.train.eval_every) and done % int(config.train.eval_every) == 0
        or done == total) and eval_set:
      last_acc = run_eval(done)
    if done % int(config.train.save_every) == 0 or done == total:
      checkpointer.save(done, _state_to_save(state, done, seed),
                        {"step": done, "epoch": epoch, "data_position": position, "seed": seed,
                         "config": json.loads(config.to_json_best_effort())})
      logger.flush()
    if bar is not None:
      bar.update(1)
      post = {"reward": f"{row['reward']:.3f}", "tok/s": f"{row['perf/tokens_per_s']:.0f}"}
      if last_acc is not None:
        post["acc"] = f"{last_acc:.3f}"
      for key, label in (("skipped_updates", "skipped"), ("reward/missing", "no reward")):
        if row.get(key):  # only when something went wrong: updates skipped so far, rewards missing this step
          post[label] = f"{row[key]:.0f}"
      bar.set_postfix(post)
  closing.close()  # the save in flight, the metrics files and the lock, before the summary reads the metrics
  return _write_summary(workdir, total, t_start, resumed=start > 0)


def _write_summary(workdir: str, total: int, t_start: float, *, resumed: bool) -> dict:
  """Summarizes the run's ``total`` steps (:func:`summarize`) into ``<workdir>/summary.json``, with the wall time
  since ``t_start`` (``time.perf_counter``) added to the earlier invocations' when ``resumed``; warns when updates
  were skipped or rewards are missing. Returns the summary."""
  summary = summarize(workdir, total)
  summary["wall_time_s"] = time.perf_counter() - t_start
  prev_path = os.path.join(workdir, "summary.json")
  if resumed and os.path.exists(prev_path):  # a resumed run adds its time to the earlier invocations'
    try:
      with open(prev_path) as f:
        summary["wall_time_s"] += float(json.load(f).get("wall_time_s", 0.0))
    except (OSError, ValueError, TypeError, AttributeError):
      pass
  problems = [f"{summary[k]} {what}" for k, what in (
      ("skipped_updates", "updates were skipped for a NaN or infinite loss, gradient or update"),
      ("missing_rewards", "completions got no reward (the reward function failed on them; see the warnings)"))
      if summary[k]]
  if problems:
    print(f"warning: {'; '.join(problems)}; status {summary['status']!r}", file=sys.stderr)
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2, sort_keys=True)
  return summary


def _finished_summary(workdir: str, steps: int, t_start: float) -> dict:
  """The summary of a run with nothing left to train: its ``summary.json`` as it is (a re-run must not change
  the wall time, or recompute the metrics over another ``total_steps``), or, when the run stopped between its
  last checkpoint and that file (or the file predates ``status``), one made now over the checkpoint's ``steps``."""
  try:
    with open(os.path.join(workdir, "summary.json")) as f:
      summary = json.load(f)
    if isinstance(summary, dict) and summary.get("steps") == steps and "status" in summary:
      # (one written before summaries had a status is made again); summary.json is written with sorted keys,
      # so its rows are put back in a fresh run's order (status first), which run's table prints them in
      rank = {k: i for i, k in enumerate(_SUMMARY_KEYS)}
      return dict(sorted(summary.items(), key=lambda kv: rank.get(kv[0], len(rank))))
  except (OSError, ValueError):
    pass
  return _write_summary(workdir, steps, t_start, resumed=True)


def _schedule_change_note(diff, config, num_updates: int, step: int) -> str:
  """For a resume whose ``train.total_steps`` differs from the checkpoint's (``diff``: :func:`_config_diff`'s
  triples): the learning rate and AQN sigma of the next step under the checkpoint's schedules and under this
  config's, since both schedules are stretched to the new length ("" when ``train.total_steps`` is unchanged).

  The checkpoint's schedules are its saved ``optim.*``, ``aqn.*`` and ``rl.num_iterations`` values (the diff's
  old ones, where they differ). Where AQN was off in its run or is off now, the note says so (no noise was, or
  will be, applied) instead of giving that schedule's sigma."""
  from qerl_jax import aqn, update
  old_total = next((a for key, a, _ in diff if key == "train.total_steps"), None)
  if not isinstance(old_total, int) or old_total < 1:
    return ""
  old = config.copy_and_resolve_references()
  with old.unlocked():
    old.train.total_steps = old_total
    for key, saved, _ in diff:  # the checkpoint's own schedule settings
      section, _, name = key.partition(".")
      if (saved is not None and "." not in name and (section in ("optim", "aqn") or key == "rl.num_iterations")
          and name in old[section]):
        old[section][name] = saved
  lr_old, lr_new = (float(update.make_lr_schedule(update_config(c))(jnp.asarray(num_updates, jnp.int32)))
                    for c in (old, config))
  on_old, on_new = bool(old.aqn.enabled), bool(config.aqn.enabled)
  schedules = ("learning-rate and AQN schedules, which now stretch" if on_old or on_new
               else "learning-rate schedule, which now stretches")
  note = (f" train.total_steps sets the {schedules} to {int(config.train.total_steps)} steps: from step "
          f"{step + 1} the learning rate is {lr_new:.3g} (was {lr_old:.3g})")
  s_old, s_new = (aqn.schedule_sigma(_aqn_config(c), step) for c in (old, config))
  if on_old and on_new:
    note += f" and the AQN sigma {s_new:.3g} (was {s_old:.3g})"
  elif on_new:  # the checkpoint's run drew no noise: its schedule's sigma was never applied
    note += f"; AQN was off (no noise) and is now on, at sigma {s_new:.3g}"
  elif on_old:
    note += f"; AQN is now off (no noise; it was at sigma {s_old:.3g})"
  return note + "."


def _aqn_config(config: ml_collections.ConfigDict):
  """The :class:`qerl_jax.aqn.AQNConfig` of a trainer config (``kind="off"`` when ``aqn.enabled`` is False)."""
  from qerl_jax import aqn
  return aqn.AQNConfig(kind=str(config.aqn.schedule) if bool(config.aqn.enabled) else "off",
                       sigma_start=float(config.aqn.sigma_start), sigma_end=float(config.aqn.sigma_end),
                       num_stages=int(config.aqn.num_stages), total_steps=int(config.train.total_steps),
                       noise_in_update=not bool(config.aqn.rollout_only))


class RunSetupError(ValueError):
  """The run cannot start: a workdir that cannot hold it, a model or data that cannot load, too few prompts
  for one step, or a checkpoint that this config cannot resume. Raised by :func:`train` before its first
  step (the message says what and where; the cause is chained); ``experiments/train.py`` prints it as one
  line."""


def _data_order(config, num_prompts: int) -> data_lib.DataOrder:
  """The seeded order of the training set's ``num_prompts`` prompts, ``rl.batch_size / rl.num_generations`` a
  step. Raises ValueError (naming the keys) when the set holds fewer prompts than one step takes."""
  per_step = int(config.rl.batch_size) // int(config.rl.num_generations)
  if num_prompts < per_step:
    raise ValueError(f"data.train={config.data.train!r} has {num_prompts} usable prompt(s), fewer than one step "
                     f"takes (rl.batch_size / rl.num_generations = {per_step}); prompts longer than "
                     f"data.max_prompt_length={config.data.max_prompt_length} tokens are dropped")
  return data_lib.DataOrder(num_examples=num_prompts, batch_size=per_step, seed=int(config.seed))


def _lock_workdir(workdir: str):
  """An exclusive lock on ``<workdir>/.lock`` for this run (``fcntl.flock``: the OS drops it when the process
  ends, so a killed run leaves none behind). Two runs in one workdir cut each other's metrics and wrote the
  same checkpoints. Returns the open lock file (closing it releases the lock); None where ``fcntl`` is
  missing (not POSIX).

  Raises:
    ValueError: another process holds the lock (it wrote its pid and host into the file).
  """
  try:
    import fcntl
  except ImportError:  # pragma: no cover (not POSIX)
    return None
  f = open(os.path.join(workdir, ".lock"), "a+")
  try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:
    f.seek(0)
    holder = f.read().strip()
    f.close()
    raise ValueError(f"workdir {workdir!r} is in use by another training run ({holder or 'process unknown'}); "
                     "wait for it to end, or give another --workdir") from None
  f.truncate(0)
  f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
  f.flush()
  return f


def _datasets_before_the_model(config) -> tuple[list[Prompt], list[Prompt]] | None:
  """:func:`load_datasets` with the tokenizer of ``model.path`` loaded alone (``hf.load_tokenizer``), so that a
  data set that cannot serve (no usable row, fewer prompts than a step takes) stops the run before the model
  loads; None for a ``random:`` model or a folder without tokenizer files (the model's loading says so)."""
  from qerl_jax import hf
  if str(config.model.path).startswith("random:"):
    return None
  tokenizer = hf.load_tokenizer(str(config.model.path))
  return None if tokenizer is None else load_datasets(config, tokenizer)


# Config keys that decide the trained state's shapes: a checkpoint saved with other values cannot resume.
_STATE_SHAPE_KEYS = ("lora.rank", "lora.target_modules", "lora.train_norms")


def _check_workdir(workdir: str, config) -> None:
  """Refuses a ``workdir`` the run cannot use, before anything loads.

  Raises:
    ValueError: ``workdir`` is a file; it holds a ``config.json`` that is not a trainer config (a Hugging Face
      model folder, say: the run would overwrite it); or its newest checkpoint was saved with other
      :data:`_STATE_SHAPE_KEYS` values than ``config``'s (named).
    PermissionError: ``workdir`` cannot be created or written.
  """
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ValueError(f"workdir {workdir!r} is a file, not a folder")
  os.makedirs(workdir, exist_ok=True)
  if not os.access(workdir, os.W_OK | os.X_OK):
    raise PermissionError(f"workdir {workdir!r} is not writable (the run writes its checkpoints, metrics and "
                          "config there)")
  cfg_path = os.path.join(workdir, "config.json")
  if os.path.exists(cfg_path):
    try:
      with open(cfg_path) as f:
        saved = json.load(f)
    except (OSError, ValueError):
      saved = None
    if not (isinstance(saved, dict) and {"model", "rl", "train"} <= set(saved)):
      raise ValueError(f"workdir {workdir!r} holds a config.json that is not a training run's (a Hugging Face "
                       "model folder?); the run would overwrite it. Give another --workdir.")
  ckpt_dir = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(ckpt_dir):
    return
  c = ckpt_lib.Checkpointer(ckpt_dir, read_only=True)
  try:
    step = c.latest_step()
    meta = c.restore_meta(step) if step is not None else {}
  finally:
    c.close()
  diff = [d for d in _config_diff(meta.get("config", {}), json.loads(config.to_json_best_effort()))
          if d[0] in _STATE_SHAPE_KEYS]
  if diff:
    shown = ", ".join(f"{key}={b!r} (the checkpoint has {a!r})" for key, a, b in diff)
    raise ValueError(f"cannot resume from the checkpoint at step {step} in {ckpt_dir}: {shown}; the trained "
                     "state's shapes differ. Pass the checkpoint's values, or give a new --workdir.")


# Keys added to the config after runs were saved, with the value that reproduces those runs.
_LEGACY_VALUES = {"model.fuse_projections": False,
                  "model.code_order": "standard",
                  "model.attn_chunk": 0,
                  "model.attn_impl": "xla",
                  "rl.dynamic_sampling": False,
                  "rl.recompute_old_logprobs": False,
                  "rl.importance_sampling_level": "token",
                  "rl.delta": 0.0,
                  "rl.top_entropy_quantile": 1.0,
                  "rl.sapo_temperature_pos": 1.0,
                  "rl.sapo_temperature_neg": 1.05,
                  "rl.rollout_correction": "none",
                  "rl.rollout_correction_clip_max": 3.0,
                  "rl.rollout_correction_clip_min": 0.0,
                  "rl.format_reward_kind": "any",
                  "rl.max_sampling_rounds": 4,
                  "rl.oversample_factor": 1,
                  "rl.overlong_buffer_length": 0,
                  "rl.overlong_penalty_factor": 1.0,
                  "data.user_template": "{question}",
                  "sampling.dequantize_min_rows": 0,
                  "sampling.dequantize_max_weights": 0}


# Keys a config file may set to None (the command line cannot), with the value None means there, from the config
# dict (JSON form) that holds it: a config with None and one with that value train alike.
_NONE_MEANS = {"rl.epsilon_high": lambda c: c["rl"]["epsilon"],  # grpo: no clip-higher, epsilon on both sides
               "rl.rollout_correction_clip_min": lambda c: 0.0,  # no lower bound, as 0
               "rl.delta": lambda c: 0.0,  # no cap, as 0
               "data.eval": lambda c: "",  # no evaluation set, as ""
               "data.system_prompt": lambda c: ""}  # no system message, as ""


def _none_means(key: str, config: dict):
  """The value ``key``'s None stands for in ``config`` (a config dict, JSON form; :data:`_NONE_MEANS`), or None
  when it has none."""
  try:
    return _NONE_MEANS[key](config) if key in _NONE_MEANS else None
  except (KeyError, TypeError):
    return None


def _config_diff(old: dict, new: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
  """``(dotted key, old value, new value)`` for each key whose value differs between two config
  dicts (JSON form); a key the old config predates counts as its :data:`_LEGACY_VALUES` entry, a None
  counts as the value it means in its own config (:data:`_NONE_MEANS`: ``rl.rollout_correction_clip_min`` None
  and 0.0 do not differ), and ``lora.target_modules`` as a set (the same modules in another order build the same
  adapter)."""
  out = []
  for k in sorted(set(old) | set(new)):
    a, b = old.get(k, _LEGACY_VALUES.get(f"{prefix}{k}")), new.get(k)
    if isinstance(a, dict) and isinstance(b, dict):
      out += _config_diff(a, b, f"{prefix}{k}.")
    elif a != b:
      out.append((f"{prefix}{k}", a, b))
  if not prefix:  # the whole configs: a None against the value it means, or the same modules reordered, is none
    out = [(key, a, b) for key, a, b in out
           if not (a is None and b is not None and _none_means(key, old) == b
                   or b is None and a is not None and _none_means(key, new) == a
                   or key == "lora.target_modules" and _same_modules(a, b))]
  return out


def _same_modules(a, b) -> bool:
  """Whether two ``lora.target_modules`` values name the same modules: ``lora.LoRAConfig`` keeps them in its own
  order, once each, so their order and repeats build no other adapter."""
  return isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and set(a) == set(b)


def _override_flags(diff: Sequence[tuple[str, Any, Any]], saved: dict | None = None) -> str:
  """The ``--config.<key>=<value>`` flags that restore each differing key's saved (first) value, for a warning:
  a default changed since the checkpoint was written (a key it predates reads as its :data:`_LEGACY_VALUES`
  entry) needs one as much as an override the first run passed.

  The command line cannot set a None (a float key refuses "None", a string key takes it as the text "None") nor
  override a key that is None in the config file (ml_collections refuses a None-typed field). So a saved None
  becomes the value it means (:data:`_NONE_MEANS`, from ``saved``, the checkpoint's config dict), and a key with
  no such value, or None in this run's config (the diff's new value), is named as an edit of the config file."""
  def flag(key, value):
    if isinstance(value, (list, tuple)):
      value = repr(tuple(value))
    elif not isinstance(value, str):
      value = repr(value)
    return shlex.quote(f"--config.{key}={value}")
  flags, in_file = [], []
  for key, a, b in diff:
    value = _none_means(key, saved or {}) if a is None else a
    if value is None or b is None:
      in_file.append(f"{key} = {a!r}")
    else:
      flags.append(flag(key, value))
  out = " ".join(flags)
  if in_file:
    out += (" and, " if out else "") + ("in the config file (the command line cannot set None, nor override a key "
                                        "that is None there): " + ", ".join(in_file))
  return out


def checkpoint_config_mismatch(meta: dict, config) -> list[tuple[str, Any, Any]]:
  """``(key, saved value, current value)`` for each config key that builds the frozen base
  (``model.*`` but ``model.remat``, ``model.code_order``, ``model.attn_chunk`` and ``model.attn_impl``, which change
  no value) and differs
  between a checkpoint's saved config
  (``meta["config"]``) and ``config``. An adapter restored onto a different base does not
  reproduce its run, e.g. a run saved before ``model.fuse_projections`` existed (unfused)
  evaluated with the fused default. Keys the saved config predates count as
  :data:`_LEGACY_VALUES`."""
  saved = meta.get("config") or {}
  if not saved:
    return []
  return [d for d in _config_diff(saved, json.loads(config.to_json_best_effort()))
          if d[0].startswith("model.") and d[0] not in ("model.remat", "model.code_order", "model.attn_chunk",
                                                        "model.attn_impl")]


def _finite(x) -> bool:
  return x is not None and math.isfinite(float(x))


def _decode(tokenizer, rollout) -> list[str]:
  """Completion texts of a rollout (each row up to its length, special tokens dropped)."""
  tokens, lengths = np.asarray(rollout.tokens), np.asarray(rollout.lengths)
  return [tokenizer.decode(tokens[i, :lengths[i]], skip_special_tokens=True)
          for i in range(tokens.shape[0])]


def _run_status(last: dict) -> str:
  """``"ok"``, or what went wrong at a run's last step (``last``: its metrics row): ``"non-finite"`` (its
  update was skipped for a NaN or infinite loss, gradient or update, or its reward was not finite) or
  ``"rewards-missing"`` (the reward function gave none of its completions a reward)."""
  if last.get("update_skipped") == 1.0 or ("reward" in last and not _finite(last["reward"])):
    return "non-finite"
  if last.get("frac_reward_nonfinite") == 1.0:
    return "rewards-missing"
  return "ok"


# the keys of a run's summary in the order train returns (and run prints) them: summarize's, then the wall time
_SUMMARY_KEYS = ("workdir", "status", "steps", "skipped_updates", "missing_rewards", "initial_accuracy",
                "final_accuracy", "best_accuracy", "final_reward", "mean_entropy_first_quarter", "mean_step_time_s",
                "wall_time_s")


def summarize(workdir: str, total_steps: int) -> dict:
  """Summary of a run from its metrics.jsonl (used at the end of :func:`train`).

  ``status`` is :func:`_run_status` of the last step; ``skipped_updates`` counts the updates the update step
  skipped for non-finite values (``update.make_update_step``), ``missing_rewards`` the completions without
  a reward, over the whole run; ``mean_entropy_first_quarter`` averages the entropy of the first quarter's steps
  whose loss counted a token (``num_tokens`` > 0; None when none did); ``workdir`` is the absolute path.

  Raises:
    FileNotFoundError: ``workdir`` has no metrics.jsonl.
  """
  rows = metrics_lib.read_metrics(workdir)
  train_rows = [r for r in rows if "reward" in r]
  evals = [(r["step"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None]
  quarter = max(1, total_steps // 4)
  # a step whose loss counted no token (every completion truncated and masked, or only filler groups) logs entropy 0
  # as a placeholder, not a measurement: averaged in, it read as a policy collapsing to certainty
  ent = [r["entropy"] for r in train_rows
         if r["step"] <= quarter and r.get("entropy") is not None and r.get("num_tokens") != 0]
  last = train_rows[-1] if train_rows else {}
  return {
      "workdir": os.path.abspath(workdir),
      "status": _run_status(last),
      "steps": int(last.get("step", 0)),
      "skipped_updates": int(last.get("skipped_updates") or 0),
      "missing_rewards": int(sum(r.get("reward/missing") or 0 for r in train_rows)),
      "initial_accuracy": evals[0][1] if evals and evals[0][0] == 0 else None,
      "final_accuracy": evals[-1][1] if evals else None,
      "best_accuracy": max(a for _, a in evals) if evals else None,
      "final_reward": last.get("reward"),
      "mean_entropy_first_quarter": float(np.mean(ent)) if ent else None,
      "mean_step_time_s": float(np.mean([r["time/step_s"] for r in train_rows])) if train_rows else None,
  }


def restore_train_state(config, policy: Policy, workdir: str, *, step: int | None = None):
  """The train state and metadata of a run's checkpoint (newest when ``step`` is None).

  Raises:
    FileNotFoundError: the workdir has no complete checkpoint.
  """
  # read-only: a run that is training (and saving) in this workdir keeps its save in progress
  c = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
  try:
    fresh = policy.init_state(jax.random.PRNGKey(0))
    saved, meta = c.restore(step, _state_to_save(fresh, 0, int(config.seed)))
  finally:
    c.close()
  return saved["train_state"], meta


def run(config: ml_collections.ConfigDict, workdir: str, **kwargs) -> dict:
  """Validates ``config``, trains (or resumes) in ``workdir``, prints a summary table, plots.

  The in-process entry point (``experiments/ablate.py`` calls it per variant).

  Returns:
    The summary dict of :func:`train`.

  Raises:
    ValueError: an impossible config (before any compute).
  """
  train_config.validate(config, check_paths=kwargs.get("policy") is None)
  summary = train(config, workdir, **kwargs)
  print(metrics_lib.format_summary_table(
      [(k, v) for k, v in summary.items() if k != "workdir" and v is not None]))
  if bool(config.train.plot):
    from qerl_jax import plotting
    plotting.plot_runs([workdir], os.path.join(workdir, "plots"))
  return summary


def update_config(config: ml_collections.ConfigDict) -> dict:
  """The ``qerl_jax.update`` options (TRL / Hugging Face names) of a trainer config."""
  rl, o = config.rl, config.optim
  return {
      "loss_type": str(rl.loss_type), "epsilon": float(rl.epsilon),
      "epsilon_high": None if rl.epsilon_high is None else float(rl.epsilon_high),
      "beta": float(rl.beta), "kl_estimator": str(rl.kl_estimator),
      "max_completion_length": int(config.sampling.max_completion_length),
      "mask_truncated_completions": bool(rl.mask_truncated_completions),
      "importance_sampling_level": str(rl.get("importance_sampling_level", "token")),
      "delta": float(rl.delta) if rl.get("delta") else None,  # 0 / None: off
      "top_entropy_quantile": float(rl.get("top_entropy_quantile", 1.0)),
      "sapo_temperature_pos": float(rl.get("sapo_temperature_pos", 1.0)),
      "sapo_temperature_neg": float(rl.get("sapo_temperature_neg", 1.05)),
      "gradient_accumulation_steps": int(rl.batch_size) // int(rl.micro_batch_size),
      "learning_rate": float(o.learning_rate), "adam_beta1": float(o.b1), "adam_beta2": float(o.b2),
      "weight_decay": float(o.weight_decay), "max_grad_norm": float(o.max_grad_norm),
      "lr_scheduler_type": str(o.lr_schedule), "warmup_ratio": float(o.warmup_ratio),
      "max_steps": int(config.train.total_steps) * int(rl.num_iterations),
  }


# ---------------------------------------------------------------------------------- building the job

def load_policy(config: ml_collections.ConfigDict, *, pretrained=None) -> Policy:
  """Loads the frozen base (quantized as ``config.model.quant``) and builds the jitted functions.

  The base is read once from ``config.model.path`` (a Hugging Face folder, or ``random:tiny``
  for a random tiny model: a stand-in until the embedded model exists), or taken from
  ``pretrained`` (an :class:`qerl_jax.hf.Pretrained` already in memory, its base already in
  ``config.model.quant``: ``experiments/bench_train_step.py`` passes random weights at a full model's
  shape; ``model.path`` is then only a label). Either way ``model.fuse_projections`` and
  ``model.code_order`` apply, and the base is passed to every jitted function as an argument,
  never baked in as a constant. LoRA (``config.lora``) is
  initialised as PEFT does (B = 0, so step 0 is the base model), AQN noise
  (``config.aqn``) is drawn per step from ``fold_in(PRNGKey(seed), 0xA0)`` and the step.

  Raises:
    ValueError / FileNotFoundError: from the checkpoint loader (unsupported architecture,
      missing files).
  """
  from qerl_jax import aqn, lora, models as model, update

  model_cfg, base, tokenizer, eos_ids = _load_base(config, pretrained)
  pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
  lora_cfg = lora.LoRAConfig(r=int(config.lora.rank), lora_alpha=float(config.lora.alpha),
                             use_rslora=bool(config.lora.use_rslora),
                             target_modules=tuple(config.lora.target_modules),
                             train_norms=bool(config.lora.train_norms))
  scale = lora.scale(lora_cfg)
  upd_cfg = update_config(config)
  optimizer = update.make_optimizer(upd_cfg)
  remat = bool(config.model.remat)
  attn_chunk = int(config.model.get("attn_chunk", 0)) or None
  attn_impl = str(config.model.get("attn_impl", "auto"))
  ref_rows = int(config.rl.micro_batch_size)

  aqn_on = bool(config.aqn.enabled)
  aqn_cfg = _aqn_config(config)
  aqn_key = jax.random.fold_in(jax.random.PRNGKey(int(config.seed)), _AQN_STREAM)
  norm_shapes = aqn.norm_shapes_of(model_cfg)
  noise_fn = jax.jit(lambda step: aqn.noise(aqn_key, step, norm_shapes, aqn_cfg))

  def noise(step):
    return noise_fn(jnp.asarray(step, jnp.int32)) if aqn_on else None

  def sigma(step):
    return float(aqn.schedule_sigma(aqn_cfg, int(step))) if aqn_on else 0.0

  def init_state(key):
    params = lora.init_lora(key, model_cfg, lora_cfg, base)
    return update.make_train_state(params, optimizer)

  temperature = float(config.sampling.temperature)  # > 0 (validate): the policy trained is the one sampled

  def completion_logprobs(params, base_, noise_, prompt_tokens, prompt_mask, tokens, mask):
    """log p and entropy [N, T] of the completion tokens (float32), prompt + completion forward, with the
    logits divided by the sampling temperature (as TRL; the rollout's policy_logprobs are at it too)."""
    full = jnp.concatenate([prompt_tokens, tokens], axis=1)
    full_mask = jnp.concatenate([prompt_mask, mask], axis=1)
    positions = model.positions_from_mask(full_mask)
    lp, ent = model.token_logprobs(model_cfg, base_, full, positions, lora=params, lora_cfg=scale,
                                   norm_noise=noise_, attn_mask=full_mask, remat=remat,
                                   attn_chunk=attn_chunk, attn_impl=attn_impl, temperature=temperature)
    p = prompt_tokens.shape[1]
    return lp[:, p:], ent[:, p:]

  def logprob_fn(params, mb):
    sh = mb["shared"]
    return completion_logprobs(params, sh["base"], sh.get("noise"), mb["prompt_tokens"],
                               mb["prompt_mask"], mb["completion_tokens"], mb["completion_mask"])

  update_step = update.make_update_step(logprob_fn, upd_cfg, optimizer=optimizer)

  def do_update(state, batch, noise_, step, key):
    shared = {"base": base} if noise_ is None else {"base": base, "noise": noise_}
    return update_step(state, {**batch, "shared": shared}, step, key)

  # the completions' log-probs, rl.micro_batch_size rows at a time (params / noise None: LoRA / AQN off)
  rows_jit = jax.jit(lambda params, base_, noise_, pt, pm, t, m: _in_row_chunks(
      lambda *rows: completion_logprobs(params, base_, noise_, *rows)[0], ref_rows, pt, pm, t, m))

  def old_logprobs(params, batch, noise_):
    return rows_jit(params, base, noise_, batch["prompt_tokens"], batch["prompt_mask"], batch["completion_tokens"],
                    batch["completion_mask"])

  def ref_logprobs(batch, noise_):
    del noise_  # the reference is the base policy: LoRA off, no AQN noise
    return old_logprobs(None, batch, None)

  generate = _make_generate(config, model_cfg, _rollout_base(base, str(config.model.get("code_order", "auto"))),
                            scale, eos_ids, pad_id)
  return Policy(tokenizer=tokenizer, pad_id=int(pad_id), init_state=init_state, noise=noise,
                update_noise=lambda z: None if aqn_cfg.noise_in_update is False else z,
                sigma=sigma, generate=generate, ref_logprobs=ref_logprobs, update=do_update,
                description=f"{config.model.path} ({config.model.quant})", old_logprobs=old_logprobs)


def _load_base(config, pre=None):
  """``(model_cfg, base, tokenizer, eos_ids)`` from ``config.model`` (quantized as configured).

  With ``model.fuse_projections`` (the default) q/k/v and gate/up are concatenated into one
  matrix each (:func:`qerl_jax.models.fuse_projections`); NVFP4 parts are then quantized with
  one global scale per group (``hf.load_pretrained(share_fused_global_scale=True)``); a
  pre-quantized checkpoint is kept as stored and fused only if its groups already share one
  (otherwise it stays unfused, with a warning). The concatenation holds the unfused and fused
  copies of those matrices at once for a moment.
  """
  from qerl_jax import hf
  path = str(config.model.path)
  fuse = bool(config.model.get("fuse_projections", True))
  kwargs = dict(quant=str(config.model.quant), share_fused_global_scale=fuse)
  if pre is None and path.startswith("random:"):
    import shutil
    path = _random_tiny_checkpoint(path.split(":", 1)[1], int(config.seed))
    try:  # everything is in memory once loaded; leave no temp folder behind
      pre = hf.load_pretrained(path, **kwargs)
    finally:
      shutil.rmtree(path, ignore_errors=True)
  elif pre is None:  # else in memory already (load_policy's ``pretrained``)
    pre = hf.load_pretrained(path, **kwargs)
  if fuse:
    pre = pre._replace(base=_fuse_or_keep(pre.base))
  pre = pre._replace(base=_in_code_order(pre.base, str(config.model.get("code_order", "auto"))))
  if pre.tokenizer is None:
    raise ValueError(f"model.path={config.model.path!r} has no tokenizer; the trainer needs one")
  eos = tuple(int(i) for i in pre.generation_config.get("eos_token_ids") or ())
  if not eos:
    eos = (int(pre.tokenizer.eos_token_id),)
  return pre.cfg, pre.base, pre.tokenizer, eos


def _in_code_order(base: dict, order: str) -> dict:
  """``base`` with its NVFP4 codes in ``order`` (``model.code_order``): ``"decode"``
  (:func:`qerl_jax.models.to_decode_order`), ``"standard"`` or ``"rollout"`` (as loaded; for
  ``"rollout"`` the sampler gets a decode-order copy, :func:`_rollout_base`), or ``"auto"``: decode
  order where :func:`pallas_kernels.decode_order_applies` (a GPU running the Gluon decode kernel);
  there a base with any matrix the decode order cannot hold (an odd N) keeps the loaded order throughout,
  with a warning (``"decode"`` raises instead)."""
  import pallas_kernels
  from qerl_jax import models
  if order == "rollout" or pallas_kernels.resolve_code_order(order) == "standard":
    return base
  try:
    return models.to_decode_order(base)
  except ValueError as e:
    if order == "decode":
      raise
    print(f"warning: model.code_order: keeping the standard NVFP4 code order ({e})", file=sys.stderr)
    return base


def _rollout_base(base: dict, order: str) -> dict:
  """The base the sampler reads. With ``model.code_order="rollout"`` on a GPU running the Gluon decode
  kernel (:func:`pallas_kernels.decode_order_applies`), a copy of the NVFP4 codes in decode order
  (the block scales are shared, not copied): rollouts get the faster decode steps, the update step
  keeps reading the standard order in place. Costs half a byte a 4-bit weight (7B: 3.3 GB). Else
  ``base`` itself."""
  return _in_code_order(base, "auto") if order == "rollout" else base


def _fuse_or_keep(base: dict) -> dict:
  """``models.fuse_projections(base)``; ``base`` itself when it is fused already (a ``pretrained``
  base may come so); or ``base`` unchanged with a warning on stderr when its parts cannot be fused
  (a pre-quantized NVFP4 checkpoint whose q/k/v or gate/up global scales differ, mixed formats,
  biases on only some of q/k/v): the model then runs unfused, as before."""
  from qerl_jax import models
  if models.is_fused(base):
    return base
  try:
    return models.fuse_projections(base)
  except ValueError as e:
    print(f"warning: model.fuse_projections: keeping q/k/v and gate/up as separate matrices ({e})",
          file=sys.stderr)
    return base


def _random_tiny_checkpoint(name: str, seed: int) -> str:
  """Writes a random tiny Qwen2 checkpoint + the synthetic task's BPE tokenizer to a temp folder.

  A stand-in for the embedded model while ``assets/`` does not have it: it exercises the whole
  pipeline (load, quantize, sample, score, update) but learns nothing useful.
  """
  import tempfile
  from qerl_jax import hf, models, synthetic

  if name != "tiny":
    raise ValueError(f"model.path='random:{name}': only 'random:tiny' exists")
  folder = tempfile.mkdtemp(prefix="qerl-random-tiny-")
  tok = synthetic.build_tokenizer(synthetic.training_texts(synthetic.make_split("train", 500)))
  tok.save_pretrained(folder)
  vocab = tok.get_vocab()
  hf_cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "vocab_size": len(vocab), "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": True, "eos_token_id": vocab["<|im_end|>"],
            "pad_token_id": vocab["<|endoftext|>"], "torch_dtype": "float32"}
  cfg = models.ModelConfig.from_hf(hf_cfg)
  base = models.init_params(cfg, jax.random.PRNGKey(seed), dtype=jnp.float32)
  hf.save_pretrained(folder, cfg, base)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(hf_cfg, f)
  return folder


def _make_generate(config, model_cfg, base, lora_scale, eos_ids, pad_id):
  """The rollout function of :class:`Policy` over ``sampling.generate`` (one jit per bucket)."""
  from qerl_jax import sampling
  s = config.sampling

  def generate(params, noise, prompt_tokens, prompt_mask, key, *, num_generations, greedy,
               max_new_tokens, temperature=None):
    temp = 0.0 if greedy else float(s.temperature if temperature is None else temperature)
    scfg = sampling.SamplingConfig(
        max_new_tokens=int(max_new_tokens), eos_token_ids=tuple(eos_ids), pad_id=int(pad_id),
        temperature=temp, top_p=float(s.top_p), top_k=int(s.top_k),
        num_generations=int(num_generations), dequantize_min_rows=int(s.get("dequantize_min_rows", 0)),
        dequantize_max_weights=int(s.get("dequantize_max_weights", 0)))
    return sampling.generate(model_cfg, base, jnp.asarray(prompt_tokens), jnp.asarray(prompt_mask),
                             key, scfg, lora=params, lora_cfg=lora_scale, norm_noise=noise)

  return generate


# ---------------------------------------------------------------------------------- data and rewards

def load_prompts(spec: str, task: str, tokenizer, config) -> list[Prompt]:
  """The prompts of a data set, rendered with the chat template and filtered by length.

  Args:
    spec: a JSONL path, a hub id ``hub:<id>[:<config>]:<split>`` (``datasets``), or
      ``synthetic:<split>:<num>[:<seed>]`` (the embedded model's arithmetic task,
      ``qerl_jax.synthetic.make_split``).
    task: ``"gsm8k"`` or ``"math"`` (row fields and gold answers, see ``qerl_jax.data``).
    tokenizer: a transformers tokenizer with a chat template.
    config: the trainer config: ``data.system_prompt`` ("" or None = none), ``data.user_template``,
      ``data.max_prompt_length`` (tokens).

  Malformed rows are skipped and counted by ``data.load_examples``; prompts longer than
  ``data.max_prompt_length`` are dropped; both counts are printed. Never fatal for a bad row.

  Raises:
    FileNotFoundError: a missing local file. ValueError: a bad spec, or no usable row.
  """
  problem = train_config.data_spec_error(spec)
  if problem:
    raise ValueError(f"data spec {spec!r}: {problem}")
  if spec.startswith("synthetic:"):
    rows, skipped = _synthetic_rows(spec), 0
  elif spec.startswith("hub:"):
    parts = spec[4:].split(":")
    rows, report = data_lib.load_examples(parts[0], kind=task, split=parts[-1],
                                          hub_config=parts[1] if len(parts) == 3 else None)
    skipped = report.num_skipped
  else:
    rows, report = data_lib.load_examples(spec, kind=task)
    skipped = report.num_skipped
  system = str(config.data.system_prompt or "") or None  # a config file's None: none either (not the text "None")
  out, too_long = [], 0
  for r in rows:
    text = data_lib.build_prompt(tokenizer, r.question, system_prompt=system,
                                 user_template=str(config.data.user_template))
    if len(tokenizer(text, add_special_tokens=False)["input_ids"]) > int(config.data.max_prompt_length):
      too_long += 1
      continue
    out.append(Prompt(text=text, answer=r.answer))
  if skipped or too_long:
    print(f"data {spec}: skipped {skipped} malformed rows and {too_long} prompts longer than "
          f"{config.data.max_prompt_length} tokens; kept {len(out)}", file=sys.stderr)
  if not out:
    raise ValueError(f"data {spec!r}: no usable rows ({skipped} malformed, {too_long} too long)")
  return out


def _synthetic_rows(spec: str) -> list:
  """``data.Example`` rows of ``synthetic:<split>:<num>[:<seed>]`` (a spec :func:`train_config.data_spec_error`
  passes)."""
  from qerl_jax import synthetic
  parts = spec.split(":")
  seed = int(parts[3]) if len(parts) == 4 else 0
  return [data_lib.Example(question=r["question"], answer=r["gold"], kind="gsm8k", row=i)
          for i, r in enumerate(synthetic.make_split(parts[1], int(parts[2]), seed=seed))]


def load_datasets(config, tokenizer) -> tuple[list[Prompt], list[Prompt]]:
  """``(train, eval)`` prompts of ``config.data`` (eval truncated to ``data.eval_size``).

  Raises:
    FileNotFoundError / ValueError: as :func:`load_prompts` (a missing file, a bad spec, no usable row).
  """
  train_set = load_prompts(str(config.data.train), str(config.data.task), tokenizer, config)
  eval_set = []
  if config.data.eval:
    eval_set = load_prompts(str(config.data.eval), str(config.data.task), tokenizer, config)
    if int(config.data.eval_size):
      eval_set = eval_set[:int(config.data.eval_size)]
  return train_set, eval_set


def make_reward_fns(config, *, task: str | None = None) -> tuple[Callable, Callable | None]:
  """``(correctness, bonus)`` functions ``(completions, answers) -> list[float]``.

  Correctness is the task's answer check (``rewards.gsm8k_reward`` / ``rewards.math_reward``,
  1.0 or 0.0). The training reward is ``correctness + bonus``; the bonus is
  ``rl.format_reward_weight * rewards.format_reward(kind=rl.format_reward_kind)`` (None when the weight is 0),
  so the
  answer check, math-verify's included, runs once per completion.
  """
  from qerl_jax import rewards
  task = task or str(config.data.task)
  correctness = {"gsm8k": rewards.gsm8k_reward, "math": rewards.math_reward}[task]
  w = float(config.rl.format_reward_weight)
  if w == 0:
    return correctness, None

  kind = str(config.rl.get("format_reward_kind", "any"))

  def format_bonus(completions, answers):
    del answers
    # 1.0 for an answer in rl.format_reward_kind's form (any: a '####', <answer> or \boxed answer)
    return [w * f for f in rewards.format_reward(completions, kind=kind)]

  return correctness, format_bonus
