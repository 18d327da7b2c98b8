"""The training job's config schema (an ml_collections ConfigDict) and its validation.

``base_config()`` returns every key the trainer reads, with neutral defaults; each recipe in
``configs/*.py`` starts from it and writes out the values it uses. ``validate(config)`` checks
a config before any compute and raises ``ValueError`` naming every impossible setting at once
(among them any float that is NaN or infinite, wherever it is).

Layout (units in brackets)::

  seed                    int in [0, 2**32), the one seed every random draw derives from (with the step)
  model.path              HF folder or hub id of the base model
  model.quant             "nvfp4" | "nf4" | "none" (bf16 base)
  model.remat             rematerialise each layer in the update step
  model.attn_chunk        [tokens] the training forward (update and reference log-probs) runs attention in
                          query chunks of this many tokens, so its float32 scores are [rows, heads, chunk,
                          prompt + completion] at a time, not [rows, heads, T, T] (7B, 8 rows of 2304
                          tokens: 1.1 GB against 4.8 GB a layer). 0: one piece. Same numbers either way.
  model.attn_impl         the training forward's attention: "auto" (default: "cudnn" on a GPU of compute
                          capability >= 8.0 with a bf16 model of head size 64 or 128, "xla" elsewhere),
                          "xla" (any backend) or
                          "cudnn" (a GPU's fused flash attention through jax.nn.dot_product_attention: the
                          scores never reach memory; attn_chunk then does not apply; an odd prompt +
                          completion length runs padded by one slot, as JAX's cuDNN route cannot
                          differentiate an odd length). Same numbers to rounding; the 7B update step takes
                          half the time with "cudnn" (H100: 16.2 against 33.2 s).
  model.fuse_projections  one matrix for q/k/v and one for gate/up (fewer, larger matmuls: about
                          9% more rollout tokens/s on the H200). The model function is the same;
                          NVFP4 parts of a group share one global scale (vLLM's convention), so
                          those weights round differently than with False (same error level).
                          Loading holds both copies of those matrices for a moment (7B bf16:
                          about 8.5 GB extra).
  model.code_order        "auto" (default) | "standard" | "decode" | "rollout": how NVFP4 codes
                          are stored in memory. "decode" rearranges bits inside 2 x 2-byte blocks
                          for a cheaper E2M1 decode: a 7B decode step 4.6% shorter at batch 8, 1%
                          at batch 64; the large-M paths (prefill, the update step) read it in
                          place as fast as the standard order (within 2% at M = 2048). "auto" is
                          "decode" on a GPU running the Gluon decode kernel, else "standard";
                          "rollout" gives the sampler a decode-order copy of the codes (half a
                          byte a weight more: 7B 3.3 GB) and keeps the update step on the standard
                          order. Same values either way.
  lora.rank / alpha / use_rslora / target_modules / train_norms (no LoRA dropout: QeRL uses PEFT's 0.0)
  aqn.enabled / schedule ("stages" | "exponential") / sigma_start / sigma_end / num_stages /
     rollout_only (paper variant: noise in the rollout only)
  data.train / data.eval  JSONL path, ``hub:<id>[:<config>]:<split>``, or
                          ``synthetic:<split>:<num>[:<seed>]`` (the embedded arithmetic task)
  data.task               "gsm8k" | "math" (prompt fields and reward)
  data.system_prompt, data.user_template ("{question}" + instructions),
  data.max_prompt_length [tokens], data.eval_size [prompts]
  rl.loss_type            "grpo" | "bnpo" | "dapo" | "dr_grpo" | "cispo" (MiniMax-M1's clipped IS-weight
                          REINFORCE; rl.epsilon_high is then its cap epsilon_max, e.g. 5.0) | "sapo" (a soft
                          sigmoid gate instead of the clip, temperatures rl.sapo_temperature_pos / _neg for
                          positive / other advantages, TRL's 1.0 / 1.05)
  rl.num_generations      G, completions per prompt (group size)
  rl.batch_size           completions per step (TRL's convention); prompts per step = batch_size / G
  rl.micro_batch_size     completions per gradient-accumulation micro-batch
  rl.num_iterations, epsilon, epsilon_high, beta, kl_estimator, scale_rewards,
  rl.mask_truncated_completions, format_reward_weight
  rl.importance_sampling_level  "token" (default: GRPO's per-token ratio) or "sequence" (GSPO, Zheng et al. 2025:
                          one ratio a completion, the geometric mean of its tokens' ratios; TRL's option of that
                          name). GSPO clips far tighter: its paper uses rl.epsilon=3e-4, rl.epsilon_high=4e-4,
                          with rl.loss_type="grpo" (a token-sum loss weights each completion by its length)
  rl.delta                INTELLECT-2's two-sided clipping (TRL's delta): the unclipped ratio is capped at delta,
                          bounding the loss of a negative advantage whose ratio ran far above 1; 0 (default, or
                          None in a config file): off; else > 1 + epsilon_high (INTELLECT-2 used 4)
  rl.top_entropy_quantile the fraction of each micro-batch's completion tokens, by highest entropy, that the
                          policy term keeps (Wang et al. 2025, "Beyond the 80/20 Rule"; TRL's field; the paper
                          keeps 0.2); 1 (default): every token. The KL term and the normalisers count every token
  rl.format_reward_kind   the form the format bonus checks (rewards.format_reward): "any" (default: '####',
                          <answer> or \\boxed), "hash", "answer_tags", "boxed", or "think_answer" (QeRL's
                          released <think>...</think><answer>...</answer> term)
  rl.dynamic_sampling     DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2): sample further batches of
                          prompts (up to rl.max_sampling_rounds a step) until the update has
                          batch_size / G groups with some right and some wrong answers; groups that carry no
                          signal fill the batch only when the rounds run out. Off by default.
  rl.recompute_old_logprobs  the importance ratio's old log-probs from a forward of the training model
                          (current adapter, the update's AQN noise) before the updates, instead of the
                          sampler's; one more forward a step. Logs the difference
                          (sampling/sampling_logp_difference/mean, /max). Off by default.
  rl.rollout_correction   the training-inference mismatch correction (TRL's vllm_importance_sampling_correction;
                          Yao et al. 2025, truncated importance sampling): "none" (default, as QeRL's recipes),
                          "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", or verl's
                          "geometric_truncate" / "geometric_mask". Any other than "none" recomputes the old
                          log-probs (as rl.recompute_old_logprobs=True) and weights each token's clipped loss by
                          rho = exp(old - sampler log-probs), per token, summed over the sequence, or averaged
                          over it (geometric: set tight bounds, e.g. 0.999 and 1.001), truncated to or masked
                          outside [clip_min, clip_max]
                          (grpo.rollout_importance_weights); logs sampling/importance_sampling_ratio/min, /mean,
                          /max. Refused with aqn.rollout_only (the sampler's log-probs are a noisier policy's)
  rl.rollout_correction_clip_max  C_max of rho, > 0 (TRL's default 3.0)
  rl.rollout_correction_clip_min  C_min of rho, in [0, clip_max); 0 (or None in a config file): no lower bound (TRL's default)
  rl.max_sampling_rounds  rollouts a step at most with dynamic sampling
  rl.oversample_factor    prompts a rollout samples with dynamic sampling, as a multiple of batch_size / G
                          (DAPO's larger generation batch: one rollout of 2x the rows costs far less on a GPU
                          than two rollouts; each consumes that many batches of prompts). 1: off
  rl.overlong_buffer_length [tokens], rl.overlong_penalty_factor
                          DAPO's soft overlong punishment (eq. 13): completions longer than
                          max_completion_length - buffer lose up to penalty_factor of reward,
                          linearly; 0 (the default) turns it off
  sampling.temperature / top_p / top_k / max_completion_length [tokens]; temperature > 0 and top_k != 1 (greedy
                          sampling makes a group's G completions the same: advantage 0, nothing learned)
  sampling.dequantize_min_rows  0: rollouts stay 4-bit; N: rollouts of >= N rows run on a dense copy (compute dtype) of
                          the base made once a rollout (qerl_jax.sampling.SamplingConfig)
  sampling.dequantize_max_weights  with dequantize_min_rows, copy only linears of <= this many weights a layer
                          (K x N; 0: all); 20_000_000 copies the 7B's q/k/v and o (1.6 GB bf16)
  optim.learning_rate / b1 / b2 / weight_decay / warmup_ratio / lr_schedule / max_grad_norm
  train.total_steps, save_every, keep_checkpoints, eval_every, eval_batch_size,
     eval_max_completion_length, log_samples_every, num_samples_logged, async_checkpointing,
     plot (write plots/ at the end of a run)
"""

