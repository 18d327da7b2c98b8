"""The GRPO / DAPO objective: group-relative advantages, the clipped policy loss, KL estimators, metrics.

Everything here is a pure ``jax.numpy`` function of arrays: jit-able, differentiable, no model.
The update step that differentiates the loss lives in :mod:`qerl_jax.update`.

Option names follow Hugging Face TRL's ``GRPOConfig`` (``num_generations``, ``loss_type``,
``epsilon``, ``epsilon_high``, ``beta``, ``scale_rewards``, ``mask_truncated_completions``) so
TRL configs carry over, and the metric names are TRL's (``clip_ratio/low_mean`` ...).

References
----------
* GRPO: Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, eq. (3) (group-relative advantage,
  clipped surrogate, per-sequence mean) and eq. (4) (the k3 KL estimator).
* KL estimators k1/k2/k3: J. Schulman, "Approximating KL Divergence", 2020 (blog note).
* DAPO: Yu et al. 2025, arXiv:2503.14476 (clip-higher ``epsilon_high``, token-level mean,
  dropping over-long truncated completions, dynamic sampling (section 3.2; here
  :func:`informative_groups`), the soft overlong punishment (eq. 13; :func:`overlong_penalty`)).
* Dr. GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783
  (constant normaliser ``num_sequences * max_completion_length``, no std scaling).
* BNPO: Xiao et al. 2025, arXiv:2506.02864 (normalise by the tokens of the batch).
* QeRL: Huang et al. 2025, arXiv:2510.11696 (uses GRPO/DAPO with these settings on 4-bit weights).
* Truncated importance sampling against the training-inference mismatch: Yao et al. 2025, "Your Efficient RL
  Framework Secretly Brings You Off-Policy RL Training" (blog post, Aug. 2025); TRL's
  ``vllm_importance_sampling_correction`` / ``_mode`` / ``_clip_min`` / ``_clip_max``
  (:func:`rollout_importance_weights`).
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any, Mapping

import jax
import jax.numpy as jnp

__all__ = [
    "LOSS_TYPES",
    "KL_ESTIMATORS",
    "SCALE_REWARDS",
    "LOG_RATIO_CLAMP",
    "group_advantages",
    "reward_metrics",
    "informative_groups",
    "overlong_penalty",
    "kl_divergence",
    "IMPORTANCE_SAMPLING_LEVELS",
    "ROLLOUT_CORRECTION_MODES",
    "rollout_importance_weights",
    "rollout_importance_metrics",
    "loss_normalizer",
    "policy_loss_terms",
    "finalize_policy_loss",
    "policy_loss",
    "completion_metrics",
]

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo")
KL_ESTIMATORS = ("k1", "k2", "k3")
SCALE_REWARDS = ("group", "batch", "none")
# TRL's vllm_importance_sampling_mode values (rollout_importance_weights)
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")  # TRL's importance_sampling_level; "sequence" is GSPO
ROLLOUT_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "geometric_truncate",
                            "geometric_mask")
# Log-ratios are clamped at +-LOG_RATIO_CLAMP before any exp: exp(20) ~ 4.9e8 is finite in
# float32 and bfloat16, so no value or gradient can overflow however far the policies drift.
LOG_RATIO_CLAMP = 20.0
_ZERO_STD_RTOL = 1e-6
STD_EPS = 1e-4  # added to the std of group_advantages' division, as TRL does (advantages / (std + 1e-4))


# --------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------
def _is_int(x) -> bool:
    """A Python or numpy integer (not a bool)."""
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


def _check_rewards(rewards, group_size: int, std_ddof: int, zero_std_rtol: float) -> jax.Array:
    if not _is_int(group_size) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if not _is_int(std_ddof) or std_ddof < 0:
        raise ValueError(f"std_ddof must be a non-negative int, got {std_ddof!r}")
    if not zero_std_rtol >= 0.0:
        raise ValueError(f"zero_std_rtol must be >= 0, got {zero_std_rtol!r}")
    rewards = jnp.asarray(rewards)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [num_prompts * group_size], got shape {rewards.shape}")
    if not (jnp.issubdtype(rewards.dtype, jnp.floating) or jnp.issubdtype(rewards.dtype, jnp.integer)
            or rewards.dtype == jnp.bool_):
        raise TypeError(f"rewards must be a real numeric array, got dtype {rewards.dtype}")
    if rewards.shape[0] % group_size:
        raise ValueError(
            f"rewards length {rewards.shape[0]} is not a multiple of group_size {group_size}")
    return rewards.astype(jnp.float32)


def _spread_is_zero(values, valid, axis, zero_std_rtol):
    """True where the valid values along ``axis`` are all equal up to a relative tolerance."""
    fill = jnp.where(valid, values, 0.0)
    big = jnp.where(valid, values, -jnp.inf).max(axis=axis)
    small = jnp.where(valid, values, jnp.inf).min(axis=axis)
    spread = jnp.where(valid.any(axis=axis), big - small, 0.0)
    scale = jnp.abs(fill).max(axis=axis)
    return spread <= zero_std_rtol * scale


def _masked_std(values, valid, axis, std_ddof):
    """(mean, centered, std, has_std) of the valid entries along ``axis`` (std with ``std_ddof``)."""
    n = valid.sum(axis=axis, keepdims=True).astype(jnp.float32)
    mean = jnp.where(valid, values, 0.0).sum(axis=axis, keepdims=True) / jnp.maximum(n, 1.0)
    centered = jnp.where(valid, values - mean, 0.0)
    dof = n - std_ddof
    has_std = dof > 0
    var = (centered * centered).sum(axis=axis, keepdims=True) / jnp.where(has_std, dof, 1.0)
    std = jnp.where(has_std, jnp.sqrt(var), 0.0)
    return mean, centered, std, has_std


def _group_stats(rewards, group_size, std_ddof, zero_std_rtol):
    r = rewards.reshape(-1, group_size)
    valid = jnp.isfinite(r)
    mean, centered, std, has_std = _masked_std(r, valid, 1, std_ddof)
    zero = (~has_std[:, 0]) | _spread_is_zero(r, valid, 1, zero_std_rtol)
    return dict(r=r, valid=valid, mean=mean, centered=centered, std=std[:, 0],
                has_std=has_std[:, 0], zero_std=zero)


@functools.partial(jax.jit, static_argnames=("group_size", "scale_rewards", "std_ddof",
                                             "zero_std_rtol", "std_eps"))
def group_advantages(rewards, group_size: int, *, scale_rewards: str = "group", std_ddof: int = 1,
                     zero_std_rtol: float = _ZERO_STD_RTOL, std_eps: float = STD_EPS) -> jax.Array:
    """Group-relative advantages of GRPO (DeepSeekMath eq. 3; TRL ``scale_rewards``).

    Args:
      rewards: ``[num_prompts * group_size]`` float (any real dtype, computed in float32); groups
        are ``group_size`` consecutive completions of one prompt. Non-finite entries (NaN/inf: a
        reward function that failed) are *missing*: excluded from every statistic, advantage 0.
      group_size: completions per prompt (TRL ``num_generations``), a positive Python int.
      scale_rewards: ``"group"`` divides each group's centred rewards by the group's std (GRPO,
        TRL default); ``"batch"`` divides by the std of all valid rewards of the batch (TRL
        ``"batch"``); ``"none"`` does not divide (Dr. GRPO).
      std_ddof: delta degrees of freedom of the std; 1 (unbiased) is what TRL and QeRL use.
      std_eps: added to the std before the division, ``(r - mean) / (std + std_eps)``; TRL's 1e-4
        (:data:`STD_EPS`), which bounds the advantage of a group whose rewards differ only slightly.
      zero_std_rtol: a group whose valid rewards span ``max - min <= zero_std_rtol * max|r|`` counts
        as zero-std (all equal, also when the value is not exactly representable and the
        float32 mean has rounding noise) and gets advantage 0 for every member; nothing is
        ever divided by rounding noise.

    Returns:
      advantages ``[num_prompts * group_size]`` float32, always finite: ``(r - group_mean) /
      (std + std_eps)`` (or without the division). Zero for missing rewards, zero-std groups, and groups with
      fewer than ``std_ddof + 1`` valid rewards (a group of one with the default ddof).

    Raises:
      ValueError: bad ``group_size``/``std_ddof``/``scale_rewards``, rewards not 1-D, or length
        not a multiple of ``group_size``. TypeError: non-numeric rewards.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    rewards = _check_rewards(rewards, group_size, std_ddof, zero_std_rtol)
    s = _group_stats(rewards, group_size, std_ddof, zero_std_rtol)
    keep = s["valid"] & ~s["zero_std"][:, None]
    if scale_rewards == "group":
        denom = s["std"][:, None] + jnp.float32(std_eps)
    elif scale_rewards == "batch":
        flat_valid = s["valid"].reshape(-1)
        _, _, bstd, bhas = _masked_std(rewards, flat_valid, 0, std_ddof)
        bzero = (~bhas[0]) | _spread_is_zero(rewards, flat_valid, 0, zero_std_rtol)
        keep = keep & ~bzero
        denom = bstd + jnp.float32(std_eps)
    else:
        denom = jnp.ones((1, 1), jnp.float32)
    if not (math.isfinite(std_eps) and std_eps >= 0):
        raise ValueError(f"std_eps must be a finite float >= 0, got {std_eps!r}")
    safe = jnp.where(keep, denom, 1.0)
    adv = jnp.where(keep, s["centered"] / jnp.where(safe > 0, safe, 1.0), 0.0)
    return adv.reshape(-1)