from __future__ import annotations

import math
import os
import re
import sys

import ml_collections

from qerl_jax.rewards import FORMAT_KINDS  # rl.format_reward_kind (rewards needs no jax: numpy and the standard library)

__all__ = ["base_config", "validate", "data_spec_error", "config_flags_parser", "config_load_error", "LORA_MODULES",
           "LOSS_TYPES", "ROLLOUT_CORRECTIONS", "IMPORTANCE_SAMPLING_LEVELS"]

LORA_MODULES = ("q", "k", "v", "o", "gate", "up", "down")
LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo")
QUANTS = ("nvfp4", "nf4", "none")
TASKS = ("gsm8k", "math")
SCALE_REWARDS = ("group", "batch", "none")
KL_ESTIMATORS = ("k1", "k2", "k3")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")  # qerl_jax.grpo.IMPORTANCE_SAMPLING_LEVELS
AQN_SCHEDULES = ("stages", "exponential")
# rl.rollout_correction: "none" and qerl_jax.grpo.ROLLOUT_CORRECTION_MODES (TRL's vllm_importance_sampling_mode
# values and verl's geometric level; written out here, as grpo needs jax)
ROLLOUT_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask",
                       "geometric_truncate", "geometric_mask")
LR_SCHEDULES = ("cosine", "constant", "linear")


CODE_ORDERS = ("auto", "decode", "rollout", "standard")
ATTENTION_IMPLEMENTATIONS = ("xla", "cudnn", "auto")  # model.attn_impl: qerl_jax.models.layers.ATTENTION_IMPLEMENTATIONS


def base_config() -> ml_collections.ConfigDict:
  """Every key the trainer reads, with neutral defaults (a recipe overrides what it uses)."""
  c = ml_collections.ConfigDict()
  c.seed = 0

  c.model = ml_collections.ConfigDict()
  c.model.path = ""
  c.model.quant = "nvfp4"
  c.model.remat = True
  c.model.attn_chunk = 512  # query chunk of the training forward's attention (0: one piece); see the layout
  c.model.attn_impl = "auto"  # "cudnn" on a GPU, else "xla": the training forward's attention; see the layout
  c.model.fuse_projections = True  # models.fuse_projections after loading (LoRA tree unchanged);
  # runs saved before this key existed were unfused: pass False to reproduce them
  c.model.code_order = "auto"  # NVFP4 code order: "auto" (decode where pallas_kernels.decode_order_applies(),
  # else standard), "standard", "decode" (models.to_decode_order: faster decode steps) or "rollout" (a
  # decode-order copy for the sampler only); runs saved before session 17 used "standard" (same values)

  c.lora = ml_collections.ConfigDict()
  c.lora.rank = 32
  c.lora.alpha = 32.0
  c.lora.use_rslora = False
  c.lora.target_modules = LORA_MODULES
  c.lora.train_norms = True  # QeRL's `--ln True`: attention-input and MLP-input RMSNorm scales

  c.aqn = ml_collections.ConfigDict()
  c.aqn.enabled = True
  c.aqn.schedule = "stages"
  c.aqn.sigma_start = 1e-2
  c.aqn.sigma_end = 5e-4
  c.aqn.num_stages = 10
  c.aqn.rollout_only = False

  c.data = ml_collections.ConfigDict()
  c.data.task = "gsm8k"
  c.data.train = ""
  c.data.eval = ""
  c.data.system_prompt = ""  # "": no system message (the chat template may add its default)
  c.data.user_template = "{question}"  # the user message; qerl_jax.data has GSM8K/MATH instructions
  c.data.max_prompt_length = 256
  c.data.eval_size = 0  # 0: the whole eval set

  c.rl = ml_collections.ConfigDict()
  c.rl.loss_type = "grpo"
  c.rl.num_generations = 8
  c.rl.batch_size = 64
  c.rl.micro_batch_size = 8
  c.rl.num_iterations = 1
  c.rl.epsilon = 0.2
  c.rl.epsilon_high = 0.28
  c.rl.beta = 0.0
  c.rl.kl_estimator = "k3"
  c.rl.scale_rewards = "group"
  c.rl.mask_truncated_completions = True
  c.rl.importance_sampling_level = "token"  # "sequence": GSPO's one ratio a completion
  c.rl.delta = 0.0  # INTELLECT-2's cap on the unclipped ratio (TRL's delta); 0: off
  c.rl.top_entropy_quantile = 1.0  # < 1: the policy term on that fraction of highest-entropy tokens only
  c.rl.sapo_temperature_pos = 1.0  # loss_type="sapo": the gate's temperature where the advantage is > 0 (TRL's)
  c.rl.sapo_temperature_neg = 1.05  # and where it is <= 0 (TRL's)
  c.rl.format_reward_weight = 0.0
  c.rl.format_reward_kind = "any"  # rewards.FORMAT_KINDS
  c.rl.recompute_old_logprobs = False  # True: old log-probs from the training forward, not the sampler's
  c.rl.rollout_correction = "none"  # TRL's importance-sampling correction of the sampler's mismatch; see the layout
  c.rl.rollout_correction_clip_max = 3.0  # C_max of its ratio (TRL's default)
  c.rl.rollout_correction_clip_min = 0.0  # C_min of its ratio; 0 (or None): no lower bound (TRL's default None)
  c.rl.dynamic_sampling = False  # DAPO: keep sampling prompts until every group in the update carries signal
  c.rl.max_sampling_rounds = 4  # at most this many rollouts a step with dynamic_sampling
  c.rl.oversample_factor = 1  # with dynamic_sampling: each rollout samples this many batches of prompts at once
  c.rl.overlong_buffer_length = 0  # DAPO's soft overlong punishment over the last N tokens; 0: off
  c.rl.overlong_penalty_factor = 1.0

  c.sampling = ml_collections.ConfigDict()
  c.sampling.temperature = 1.0
  c.sampling.top_p = 1.0
  c.sampling.top_k = 0  # 0: off
  c.sampling.max_completion_length = 2048
  # 0: never. N > 0: a rollout of at least N rows (prompts x G, bucketed) dequantizes the 4-bit base once
  # and samples on that dense copy (13.1 GB more at 7B in bf16). Before the Gluon GEMM (session 46) a 4-bit decode
  # step of more than 128 rows dequantized every layer each step (0.72x of bf16 at batch 256); on sm_90 it now
  # runs 4-bit at about bf16's speed there (docs/benchmarks_rollout.md).
  c.sampling.dequantize_min_rows = 0
  c.sampling.dequantize_max_weights = 0  # with dequantize_min_rows: only linears of <= this many weights (0: all)

  c.optim = ml_collections.ConfigDict()
  c.optim.learning_rate = 1e-5
  c.optim.b1 = 0.9
  c.optim.b2 = 0.99
  c.optim.weight_decay = 0.1
  c.optim.warmup_ratio = 0.1
  c.optim.lr_schedule = "cosine"
  c.optim.max_grad_norm = 0.2

  c.train = ml_collections.ConfigDict()
  c.train.total_steps = 100
  c.train.save_every = 50
  c.train.keep_checkpoints = 5
  c.train.async_checkpointing = True
  c.train.eval_every = 0  # 0: only at the start and the end
  c.train.eval_batch_size = 64
  c.train.eval_max_completion_length = 0  # 0: sampling.max_completion_length
  c.train.log_samples_every = 10
  c.train.num_samples_logged = 4
  c.train.plot = True
  return c