@functools.partial(jax.jit, static_argnames=("group_size", "std_ddof", "zero_std_rtol"))
def reward_metrics(rewards, group_size: int, *, std_ddof: int = 1,
                   zero_std_rtol: float = _ZERO_STD_RTOL) -> dict[str, jax.Array]:
    """Reward statistics of one rollout batch in TRL's metric names.

    Args: as :func:`group_advantages` (``rewards`` ``[num_prompts * group_size]``).

    Returns a dict of float32 scalars:
      ``reward``: mean of the finite rewards (0 when none);
      ``reward_std``: mean over groups (with a defined std) of the per-group std, as TRL logs it;
      ``frac_reward_zero_std``: fraction of groups whose advantages are all 0 because their valid
        rewards are all equal (or fewer than ``std_ddof + 1``), i.e. groups that carry no signal;
      ``frac_reward_nonfinite``: fraction of rewards that were NaN/inf (missing).

    Raises: as :func:`group_advantages`.
    """
    rewards = _check_rewards(rewards, group_size, std_ddof, zero_std_rtol)
    s = _group_stats(rewards, group_size, std_ddof, zero_std_rtol)
    n_valid = s["valid"].sum()
    mean = jnp.where(s["valid"], s["r"], 0.0).sum() / jnp.maximum(n_valid, 1)
    n_std = s["has_std"].sum()
    return {
        "reward": mean,
        "reward_std": jnp.where(s["has_std"], s["std"], 0.0).sum() / jnp.maximum(n_std, 1),
        "frac_reward_zero_std": s["zero_std"].astype(jnp.float32).mean(),
        "frac_reward_nonfinite": 1.0 - s["valid"].astype(jnp.float32).mean(),
    }


# --------------------------------------------------------------------------------------------
# KL
# --------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("group_size", "std_ddof", "zero_std_rtol"))
def informative_groups(rewards, group_size: int, *, std_ddof: int = 1,
                       zero_std_rtol: float = _ZERO_STD_RTOL) -> jax.Array:
    """Which groups carry a learning signal: DAPO's dynamic-sampling filter (Yu et al. 2025, sec. 3.2).

    A group whose valid rewards are all equal (all correct or all wrong, with no other reward term to
    tell them apart) gets advantage 0 for every member, so it adds no gradient but still counts in the
    token-level normaliser. DAPO over-samples prompts and keeps only the groups for which this is True.

    Args: as :func:`group_advantages` (``rewards`` float ``[num_prompts * group_size]``, non-finite =
      missing; the same ``zero_std_rtol`` test of equality).

    Returns:
      bool ``[num_prompts]``: True where the group's advantages are not all zero under
      ``scale_rewards="group"``, i.e. at least ``std_ddof + 1`` valid rewards that are not all equal.

    Raises: as :func:`group_advantages`.
    """
    rewards = _check_rewards(rewards, group_size, std_ddof, zero_std_rtol)
    return ~_group_stats(rewards, group_size, std_ddof, zero_std_rtol)["zero_std"]