def _looks_like_path(s: str) -> bool:
  """A local path (checked for existence) rather than a hub id ``org/name``, ``hub:...`` or ``random:...``."""
  if s.startswith(("hub:", "random:", "synthetic:")):
    return False
  return s.startswith((".", "/", "~")) or s.endswith((".jsonl", ".json")) or s.count("/") > 1


def validate(config: ml_collections.ConfigDict, *, check_paths: bool = True) -> None:
  """Checks that ``config`` can work, before any compute starts.

  Collects every problem and raises one ValueError listing them, each naming the key, its value
  and why it is impossible (e.g. ``rl.batch_size=12 is not a multiple of
  rl.num_generations=8``).

  Args:
    config: a config with the ``base_config()`` layout.
    check_paths: also check that local model and data paths exist.

  Raises:
    ValueError: one or more impossible settings, or a missing section/key.
  """
  try:
    _validate(config, check_paths)
  except (AttributeError, KeyError) as e:
    raise ValueError(f"config is missing a key the trainer reads ({e}); start recipes from "
                     "qerl_jax.train_config.base_config()") from None


def _validate(config: ml_collections.ConfigDict, check_paths: bool) -> None:
  errors: list[str] = []

  def need(cond: bool, msg: str) -> None:
    if not cond:
      errors.append(msg)

  missing = [k for k in ("model", "lora", "aqn", "data", "rl", "sampling", "optim", "train")
             if k not in config]
  if missing:
    raise ValueError(f"config is missing the section(s) {missing}; start recipes from "
                     "qerl_jax.train_config.base_config()")
  m, lo, aqn, d, rl, s, o, t = (config.model, config.lora, config.aqn, config.data, config.rl,
                                config.sampling, config.optim, config.train)

  errors.extend(f"{key}={value} must be a finite number (within float32's range)"
                for key, value in _non_finite(config.to_dict()))
  seed = config.seed
  need(isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**32,
       f"seed={seed!r} must be an integer in [0, 2**32)")

  need(bool(m.path), "model.path is empty: give a Hugging Face folder or hub id")
  need(m.quant in QUANTS, f"model.quant={m.quant!r} is not one of {QUANTS}")
  need(int(m.get("attn_chunk", 0)) >= 0,
       f"model.attn_chunk={m.get('attn_chunk')} must be >= 0 (0: attention in one piece)")
  need(m.get("attn_impl", "auto") in ATTENTION_IMPLEMENTATIONS,
       f"model.attn_impl={m.get('attn_impl')!r} is not one of {ATTENTION_IMPLEMENTATIONS}")
  need(m.get("code_order", "auto") in CODE_ORDERS,
       f"model.code_order={m.get('code_order')!r} is not one of {CODE_ORDERS}")

  need(int(lo.rank) >= 1, f"lora.rank={lo.rank} must be >= 1 (LoRA adapters are the only "
       "trained parameters)")
  need(float(lo.alpha) > 0, f"lora.alpha={lo.alpha} must be > 0")
  bad = [x for x in lo.target_modules if x not in LORA_MODULES]
  need(not bad and len(lo.target_modules) > 0,
       f"lora.target_modules={tuple(lo.target_modules)} must be a non-empty subset of {LORA_MODULES}")

  need(not aqn.get("rollout_only", False) or aqn.enabled,
       "aqn.rollout_only=True has no effect with aqn.enabled=False (there is no noise); turn AQN on or leave it "
       "False")
  if aqn.enabled:
    need(aqn.schedule in AQN_SCHEDULES, f"aqn.schedule={aqn.schedule!r} is not one of {AQN_SCHEDULES}")
    need(float(aqn.sigma_start) > 0, f"aqn.sigma_start={aqn.sigma_start} must be > 0 when "
         "aqn.enabled (set aqn.enabled=False to turn AQN off)")
    need(float(aqn.sigma_end) > 0, f"aqn.sigma_end={aqn.sigma_end} must be > 0 (both schedules decay "
         "geometrically from sigma_start to sigma_end)")
    need(not _all_finite(aqn.sigma_end, aqn.sigma_start) or float(aqn.sigma_end) <= float(aqn.sigma_start),
         f"aqn.sigma_end={aqn.sigma_end} > aqn.sigma_start={aqn.sigma_start}: AQN noise must decay")
    if aqn.schedule == "stages":
      need(int(aqn.num_stages) >= 3, f"aqn.num_stages={aqn.num_stages} must be >= 3 (stage 0 is "
           "noise-free; stages 1..K-1 decay from sigma_start to sigma_end)")

  need(d.task in TASKS, f"data.task={d.task!r} is not one of {TASKS}")
  need(bool(d.train), "data.train is empty: give a JSONL path or hub:<id>:<split>")
  for key, spec in (("data.train", d.train), ("data.eval", d.eval)):
    problem = data_spec_error(str(spec)) if spec else None
    need(problem is None, f"{key}={spec!r}: {problem}")
  need("{question}" in str(d.user_template),
       f"data.user_template={d.user_template!r} must contain '{{question}}'")
  need(int(d.max_prompt_length) >= 1, f"data.max_prompt_length={d.max_prompt_length} must be >= 1")
  need(int(d.eval_size) >= 0, f"data.eval_size={d.eval_size} must be >= 0")

  G, B, mb = int(rl.num_generations), int(rl.batch_size), int(rl.micro_batch_size)
  need(rl.loss_type in LOSS_TYPES, f"rl.loss_type={rl.loss_type!r} is not one of {LOSS_TYPES}")
  need(G >= 2, f"rl.num_generations={G} must be >= 2: a group of one has advantage 0 and "
       "learns nothing")
  need(B >= 1 and G >= 1 and B % G == 0,
       f"rl.batch_size={B} is not a multiple of rl.num_generations={G} (batch_size counts "
       "completions; prompts per step = batch_size / num_generations)")
  need(mb >= 1 and B % mb == 0,
       f"rl.micro_batch_size={mb} must be >= 1 and divide rl.batch_size={B}")
  need(int(rl.num_iterations) >= 1, f"rl.num_iterations={rl.num_iterations} must be >= 1")
  need(0 < float(rl.epsilon) < 1, f"rl.epsilon={rl.epsilon} must be in (0, 1) (the importance ratio's clip "
       "range starts at 1 - epsilon)")
  if rl.epsilon_high is not None:
    need(not _all_finite(rl.epsilon_high, rl.epsilon) or float(rl.epsilon_high) >= float(rl.epsilon),
         f"rl.epsilon_high={rl.epsilon_high} must be >= rl.epsilon={rl.epsilon}")
  need(rl.get("importance_sampling_level", "token") in IMPORTANCE_SAMPLING_LEVELS,
       f"rl.importance_sampling_level={rl.get('importance_sampling_level')!r} is not one of "
       f"{IMPORTANCE_SAMPLING_LEVELS}")
  delta = rl.get("delta", 0.0)
  eps_high = rl.epsilon if rl.epsilon_high is None else rl.epsilon_high
  cispo = rl.loss_type == "cispo"
  need(not cispo or not _all_finite(eps_high) or float(eps_high) >= 1,
       f"rl.loss_type='cispo' takes rl.epsilon_high as its cap epsilon_max on the importance weight, and "
       f"{eps_high} < 1 would shrink every on-policy token's weight: set it, e.g. --config.rl.epsilon_high=5.0 "
       "(TRL's and ScaleRL's recommendation)")
  unclipped = rl.loss_type in ("cispo", "sapo")  # no unclipped branch for delta to cap
  need(not unclipped or not delta, f"rl.delta={delta!r} caps the clipped losses' unclipped branch; "
       f"rl.loss_type={rl.loss_type!r} has none{' (its cap is rl.epsilon_high)' if cispo else ''}: leave rl.delta=0")
  for key in ("sapo_temperature_pos", "sapo_temperature_neg"):
    tau = rl.get(key, 1.0)
    need(not _all_finite(tau) or float(tau) > 0, f"rl.{key}={tau!r} must be > 0 (SAPO's gate temperature)")
  need(unclipped or delta is None or not _all_finite(delta, eps_high)  # the finiteness check names a NaN
       or float(delta) == 0 or float(delta) > 1 + float(eps_high),
       f"rl.delta={delta!r} must be 0 (off) or a number > 1 + rl.epsilon_high (INTELLECT-2's cap on the "
       "unclipped importance ratio)")
  teq = rl.get("top_entropy_quantile", 1.0)
  need(not _all_finite(teq) or 0 <= float(teq) <= 1,
       f"rl.top_entropy_quantile={teq!r} must be in [0, 1] (1: every token; 0: the highest-entropy token and its ties)")
  need(float(rl.beta) >= 0, f"rl.beta={rl.beta} must be >= 0")
  need(rl.kl_estimator in KL_ESTIMATORS, f"rl.kl_estimator={rl.kl_estimator!r} is not one of "
       f"{KL_ESTIMATORS}")
  need(rl.scale_rewards in SCALE_REWARDS, f"rl.scale_rewards={rl.scale_rewards!r} is not one of "
       f"{SCALE_REWARDS}")
  need(rl.get("format_reward_kind", "any") in FORMAT_KINDS,
       f"rl.format_reward_kind={rl.get('format_reward_kind')!r} is not one of {FORMAT_KINDS}")
  need(float(rl.format_reward_weight) >= 0, f"rl.format_reward_weight={rl.format_reward_weight} "
       "must be >= 0")
  need(rl.get("format_reward_kind", "any") == "any" or not float(rl.format_reward_weight) == 0,
       f"rl.format_reward_kind={rl.get('format_reward_kind')!r} has no effect with rl.format_reward_weight=0 "
       "(the format bonus is off); give the weight too")
  need(isinstance(rl.get("recompute_old_logprobs", False), bool),
       f"rl.recompute_old_logprobs={rl.get('recompute_old_logprobs')!r} must be True or False")
  correction = rl.get("rollout_correction", "none")
  need(correction in ROLLOUT_CORRECTIONS, f"rl.rollout_correction={correction!r} is not one of {ROLLOUT_CORRECTIONS}")
  clip_max = rl.get("rollout_correction_clip_max", 3.0)
  clip_min = rl.get("rollout_correction_clip_min", 0.0)
  # (a NaN or an infinity is reported once, by the finiteness check above)
  max_ok = _is_number(clip_max) and (not _all_finite(clip_max) or float(clip_max) > 0)
  need(max_ok, f"rl.rollout_correction_clip_max={clip_max!r} must be a number > 0 (the upper bound of the "
       "importance ratio rho)")
  need(clip_min is None or (_is_number(clip_min) and (not _all_finite(clip_min) or float(clip_min) >= 0)),
       f"rl.rollout_correction_clip_min={clip_min!r} must be a number >= 0, or None (0 and None: no lower bound)")
  if max_ok and _is_number(clip_min) and _all_finite(clip_min, clip_max):
    need(float(clip_min) < float(clip_max),
         f"rl.rollout_correction_clip_min={clip_min} must be < rl.rollout_correction_clip_max={clip_max}")
  if correction == "none":
    changed = [f"rl.rollout_correction_{k}={v!r}" for k, v, default in (("clip_min", clip_min, 0.0),
                                                                        ("clip_max", clip_max, 3.0))
               if _is_number(v) and _all_finite(v) and float(v) != default]
    need(not changed, f"{' and '.join(changed)} {'has' if len(changed) == 1 else 'have'} no effect with "
         "rl.rollout_correction='none'; choose a mode too")
  else:
    need(not (aqn.enabled and aqn.get("rollout_only", False)),
         f"rl.rollout_correction={correction!r} cannot be used with aqn.rollout_only=True: the sampler's log-probs "
         "are then the noisy rollout policy's and the update's are noiseless, so rho would weight the loss by the "
         "AQN noise's effect (undoing the exploration it adds), not by the kernels' mismatch it corrects; put the "
         "noise in the update too (aqn.rollout_only=False) or leave rl.rollout_correction='none'")
  need(isinstance(rl.get("dynamic_sampling", False), bool),
       f"rl.dynamic_sampling={rl.get('dynamic_sampling')!r} must be True or False")
  need(int(rl.get("max_sampling_rounds", 1)) >= 1,
       f"rl.max_sampling_rounds={rl.get('max_sampling_rounds')} must be >= 1 (rollouts a step)")
  over = int(rl.get("oversample_factor", 1))
  need(over >= 1, f"rl.oversample_factor={over} must be >= 1 (1: a rollout samples one step's prompts)")
  need(over <= 1 or rl.get("dynamic_sampling", False),
       f"rl.oversample_factor={over} needs rl.dynamic_sampling=True (without it a step's update takes every "
       "group it samples)")
  buf = int(rl.get("overlong_buffer_length", 0))
  need(0 <= buf <= int(s.max_completion_length),
       f"rl.overlong_buffer_length={buf} must be in [0, sampling.max_completion_length="
       f"{s.max_completion_length}] (0 turns the overlong penalty off)")
  factor = float(rl.get("overlong_penalty_factor", 1.0))
  need(0 <= factor < float("inf"), f"rl.overlong_penalty_factor={factor} must be a finite number >= 0")

  need(float(s.temperature) > 0, f"sampling.temperature={s.temperature} must be > 0: at 0 (greedy) the "
       "G completions of a group are the same, every advantage is 0 and nothing is learned")
  need(int(s.top_k) != 1, "sampling.top_k=1 is greedy sampling: the G completions of a group are the same, "
       "every advantage is 0 and nothing is learned (0 turns top-k off)")
  need(0 < float(s.top_p) <= 1, f"sampling.top_p={s.top_p} must be in (0, 1]")
  need(int(s.top_k) >= 0, f"sampling.top_k={s.top_k} must be >= 0 (0 turns it off)")
  need(int(s.get("dequantize_min_rows", 0)) >= 0,
       f"sampling.dequantize_min_rows={s.get('dequantize_min_rows')} must be >= 0 (0 turns it off)")
  need(int(s.get("dequantize_max_weights", 0)) >= 0,
       f"sampling.dequantize_max_weights={s.get('dequantize_max_weights')} must be >= 0 (0: every linear)")
  need(int(s.max_completion_length) >= 1,
       f"sampling.max_completion_length={s.max_completion_length} must be >= 1")

  need(float(o.learning_rate) > 0, f"optim.learning_rate={o.learning_rate} must be > 0")
  need(0 <= float(o.b1) < 1 and 0 <= float(o.b2) < 1,
       f"optim.b1={o.b1}, optim.b2={o.b2} must be in [0, 1)")
  need(float(o.weight_decay) >= 0, f"optim.weight_decay={o.weight_decay} must be >= 0")
  need(0 <= float(o.warmup_ratio) < 1, f"optim.warmup_ratio={o.warmup_ratio} must be in [0, 1)")
  need(o.lr_schedule in LR_SCHEDULES, f"optim.lr_schedule={o.lr_schedule!r} is not one of "
       f"{LR_SCHEDULES}")
  need(float(o.max_grad_norm) > 0, f"optim.max_grad_norm={o.max_grad_norm} must be > 0")

  need(int(t.total_steps) >= 1, f"train.total_steps={t.total_steps} must be >= 1")
  need(int(t.save_every) >= 1, f"train.save_every={t.save_every} must be >= 1")
  need(int(t.keep_checkpoints) >= 1, f"train.keep_checkpoints={t.keep_checkpoints} must be >= 1")
  need(int(t.eval_every) >= 0, f"train.eval_every={t.eval_every} must be >= 0 (0: start and end only)")
  need(int(t.eval_batch_size) >= 1, f"train.eval_batch_size={t.eval_batch_size} must be >= 1")
  need(int(t.eval_max_completion_length) >= 0,
       f"train.eval_max_completion_length={t.eval_max_completion_length} must be >= 0")
  need(int(t.log_samples_every) >= 0, f"train.log_samples_every={t.log_samples_every} must be >= 0")

  if check_paths:
    for key, value in (("model.path", m.path), ("data.train", d.train), ("data.eval", d.eval)):
      if value and _looks_like_path(str(value)) and not os.path.exists(os.path.expanduser(str(value))):
        errors.append(f"{key}={value!r} does not exist (relative paths are read from the "
                      f"current directory {os.getcwd()!r})")

  if errors:
    raise ValueError("impossible config:\n  - " + "\n  - ".join(errors))


def _non_finite(tree: dict, prefix: str = "") -> list[tuple[str, float]]:
  """``(dotted key, value)`` of every float in the nested dict ``tree`` that is NaN, infinite, or beyond float32's
  range (3.4e38: 1e39 became inf in the float32 optimizer)."""
  out = []
  for key, value in tree.items():
    if isinstance(value, dict):
      out += _non_finite(value, f"{prefix}{key}.")
    elif isinstance(value, float) and not (math.isfinite(value) and abs(value) <= _FLOAT32_MAX):
      out.append((f"{prefix}{key}", value))
  return out


_FLOAT32_MAX = 3.4028234663852886e38


def _is_number(x) -> bool:
  """An int or float (not a bool, not None, not a string)."""
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def _all_finite(*values) -> bool:
  """Whether every value is a finite number: an ordering check between two keys is left to the finiteness check
  when one is NaN (``sigma_end=0.0005 > sigma_start=nan`` was reported as well, which is false)."""
  return all(math.isfinite(float(v)) for v in values)


def data_spec_error(spec: str) -> str | None:
  """What is wrong with the form of a data spec (``data.train`` / ``data.eval``), or None.

  Checks only what needs no file or download: ``synthetic:<split>:<num>[:<seed>]`` (split one of
  ``synthetic.SPLITS``, num an integer >= 1, seed an integer) and ``hub:<id>[:<config>]:<split>``. A path is
  checked for existence by :func:`validate` (``check_paths``).
  """
  parts = spec.split(":")
  if parts[0] == "synthetic":
    if len(parts) not in (3, 4):
      return "expected synthetic:<split>:<num>[:<seed>]"
    from qerl_jax import synthetic  # standard library only
    if parts[1] not in synthetic.SPLITS:
      return f"the synthetic split {parts[1]!r} is not one of {synthetic.SPLITS}"
    if not re.fullmatch(r"[0-9]+", parts[2]) or int(parts[2]) < 1:
      return f"the number of problems {parts[2]!r} must be an integer >= 1"
    if len(parts) == 4 and not re.fullmatch(r"-?[0-9]+", parts[3]):
      return f"the seed {parts[3]!r} must be an integer"
  elif parts[0] == "hub" and (len(parts) not in (3, 4) or not all(parts[1:])):
    return "expected hub:<id>[:<config>]:<split>"
  return None