def overlong_penalty(lengths, max_length: int, buffer_length: int, penalty_factor: float = 1.0) -> jax.Array:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), a length-dependent reward term.

    With ``L = max_length`` and ``C = buffer_length``, a completion of ``n`` tokens gets
    ``0`` for ``n <= L - C``, ``-penalty_factor * (n - (L - C)) / C`` for ``L - C < n <= L`` (a
    linear ramp to ``-penalty_factor`` at ``n = L``), and ``-penalty_factor`` for ``n > L``. It is
    added to the task reward, so a truncated completion (``n = L``) scores ``-penalty_factor`` below
    a short one. The DAPO recipe uses ``L = 20480``, ``C = 4096``, ``penalty_factor = 1`` (verl's
    ``overlong_buffer``).

    Args:
      lengths: int ``[...]``, completion lengths in tokens (the end token included, as
        ``sampling.Rollout.lengths``).
      max_length: ``L``, the maximum completion length in tokens, a Python int >= 1.
      buffer_length: ``C``, the punished interval in tokens, a Python int in ``[0, max_length]``;
        0 turns the term off (all zeros).
      penalty_factor: the penalty at and beyond ``L``, a finite float >= 0.

    Returns:
      float32 ``[...]`` (same shape as ``lengths``), each in ``[-penalty_factor, 0]``.

    Raises:
      ValueError: ``max_length`` < 1, ``buffer_length`` outside ``[0, max_length]``, a negative or
        non-finite ``penalty_factor``, or non-integer ``lengths``.
    """
    if not _is_int(max_length) or max_length < 1:
        raise ValueError(f"overlong_penalty: max_length must be an int >= 1, got {max_length!r}")
    if not _is_int(buffer_length) or not 0 <= buffer_length <= max_length:
        raise ValueError(f"overlong_penalty: buffer_length must be an int in [0, max_length={max_length}], "
                         f"got {buffer_length!r}")
    factor = float(penalty_factor)
    if not (factor >= 0.0 and factor != float("inf")):
        raise ValueError(f"overlong_penalty: penalty_factor must be a finite float >= 0, got {penalty_factor!r}")
    lengths = jnp.asarray(lengths)
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"overlong_penalty: lengths must be integers (tokens), got dtype {lengths.dtype}")
    if buffer_length == 0:
        return jnp.zeros(lengths.shape, jnp.float32)
    exceed = jnp.clip(lengths - (max_length - buffer_length), 0, buffer_length).astype(jnp.float32)
    return jnp.where(exceed > 0, -exceed / jnp.float32(buffer_length) * jnp.float32(factor), 0.0)  # 0, not -0.


@functools.partial(jax.jit, static_argnames=("estimator",))
def kl_divergence(logprobs, ref_logprobs, *, estimator: str = "k3") -> jax.Array:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta (Schulman 2020).

    With ``d = ref_logprobs - logprobs`` (the log of pi_ref / pi_theta at the sampled token):
      ``k1 = -d``; ``k2 = d**2 / 2``; ``k3 = exp(d) - d - 1`` (DeepSeekMath eq. 4, TRL's ``beta``
      term; non-negative, unbiased).
    For k3, ``d`` is clamped from above at ``LOG_RATIO_CLAMP`` (20) before the exp, so value and
    gradient stay finite in float32 and bfloat16 when the policies drift apart (beyond the
    clamp the value is constant and the gradient 0); below the clamp it is exact, and it is
    exactly 0 for equal inputs (computed as ``expm1(d) - d``).

    Args:
      logprobs, ref_logprobs: ``[..., T]`` log-probabilities (nats) of the sampled tokens under the
        policy and the reference policy (the same model with LoRA switched off); any float dtype,
        computed in float32.
      estimator: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns: float32 ``[..., T]`` per-token KL estimate (nats). Masking is the caller's job.

    Raises: ValueError for an unknown estimator or mismatched shapes.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    logprobs = jnp.asarray(logprobs)
    ref_logprobs = jnp.asarray(ref_logprobs)
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"ref_logprobs shape {ref_logprobs.shape} != logprobs shape {logprobs.shape}")
    d = ref_logprobs.astype(jnp.float32) - logprobs.astype(jnp.float32)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    c = jnp.minimum(d, LOG_RATIO_CLAMP)
    return jnp.expm1(c) - c


# --------------------------------------------------------------------------------------------
# Training-inference mismatch (the sampler's log-probs against the trainer's)
# --------------------------------------------------------------------------------------------
def _check_rollout_correction_mode(mode) -> None:
    if mode not in ROLLOUT_CORRECTION_MODES:
        raise ValueError(f"rollout correction mode must be one of {ROLLOUT_CORRECTION_MODES}, got {mode!r}")


def _check_rollout_correction(mode, clip_min, clip_max) -> tuple[float | None, float]:
    """``(clip_min, clip_max)`` as floats (``clip_min`` None when unbounded); ValueError for a bad mode or bounds."""
    _check_rollout_correction_mode(mode)
    try:
        hi = float(clip_max)
        lo = None if clip_min is None else float(clip_min)
    except (TypeError, ValueError):
        raise ValueError(f"clip_min must be None or a float and clip_max a float, got clip_min={clip_min!r}, "
                         f"clip_max={clip_max!r}") from None
    if not (math.isfinite(hi) and hi > 0.0):
        raise ValueError(f"clip_max must be a finite float > 0, got {clip_max!r}")
    if lo is not None and not (math.isfinite(lo) and 0.0 <= lo < hi):
        raise ValueError(f"clip_min must be None or a float in [0, clip_max={hi}), got {clip_min!r}")
    return lo, hi


@functools.partial(jax.jit, static_argnames=("mode", "clip_min", "clip_max", "mask_truncated_completions"))
def rollout_importance_weights(trainer_logprobs, sampler_logprobs, mask, *, mode: str,
                               clip_min: float | None = None, clip_max: float = 3.0, truncated=None,
                               mask_truncated_completions: bool = False) -> jax.Array:
    """Importance weights that correct the loss for the sampler's numeric mismatch with the trainer.

    The rollout samples with another program than the training forward (here the jitted decode with 4-bit
    kernels and a bf16 KV cache; vLLM in TRL), so the completions come from ``pi_sampler``, not from the
    ``pi_old`` the importance ratio assumes. Truncated importance sampling (Yao et al. 2025, "Your Efficient
    RL Framework Secretly Brings You Off-Policy RL Training") weights each token's loss by
    ``rho = pi_old / pi_sampler``, bounded; TRL's ``vllm_importance_sampling_correction``, whose four modes
    the first four are (``vllm_importance_sampling_mode``, ``_clip_min``, ``_clip_max``). With
    ``d_t = trainer_logprobs_t - sampler_logprobs_t`` on the completion tokens (0 elsewhere):

    * ``token_truncate``: ``rho_t = clip(exp(d_t), clip_min, clip_max)``;
    * ``token_mask``: ``rho_t = exp(d_t)``, set to 0 where it is outside ``[clip_min, clip_max]``;
    * ``sequence_truncate`` / ``sequence_mask``: the same on one ratio a sequence, ``exp(sum_t d_t)``
      (the sum over the sequence's completion tokens), given to each of its tokens.
    * ``geometric_truncate`` / ``geometric_mask``: the same on the sequence's geometric-mean ratio,
      ``exp(mean_t d_t)`` over its completion tokens (verl's ``rollout_is_level="geometric"``; Liu, Li et al.
      2025, "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch"). It
      does not grow with the length as the product does, so it needs tight bounds: verl suggests an upper
      bound of 1.0002-1.001 and its reciprocal as the lower.

    The bounds are inclusive (a ratio equal to ``clip_max`` is kept by the mask modes), as in TRL. An
    ``exp`` that overflows float32 gives ``inf``, which truncates to ``clip_max`` and is masked to 0: no
    NaN comes from large differences. The weights are data, not differentiated (the update step takes
    their ``stop_gradient``).

    Args:
      trainer_logprobs: ``[B, T]`` log-probs (nats) of the sampled tokens under the training forward with
        the rollout's parameters (the recomputed old log-probs); any float dtype, computed in float32.
      sampler_logprobs: ``[B, T]`` log-probs (nats) the sampler recorded for the same tokens
        (``sampling.Rollout.policy_logprobs``), at the same temperature.
      mask: ``[B, T]`` completion mask, nonzero on the tokens that count; entries outside it (padding,
        possibly non-finite) are never read.
      mode: one of :data:`ROLLOUT_CORRECTION_MODES`.
      clip_min: lower bound ``C_min``, a float in ``[0, clip_max)``, or None for none (TRL's default; 0 acts
        as none too, a ratio being >= 0).
      clip_max: upper bound ``C_max``, a finite float > 0 (TRL's default 3.0; TRL's ``None`` is not
        offered).
      truncated, mask_truncated_completions: as in :func:`policy_loss_terms`: with the flag, the truncated
        completions (``truncated`` ``[B]`` bool) leave ``mask``, as the loss leaves them (TRL's completion mask).

    Returns:
      rho ``[B, T]`` float32, >= 0 and finite where the log-probs on ``mask`` are (a NaN there, or ``-inf`` in
      both, gives NaN in the truncate modes): the weight of each completion token (in the sequence modes one
      value repeated over a row's completion tokens), 0 outside ``mask``.

    Raises:
      ValueError: an unknown ``mode``, ``clip_max`` not a finite float > 0, ``clip_min`` outside
        ``[0, clip_max)``, ``mask`` not 2-D, or inputs whose shapes differ from ``mask``'s, or
        ``mask_truncated_completions`` without a ``[B]`` ``truncated``.
    """
    lo, hi = _check_rollout_correction(mode, clip_min, clip_max)
    m = _effective_mask(mask, truncated, mask_truncated_completions)
    shape = m.shape
    trainer_logprobs, sampler_logprobs = jnp.asarray(trainer_logprobs), jnp.asarray(sampler_logprobs)
    for name, x in (("trainer_logprobs", trainer_logprobs), ("sampler_logprobs", sampler_logprobs)):
        if x.shape != shape:
            raise ValueError(f"{name} shape {x.shape} != mask shape {shape}")
    d = (jnp.where(m, trainer_logprobs.astype(jnp.float32), 0.0)
         - jnp.where(m, sampler_logprobs.astype(jnp.float32), 0.0))
    if mode.startswith("sequence"):
        d = d.sum(axis=1, keepdims=True)
    elif mode.startswith("geometric"):
        d = _row_mean(d, m)
    ratio = jnp.exp(d)
    if mode.endswith("truncate"):
        rho = jnp.minimum(ratio, jnp.float32(hi))
        if lo is not None:
            rho = jnp.maximum(rho, jnp.float32(lo))
    else:
        keep = ratio <= jnp.float32(hi)
        if lo is not None:
            keep = keep & (ratio >= jnp.float32(lo))
        rho = jnp.where(keep, ratio, 0.0)
    return jnp.where(m, jnp.broadcast_to(rho, shape), 0.0)


@functools.partial(jax.jit, static_argnames=("mode", "mask_truncated_completions"))
def rollout_importance_metrics(rho, mask, *, mode: str, truncated=None,
                               mask_truncated_completions: bool = False) -> dict[str, jax.Array]:
    """TRL's ``sampling/importance_sampling_ratio/min``, ``/mean``, ``/max`` of :func:`rollout_importance_weights`.

    Over the completion tokens in the token modes, as TRL logs them; over the sequences with at least one
    completion token in the sequence and geometric modes. There TRL takes every row (``ratio.flatten()``), so a row its
    ``mask_truncated_completions`` masked whole counts as its ratio ``exp(0) = 1`` (bounded); here such a row,
    and a dynamic-sampling filler row, is left out.

    Args:
      rho: ``[B, T]`` float, the weights :func:`rollout_importance_weights` returned for ``mask`` and ``mode``.
      mask: ``[B, T]`` the completion mask they were computed with.
      mode: one of :data:`ROLLOUT_CORRECTION_MODES`.
      truncated, mask_truncated_completions: as they were given to :func:`rollout_importance_weights`.

    Returns: a dict of float32 scalars (all 0 when there is no completion token, as TRL's).

    Raises: ValueError for an unknown ``mode`` or shapes that differ.
    """
    _check_rollout_correction_mode(mode)
    m = _effective_mask(mask, truncated, mask_truncated_completions)
    rho = jnp.asarray(rho, jnp.float32)
    if rho.shape != m.shape:
        raise ValueError(f"rho shape {rho.shape} != mask shape {m.shape}")
    if not mode.startswith("token"):  # one value a row: its completion tokens all hold it
        valid = m.any(axis=1)
        values = jnp.where(m, rho, -jnp.inf).max(axis=1)
    else:
        valid, values = m, rho
    n = valid.sum()
    prefix = "sampling/importance_sampling_ratio/"
    return {
        prefix + "min": jnp.where(n > 0, jnp.where(valid, values, jnp.inf).min(), 0.0),
        prefix + "mean": jnp.where(valid, values, 0.0).sum() / jnp.maximum(n, 1),
        prefix + "max": jnp.where(n > 0, jnp.where(valid, values, -jnp.inf).max(), 0.0),
    }


# --------------------------------------------------------------------------------------------
# Policy loss
# --------------------------------------------------------------------------------------------
def _check_loss_options(loss_type, epsilon, epsilon_high, beta, kl_estimator):
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    if not (0.0 <= float(epsilon) < 1.0):
        raise ValueError(f"epsilon must be in [0, 1), got {epsilon!r}")
    if epsilon_high is not None and not float(epsilon_high) >= 0.0:
        raise ValueError(f"epsilon_high must be >= 0, got {epsilon_high!r}")
    if not float(beta) >= 0.0:
        raise ValueError(f"beta must be >= 0, got {beta!r}")


def _check_loss_extras(importance_sampling_level, delta, top_entropy_quantile, loss_type=None,
                       sapo_temperatures=(1.0, 1.05)) -> None:
    """ValueError for an unknown importance-sampling level, a ``delta`` that is not a finite float > 1, or a
    ``top_entropy_quantile`` outside [0, 1], a ``delta`` with ``loss_type`` ``"cispo"`` or ``"sapo"``, or a SAPO
    temperature that is not a finite float > 0. A ``delta`` at or below 1 would cap the ratio of every on-policy
    token (ratio 1) and so zero its gradient: refused."""
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
                         f"got {importance_sampling_level!r}")
    if delta is not None and not (_is_finite_number(delta) and delta > 1):
        raise ValueError(f"delta must be None or a finite float > 1 (INTELLECT-2 recommends > 1 + epsilon_high; "
                         f"at or below 1 it zeroes the gradient of on-policy tokens), got {delta!r}")
    if delta is not None and loss_type in ("cispo", "sapo"):
        raise ValueError(f"delta caps the clipped losses' unclipped branch; loss_type={loss_type!r} has none: leave "
                         "delta None")
    for name, tau in zip(("sapo_temperature_pos", "sapo_temperature_neg"), sapo_temperatures):
        if not (_is_finite_number(tau) and tau > 0):
            raise ValueError(f"{name} must be a finite float > 0, got {tau!r}")
    if not (_is_finite_number(top_entropy_quantile) and 0.0 <= top_entropy_quantile <= 1.0):
        raise ValueError(f"top_entropy_quantile must be a float in [0, 1] (1: every token; 0: the highest-entropy "
                         f"token and its ties), got {top_entropy_quantile!r}")


def _is_finite_number(x) -> bool:
    """A finite Python int or float (not a bool): the loss options' static scalars."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _effective_mask(mask, truncated, mask_truncated_completions):
    """Bool ``[B, T]`` mask with truncated completions removed when asked."""
    mask = jnp.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"mask must be [batch, completion_length], got shape {mask.shape}")
    m = mask.astype(bool)
    if mask_truncated_completions:
        if truncated is None:
            raise ValueError("mask_truncated_completions=True needs truncated [batch] bool")
        truncated = jnp.asarray(truncated)
        if truncated.shape != (m.shape[0],):
            raise ValueError(
                f"truncated must have shape ({m.shape[0]},), got {truncated.shape}")
        m = m & ~truncated.astype(bool)[:, None]
    return m


def _row_mean(x, mask) -> jax.Array:
    """``[B, 1]`` float32: each row's sum of ``x`` (already 0 off ``mask``) over its count of ``mask`` entries (at
    least 1, so a row with none gives 0): a sequence's mean over its completion tokens."""
    return x.sum(axis=1, keepdims=True) / jnp.maximum(mask.sum(axis=1, keepdims=True), 1).astype(jnp.float32)


def _masked_quantile(x, mask, q: float) -> jax.Array:
    """``torch.quantile(x[mask], q)`` (linear interpolation) as a float32 scalar; NaN when ``mask`` is empty.

    As torch: rank ``q * (n - 1)`` in float32 and its two neighbours in the sorted values interpolated with
    torch's ``lerp``, which gives ``v`` exactly between two equal values ``v``. ``jnp.nanquantile`` computes
    ``v * (1 - w) + v * w`` instead, which can round above ``v``: a ``>=`` test then drops every token tied at
    the quantile. Entries outside ``mask`` (possibly non-finite) are never read."""
    n = mask.sum()
    s = jnp.sort(jnp.where(mask, x, jnp.inf).ravel())
    rank = jnp.float32(q) * (jnp.maximum(n, 1) - 1).astype(jnp.float32)
    below = rank.astype(jnp.int32)  # rank >= 0: the floor
    w = rank - below.astype(jnp.float32)
    a, b = s[below], s[jnp.ceil(rank).astype(jnp.int32)]
    value = jnp.where(w < 0.5, a + w * (b - a), b - (b - a) * (1.0 - w))
    return jnp.where(n > 0, value, jnp.nan)


def loss_normalizer(mask, *, loss_type: str, max_completion_length: int | None = None,
                    truncated=None, mask_truncated_completions: bool = False) -> jax.Array:
    """The denominator of ``loss_type`` for a batch (or a whole gradient-accumulation window), as TRL's
    ``GRPOTrainer._compute_loss``.

    * ``grpo`` / ``sapo``: number of sequences ``B`` (each sequence is first averaged over its own tokens, see
      :func:`policy_loss_terms`; DeepSeekMath eq. 3). A sequence with no unmasked token (a truncated one
      dropped by ``mask_truncated_completions``) adds 0 to the numerator and still counts here, as in
      TRL's ``.mean()`` over the batch;
    * ``bnpo`` / ``dapo`` / ``cispo``: number of unmasked tokens (DAPO's token-level loss, BNPO; TRL's
      ``cispo`` takes the accumulation window's tokens, as ``dapo``);
    * ``dr_grpo`` (Dr. GRPO, Liu et al. 2025): ``B * max_completion_length`` (default ``T``), a constant:
      dropped truncated sequences still count.
    For ``grpo``, ``dapo``, ``cispo`` and ``dr_grpo``, summing the numerators of several micro-batches and dividing
    once by the normaliser of their concatenation gives exactly the loss of the concatenated batch.
    ``bnpo`` is TRL's per-micro-batch token mean averaged over the micro-batches
    (:func:`qerl_jax.update.make_update_step` divides each micro-batch by its own token count); on one
    batch it equals ``dapo``.

    Args:
      mask: ``[B, T]`` completion mask (nonzero = completion token that counts).
      loss_type: one of ``LOSS_TYPES``.
      max_completion_length: tokens; only for ``dr_grpo``.
      truncated: ``[B]`` bool, completions that hit the length limit without an end token.
      mask_truncated_completions: drop truncated completions (numerator and denominator).

    Returns: float32 scalar, >= 0 (0 for an empty batch; :func:`finalize_policy_loss` then
    divides by 1).

    Raises: ValueError for bad ``loss_type``, shapes, or ``max_completion_length``.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    m = _effective_mask(mask, truncated, mask_truncated_completions)
    if loss_type in ("grpo", "sapo"):
        return jnp.float32(m.shape[0])
    if loss_type in ("bnpo", "dapo", "cispo"):
        return m.sum().astype(jnp.float32)
    length = m.shape[1] if max_completion_length is None else max_completion_length
    if not _is_int(length) or length < 1:
        raise ValueError(f"max_completion_length must be a positive int, got {length!r}")
    return jnp.float32(m.shape[0] * operator.index(length))


def policy_loss_terms(logprobs, old_logprobs, advantages, mask, *, loss_type: str = "grpo",
                      epsilon: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0,
                      ref_logprobs=None, kl_estimator: str = "k3", entropy=None, truncated=None,
                      mask_truncated_completions: bool = False,
                      rollout_is_weights=None,
                      importance_sampling_level: str = "token", delta: float | None = None,
                      top_entropy_quantile: float = 1.0, sapo_temperature_pos: float = 1.0,
                      sapo_temperature_neg: float = 1.05) -> dict[str, jax.Array]:
    """Un-normalised sums of the clipped surrogate loss and its metrics over one (micro-)batch.

    Per token ``t`` of sequence ``i`` (DeepSeekMath eq. 3, DAPO clip-higher)::

        ratio = exp(clip(logprobs - old_logprobs, -20, 20))           # importance ratio
        l     = -min(ratio * A_i, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A_i) * rho_t
              + beta * KL_t                                             # if beta > 0

    With ``importance_sampling_level="sequence"`` (GSPO: Zheng et al. 2025, "Group Sequence Policy
    Optimization", eq. 7; TRL's option of that name) every token of sequence ``i`` takes one ratio instead,
    the geometric mean of its tokens' ratios, ``exp(clip(mean_t (logprobs - old_logprobs), -20, 20))`` over
    its unmasked tokens. Its gradient reaches each token as ``ratio_i / |y_i|``, as GSPO's. GSPO clips this
    ratio far tighter than GRPO (the paper: ``epsilon`` 3e-4, ``epsilon_high`` 4e-4) and pairs it with
    ``loss_type="grpo"``. The token-sum losses weight each sequence by its length; TRL warns about them.

    ``loss_type="cispo"`` (MiniMax-M1, 2025, eq. 4; TRL's ``cispo``) clips the importance weight instead and
    keeps every token's gradient: ``l = -sg(min(ratio, epsilon_high)) * A_i * logprobs_t`` (+ beta * KL), where
    ``epsilon_high`` is the absolute cap epsilon_max (ScaleRL and TRL recommend 5.0; ``epsilon`` is unused), then
    summed over the tokens and divided by the token count as ``dapo``. Its clip metric is TRL's
    ``cispo_clip_ratio``, ``ratio > epsilon_high`` with ``A > 0``, reported as ``clip_high`` and ``clip_region``.
    ``delta`` does not apply to it, as in TRL.

    ``loss_type="sapo"`` (Soft Adaptive Policy Optimization, Gao et al. 2025, arXiv:2511.20347; TRL's ``sapo``)
    replaces the hard clip by a smooth gate: ``l = -sigmoid(tau * (ratio - 1)) * 4 / tau * A_i`` (+ beta * KL),
    with ``tau = sapo_temperature_pos`` where ``A_i > 0`` and ``sapo_temperature_neg`` elsewhere (TRL's 1.0 and
    1.05), reduced as ``grpo``. Its gradient at ratio 1 is GRPO's and fades smoothly as the ratio leaves 1. It
    clips nothing, so its clip metrics are 0 (TRL logs none for it); ``delta`` does not apply to it.

    ``delta`` (two-sided clipping, INTELLECT-2, Prime Intellect 2025; TRL's ``delta``) caps the unclipped
    branch: ``-min(min(ratio, delta) * A_i, clip(ratio, ...) * A_i)``, which bounds the loss of a negative
    advantage whose ratio has run far above 1 (the paper recommends ``delta > 1 + epsilon_high``; it used 4).

    ``top_entropy_quantile < 1`` (Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens
    Drive Effective RL for LLM Reasoning"; TRL's field) keeps the policy term only on the tokens whose
    ``entropy`` is at least the ``1 - top_entropy_quantile`` quantile (linear interpolation, as
    ``torch.quantile``) of this batch's unmasked tokens' entropies; the KL term and the normalisers still
    count every token, as in TRL. In the update step the batch is each micro-batch, as TRL computes it per
    loss call.

    ``rho_t`` is ``rollout_is_weights`` (1 when None), the sampler-mismatch correction of
    :func:`rollout_importance_weights`; as in TRL it weights the clipped policy term only, not the KL term,
    and it is not differentiated.

    The clamp of the log-ratio at +-``LOG_RATIO_CLAMP`` (as verl does) only acts when the
    policies are e^20 apart; it keeps value and gradient finite.

    Returns a dict of float32 scalars:
      ``loss_sum``: for ``grpo`` the sum over sequences of each sequence's mean token loss (a
        sequence with no unmasked token adds 0), otherwise the sum of token losses;
      ``tokens``, ``clip_low``, ``clip_high``, ``clip_region``, ``kl``, ``entropy``: token counts /
      sums over unmasked tokens (TRL's clip indicators: low = ``ratio < 1 - epsilon`` and
      ``A < 0``, high = ``ratio > 1 + epsilon_high`` and ``A > 0``, region = either). At the sequence
      level a sequence's tokens share its indicator, so the clip counts weight sequences by their
      token counts; TRL's metric there is a mean over sequences.
    Masked tokens contribute nothing, and their (possibly non-finite, e.g. padding) inputs are
    replaced before any arithmetic so they cannot leak NaN into values or gradients.

    Args: see :func:`policy_loss`.
    Raises: ValueError/TypeError for bad options or shapes.
    """
    _check_loss_options(loss_type, epsilon, epsilon_high, beta, kl_estimator)
    _check_loss_extras(importance_sampling_level, delta, top_entropy_quantile, loss_type,
                       (sapo_temperature_pos, sapo_temperature_neg))
    if top_entropy_quantile < 1.0 and entropy is None:
        raise ValueError(f"top_entropy_quantile={top_entropy_quantile} < 1 needs entropy [B, T] (the policy's "
                         "per-token entropy)")
    m = _effective_mask(mask, truncated, mask_truncated_completions)
    shape = m.shape
    logprobs = jnp.asarray(logprobs)
    if logprobs.shape != shape:
        raise ValueError(f"logprobs shape {logprobs.shape} != mask shape {shape}")
    lp = jnp.where(m, logprobs.astype(jnp.float32), 0.0)
    if old_logprobs is None:
        old = jax.lax.stop_gradient(lp)
    else:
        old_logprobs = jnp.asarray(old_logprobs)
        if old_logprobs.shape != shape:
            raise ValueError(f"old_logprobs shape {old_logprobs.shape} != mask shape {shape}")
        old = jnp.where(m, old_logprobs.astype(jnp.float32), 0.0)
    adv = jnp.asarray(advantages).astype(jnp.float32)
    if adv.shape == (shape[0],):
        adv = adv[:, None]
    elif adv.shape != shape:
        raise ValueError(f"advantages must be [{shape[0]}] or {shape}, got {adv.shape}")
    adv = jnp.where(m, adv, 0.0)
    ent = None  # the entropy on the mask, 0 elsewhere: the metric's sum and the high-entropy token mask
    if entropy is not None:
        entropy = jnp.asarray(entropy)
        if entropy.shape != shape:
            raise ValueError(f"entropy shape {entropy.shape} != mask shape {shape}")
        ent = jnp.where(m, entropy.astype(jnp.float32), 0.0)

    eps_low = float(epsilon)
    eps_high = eps_low if epsilon_high is None else float(epsilon_high)
    log_ratio = lp - old  # 0 off the mask
    if importance_sampling_level == "sequence":  # GSPO: the mean over the sequence's unmasked tokens
        log_ratio = jnp.broadcast_to(_row_mean(log_ratio, m), shape)
    ratio = jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    if loss_type == "cispo":  # MiniMax-M1: the clipped ratio is a weight on the REINFORCE term, not differentiated
        weight = jax.lax.stop_gradient(jnp.minimum(ratio, jnp.float32(eps_high)))
        per_token = -weight * adv * lp
    elif loss_type == "sapo":  # a sigmoid gate around ratio 1 instead of the hard clip
        tau = jnp.where(adv > 0, jnp.float32(sapo_temperature_pos), jnp.float32(sapo_temperature_neg))
        per_token = -jax.nn.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv
    else:
        capped = ratio if delta is None else jnp.minimum(ratio, jnp.float32(delta))
        per_token = -jnp.minimum(capped * adv, clipped * adv)
    if top_entropy_quantile < 1.0:  # the policy term on the high-entropy tokens only (TRL: before rho and KL)
        ent_data = jax.lax.stop_gradient(ent)
        threshold = _masked_quantile(ent_data, m, 1.0 - float(top_entropy_quantile))
        per_token = jnp.where(m & (ent_data >= threshold), per_token, 0.0)
    if rollout_is_weights is not None:
        rollout_is_weights = jnp.asarray(rollout_is_weights)
        if rollout_is_weights.shape != shape:
            raise ValueError(f"rollout_is_weights shape {rollout_is_weights.shape} != mask shape {shape}")
        rho = jnp.where(m, rollout_is_weights.astype(jnp.float32), 0.0)
        per_token = per_token * jax.lax.stop_gradient(rho)

    mf = m.astype(jnp.float32)
    kl_sum = jnp.float32(0.0)
    if ref_logprobs is not None:
        ref_logprobs = jnp.asarray(ref_logprobs)
        if ref_logprobs.shape != shape:
            raise ValueError(f"ref_logprobs shape {ref_logprobs.shape} != mask shape {shape}")
        ref = jnp.where(m, ref_logprobs.astype(jnp.float32), 0.0)
        kl_tok = jnp.where(m, kl_divergence(lp, ref, estimator=kl_estimator), 0.0)
        kl_sum = kl_tok.sum()
        if beta:
            per_token = per_token + float(beta) * kl_tok
    elif beta:
        raise ValueError("beta > 0 needs ref_logprobs (the policy's log-probs with LoRA off)")
    per_token = jnp.where(m, per_token, 0.0)

    if loss_type in ("grpo", "sapo"):
        loss_sum = _row_mean(per_token, m).sum()
    else:
        loss_sum = per_token.sum()

    if loss_type == "cispo":  # TRL's cispo_clip_ratio: the weight was capped where it counts (A > 0)
        low = jnp.zeros(shape, bool)
        high = (ratio > eps_high) & (adv > 0) & m
    elif loss_type == "sapo":  # no hard clip
        low = high = jnp.zeros(shape, bool)
    else:
        low = (ratio < 1.0 - eps_low) & (adv < 0) & m
        high = (ratio > 1.0 + eps_high) & (adv > 0) & m
    ent_sum = jnp.float32(0.0) if ent is None else ent.sum()
    return {
        "loss_sum": loss_sum,
        "tokens": mf.sum(),
        "clip_low": low.astype(jnp.float32).sum(),
        "clip_high": high.astype(jnp.float32).sum(),
        "clip_region": (low | high).astype(jnp.float32).sum(),
        "kl": kl_sum,
        "entropy": ent_sum,
    }


def finalize_policy_loss(terms: Mapping[str, Any], normalizer) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Turn (summed) :func:`policy_loss_terms` into ``(loss, metrics)``.

    ``loss = loss_sum / max(normalizer, 1)``; the metrics are means over unmasked tokens
    (0 when there are none), named as in TRL: ``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
    ``clip_ratio/region_mean``, ``kl``, ``entropy`` (nats), plus ``num_tokens``.

    Args:
      terms: the dict of float32 scalars :func:`policy_loss_terms` returns (or their sums over
        the micro-batches of a window): ``loss_sum``, ``tokens``, ``clip_low``, ``clip_high``,
        ``clip_region``, ``kl``, ``entropy``.
      normalizer: float scalar from :func:`loss_normalizer` (of the same batch or window).

    Returns: ``(loss, metrics)``, a float32 scalar and a dict of float32 scalars.
    Raises: KeyError if ``terms`` lacks one of the keys above.
    """
    n = jnp.maximum(terms["tokens"], 1.0)
    loss = terms["loss_sum"] / jnp.maximum(jnp.asarray(normalizer, jnp.float32), 1.0)
    metrics = {
        "clip_ratio/low_mean": terms["clip_low"] / n,
        "clip_ratio/high_mean": terms["clip_high"] / n,
        "clip_ratio/region_mean": terms["clip_region"] / n,
        "kl": terms["kl"] / n,
        "entropy": terms["entropy"] / n,
        "num_tokens": terms["tokens"],
    }
    return loss, metrics


@functools.partial(jax.jit, static_argnames=(
    "loss_type", "epsilon", "epsilon_high", "beta", "max_completion_length", "kl_estimator",
    "mask_truncated_completions", "importance_sampling_level", "delta", "top_entropy_quantile",
    "sapo_temperature_pos", "sapo_temperature_neg"))
def policy_loss(logprobs, old_logprobs, advantages, mask, *, loss_type: str = "grpo",
                epsilon: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0,
                ref_logprobs=None, max_completion_length: int | None = None,
                kl_estimator: str = "k3", entropy=None, truncated=None,
                mask_truncated_completions: bool = False, normalizer=None, rollout_is_weights=None,
                importance_sampling_level: str = "token", delta: float | None = None,
                top_entropy_quantile: float = 1.0, sapo_temperature_pos: float = 1.0,
                sapo_temperature_neg: float = 1.05) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped GRPO / DAPO / Dr. GRPO / BNPO policy loss with optional KL penalty (TRL semantics).

    Args:
      logprobs: ``[B, T]`` log-probs (nats) of the completion tokens under the current policy
        (differentiated); any float dtype, computed in float32.
      old_logprobs: ``[B, T]`` log-probs under the rollout policy (the sampler's), or ``None`` to
        use ``stop_gradient(logprobs)`` (ratio exactly 1, as TRL does when
        ``num_iterations == 1``).
      advantages: ``[B]`` (one per sequence, from :func:`group_advantages`) or ``[B, T]``.
      mask: ``[B, T]`` completion mask, nonzero for tokens that count (completion tokens up to and
        including the end token).
      loss_type: ``"grpo"``: mean over each sequence's tokens, then mean over all ``B`` sequences
        (DeepSeekMath; TRL); ``"bnpo"`` / ``"dapo"``: sum over all tokens / number of tokens (DAPO
        token-level mean; in a gradient-accumulation window ``dapo`` uses the window's token count and
        ``bnpo`` each micro-batch's, as TRL: :func:`loss_normalizer`); ``"dr_grpo"``: sum over all
        tokens / (``B`` x ``max_completion_length``) (Dr. GRPO); ``"cispo"``: MiniMax-M1's clipped
        importance-weighted REINFORCE, reduced as ``dapo``; ``"sapo"``: SAPO's soft gate, reduced as ``grpo``
        (both: :func:`policy_loss_terms`).
      epsilon: lower clip range (ratio clipped below at ``1 - epsilon``); unused by ``cispo``.
      epsilon_high: upper clip range (DAPO clip-higher, e.g. 0.28); default ``epsilon``. For ``cispo`` the
        absolute cap epsilon_max of the importance weight (TRL and ScaleRL recommend 5.0).
      beta: KL coefficient; > 0 needs ``ref_logprobs``.
      ref_logprobs: ``[B, T]`` log-probs under the reference policy (the same model with LoRA off);
        when given, the ``kl`` metric is reported even with ``beta == 0``.
      max_completion_length: tokens, for ``dr_grpo`` (default ``T``).
      kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (default), see :func:`kl_divergence`.
      entropy: optional ``[B, T]`` per-token policy entropy (nats) for the ``entropy`` metric.
      truncated: ``[B]`` bool, completions that hit the length limit without an end token.
      mask_truncated_completions: drop truncated completions from numerator and denominator.
      normalizer: optional precomputed :func:`loss_normalizer` (of a whole accumulation window).
      rollout_is_weights: optional ``[B, T]`` float, each token's weight on the clipped policy term (the
        sampler-mismatch correction, :func:`rollout_importance_weights`; TRL multiplies ``per_token_loss``
        by it before adding the KL term); not differentiated. None: 1.
      importance_sampling_level: ``"token"`` (default; GRPO's per-token ratio) or ``"sequence"`` (GSPO's
        per-sequence ratio, the geometric mean of its tokens' ratios; :func:`policy_loss_terms`).
      delta: None (default) or a float > 1: INTELLECT-2's cap on the unclipped ratio (:func:`policy_loss_terms`).
      top_entropy_quantile: in [0, 1], default 1 (every token): the fraction of the highest-entropy tokens the
        policy term keeps (Wang et al. 2025; :func:`policy_loss_terms`); < 1 needs ``entropy``.
      sapo_temperature_pos, sapo_temperature_neg: SAPO's gate temperatures for ``A > 0`` and ``A <= 0``
        (TRL's defaults 1.0 and 1.05); only ``loss_type="sapo"`` reads them.

    Returns:
      ``(loss, metrics)``: float32 scalar loss and a dict of float32 scalars (see
      :func:`finalize_policy_loss`). A batch with no unmasked token gives loss 0 and zero gradient.

    Raises:
      ValueError: unknown ``loss_type``/``kl_estimator``, bad clip ranges, mismatched shapes,
        ``beta > 0`` without ``ref_logprobs``, ``mask_truncated_completions`` without ``truncated``, an
        unknown ``importance_sampling_level``, a bad ``delta`` or ``top_entropy_quantile`` (or one < 1 without
        ``entropy``).
    """
    terms = policy_loss_terms(
        logprobs, old_logprobs, advantages, mask, loss_type=loss_type, epsilon=epsilon,
        epsilon_high=epsilon_high, beta=beta, ref_logprobs=ref_logprobs,
        kl_estimator=kl_estimator, entropy=entropy, truncated=truncated,
        mask_truncated_completions=mask_truncated_completions, rollout_is_weights=rollout_is_weights,
        importance_sampling_level=importance_sampling_level, delta=delta, top_entropy_quantile=top_entropy_quantile,
        sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg)
    if normalizer is None:
        normalizer = loss_normalizer(
            mask, loss_type=loss_type, max_completion_length=max_completion_length,
            truncated=truncated, mask_truncated_completions=mask_truncated_completions)
    return finalize_policy_loss(terms, normalizer)


# --------------------------------------------------------------------------------------------
# Completion metrics
# --------------------------------------------------------------------------------------------
@jax.jit
def completion_metrics(completion_mask, truncated) -> dict[str, jax.Array]:
    """Length statistics of a rollout batch in TRL's names.

    Args:
      completion_mask: ``[B, T]`` nonzero on completion tokens.
      truncated: ``[B]`` bool, completions that hit the length limit without an end token.

    Returns float32 scalars (lengths in tokens): ``completions/mean_length``,
    ``completions/min_length``, ``completions/max_length``, ``completions/mean_terminated_length``
    (over completions that ended with an end token; 0 if none) and ``completions/clipped_ratio``
    (fraction truncated).

    Raises: ValueError for mismatched shapes or an empty batch.
    """
    m = jnp.asarray(completion_mask)
    truncated = jnp.asarray(truncated).astype(bool)
    if m.ndim != 2 or m.shape[0] == 0 or truncated.shape != (m.shape[0],):
        raise ValueError(
            f"need completion_mask [B>0, T] and truncated [B]; got {m.shape} and {truncated.shape}")
    lengths = m.astype(bool).sum(axis=1).astype(jnp.float32)
    term = ~truncated
    n_term = term.sum()
    return {
        "completions/mean_length": lengths.mean(),
        "completions/min_length": lengths.min(),
        "completions/max_length": lengths.max(),
        "completions/mean_terminated_length":
            jnp.where(term, lengths, 0.0).sum() / jnp.maximum(n_term, 1),
        "completions/clipped_ratio": truncated.astype(jnp.float32).mean(),
    }