def config_load_error(e: OSError) -> str:
  """The one-line message for a ``--config`` file that ml_collections could not load (``e``: the
  OSError it raised, while parsing an override or at the config's first read)."""
  detail = " ".join(str(e).split()).split("Attempted", 1)[-1]
  return f"error: could not load the config file --config: {detail}"


def config_flags_parser(keys_hint: str = "every key is listed in qerl_jax/train_config.py base_config()"):
  """An absl ``flags_parser`` for the launchers that take ``--config`` (``ml_collections.config_flags``).

  ``app.run(main, flags_parser=config_flags_parser())`` parses the flags and turns what a user gets wrong
  into one line on stderr and exit status 2, where absl would print a traceback: a ``--config.<key>``
  the config does not have (``keys_hint`` says where the keys are listed), a ``--config`` file that
  cannot be loaded (ml_collections reads it while parsing an override), and any other flag error.

  Returns:
    ``parse(argv) -> remaining argv`` for ``absl.app.run``.
  """
  from absl import flags  # the launchers' dependency, not the library's

  def parse(argv):
    try:
      return flags.FLAGS(argv)
    except (AttributeError, KeyError) as e:  # ml_collections: a key the config does not have
      msg = str(e.args[0] if e.args else e).strip("'\"").replace("\\n", " ").replace("\n", " ").replace("\\'", "'")
      overrides = [a for a in argv[1:] if a.startswith("--config.")]
      leaf = msg.split()[0].strip("'\"") if msg.split() else ""  # ml_collections names the key it lacks first
      bad = [a for a in overrides if a.split("=", 1)[0].rsplit(".", 1)[-1] == leaf] or overrides
      print(f"error: unknown config key among {bad}: {msg}\n  ({keys_hint})", file=sys.stderr)
      sys.exit(2)
    except OSError as e:  # ml_collections could not load the --config file an override reads
      print(config_load_error(e), file=sys.stderr)
      sys.exit(2)
    except flags.Error as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)

  return parse
