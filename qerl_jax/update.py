"""The jit-compiled GRPO/DAPO update step: optimizer, train state, gradient accumulation, skip-on-NaN.

The caller supplies the model as ``logprob_fn(trainable_params, batch) -> (logprobs [B, T] f32,
entropy [B, T] f32)``; this module never imports the model. Gradients are taken over the
trainable tree only (LoRA adapters and, optionally, trainable norms); the frozen 4-bit base is
closed over by ``logprob_fn`` (or passed in the batch) and never differentiated.

Optimizer defaults are QeRL's GRPO scripts (arXiv:2510.11696; Hugging Face ``TrainingArguments``
names so TRL configs carry over): AdamW lr 1e-5, betas (0.9, 0.99), weight decay 0.1, linear
warmup then cosine decay, global-norm clipping at 0.2 (``max_grad_norm``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import optax

from qerl_jax import grpo

__all__ = [
    "TrainState",
    "make_lr_schedule",
    "make_optimizer",
    "make_train_state",
    "make_update_step",
    "BATCH_LOSS_KEYS",
]

# Batch entries the loss reads (``logprob_fn`` sees them too, sliced like every other entry).
BATCH_LOSS_KEYS = ("advantages", "completion_mask", "old_logprobs", "ref_logprobs", "truncated",
                   "rollout_is_weights")
_INJECTED_KEYS = ("step", "key")
_SCHEDULES = ("cosine", "linear", "constant", "constant_with_warmup")


def _opt(config: Any, name: str, default: Any) -> Any:
    """``config.name`` for a ConfigDict / dataclass / namespace, or ``config[name]`` for a Mapping."""
    if config is None:
        return default
    if isinstance(config, Mapping):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return default if value is None else value


class TrainState(NamedTuple):
    """What changes during RL training (a pytree; checkpoint it whole).

    Attributes:
      params: the trainable tree (LoRA ``{"layers": {...: {"a", "b"}}}`` and optional norms).
      opt_state: the optax state of ``make_optimizer(config)`` for ``params``.
      num_updates: int32 scalar, optimizer updates applied (the learning-rate schedule's step).
      skipped_updates: int32 scalar, updates skipped because the loss or gradient was not finite.
    """

    params: Any
    opt_state: Any
    num_updates: jax.Array
    skipped_updates: jax.Array


def make_lr_schedule(config: Any) -> Callable[[jax.Array], jax.Array]:
    """Learning rate as a function of the number of applied updates (Hugging Face semantics).

    Config fields (HF ``TrainingArguments`` names): ``learning_rate`` (peak, default 1e-5),
    ``lr_scheduler_type`` (``"cosine"`` default, ``"linear"``, ``"constant"``,
    ``"constant_with_warmup"``), ``max_steps`` (total optimizer updates; required by cosine and
    linear), ``warmup_steps`` (int) or else ``warmup_ratio`` (fraction of ``max_steps``, default
    0.1, rounded up as HF does). Warmup is linear from 0; cosine decays to 0 at ``max_steps``.

    Returns: ``schedule(count int32 scalar) -> float32 scalar`` (jit-able).
    Raises: ValueError for an unknown schedule, a missing/invalid ``max_steps``, or a negative rate.
    """
    lr = float(_opt(config, "learning_rate", 1e-5))
    kind = _opt(config, "lr_scheduler_type", "cosine")
    if kind not in _SCHEDULES:
        raise ValueError(f"lr_scheduler_type must be one of {_SCHEDULES}, got {kind!r}")
    if lr < 0:
        raise ValueError(f"learning_rate must be >= 0, got {lr}")
    total = _opt(config, "max_steps", None)
    if kind in ("cosine", "linear") and (total is None or int(total) < 1):
        raise ValueError(f"lr_scheduler_type={kind!r} needs max_steps >= 1, got {total!r}")
    warmup = _opt(config, "warmup_steps", None)
    if warmup is None or int(warmup) <= 0:
        ratio = float(_opt(config, "warmup_ratio", 0.1))
        warmup = math.ceil(ratio * int(total)) if total is not None else 0
    warmup = int(warmup)
    total = int(total) if total is not None else 0

    def schedule(count):
        c = jnp.asarray(count, jnp.float32)
        warm = c / max(warmup, 1)
        if kind == "constant":
            factor = jnp.float32(1.0)
        elif kind == "constant_with_warmup":
            # HF: c / warmup while c < warmup, then 1 (so the full rate from update 0 when there
            # is no warmup; min(c, 1) would give a zero first update)
            factor = jnp.where(c < warmup, warm, 1.0)
        else:
            progress = jnp.clip((c - warmup) / max(total - warmup, 1), 0.0, 1.0)
            decay = (0.5 * (1.0 + jnp.cos(jnp.pi * progress)) if kind == "cosine"
                     else 1.0 - progress)
            factor = jnp.where(c < warmup, warm, decay)
        return lr * factor

    return schedule


def _decay_mask(params):
    """Weight-decay mask: every leaf except norm weights (HF's rule excludes norms and biases)."""
    def keep(path, _):
        return not any("norm" in str(getattr(k, "key", getattr(k, "name", k))) for k in path)
    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(config: Any = None) -> optax.GradientTransformation:
    """AdamW with warmup + cosine schedule and global-norm clipping, as in QeRL's scripts.

    Config fields (HF names, defaults in brackets): ``learning_rate`` [1e-5], ``adam_beta1``
    [0.9], ``adam_beta2`` [0.99], ``adam_epsilon`` [1e-8], ``weight_decay`` [0.1, decoupled,
    not applied to norm weights], ``max_grad_norm`` [0.2; 0 disables clipping], plus the schedule
    fields of :func:`make_lr_schedule` (``max_steps`` is required for the default cosine).
    ``config`` may be an ``ml_collections.ConfigDict``, a dataclass, or a dict.

    Returns: an ``optax.GradientTransformation`` whose schedule counts applied updates.
    Raises: ValueError for invalid hyper-parameters.
    """
    b1 = float(_opt(config, "adam_beta1", 0.9))
    b2 = float(_opt(config, "adam_beta2", 0.99))
    eps = float(_opt(config, "adam_epsilon", 1e-8))
    wd = float(_opt(config, "weight_decay", 0.1))
    clip = float(_opt(config, "max_grad_norm", 0.2))
    for name, v in (("adam_beta1", b1), ("adam_beta2", b2)):
        if not 0.0 <= v < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {v}")
    if wd < 0 or clip < 0 or eps <= 0:
        raise ValueError(
            f"need weight_decay >= 0, max_grad_norm >= 0, adam_epsilon > 0; got {wd}, {clip}, {eps}")
    adamw = optax.adamw(make_lr_schedule(config), b1=b1, b2=b2, eps=eps, weight_decay=wd,
                        mask=_decay_mask)
    if clip > 0:
        return optax.chain(optax.clip_by_global_norm(clip), adamw)
    return adamw


def make_train_state(lora_params: Any, optimizer: optax.GradientTransformation) -> TrainState:
    """Fresh :class:`TrainState` for the trainable tree ``lora_params`` (floating leaves).

    Raises:
        ValueError: ``lora_params`` has no leaves. TypeError: a leaf is not floating point.
    """
    leaves = jax.tree_util.tree_leaves(lora_params)
    if not leaves:
        raise ValueError("lora_params has no leaves: nothing to train")
    for leaf in leaves:
        if not jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating):
            raise TypeError(f"trainable leaves must be floating point, got {jnp.asarray(leaf).dtype}")
    return TrainState(params=lora_params, opt_state=optimizer.init(lora_params),
                      num_updates=jnp.zeros((), jnp.int32),
                      skipped_updates=jnp.zeros((), jnp.int32))


def _split_batch(batch: Mapping[str, Any], num_micro: int):
    """Reshape every per-example leaf [B, ...] to [num_micro, B // num_micro, ...]."""
    if "completion_mask" not in batch or "advantages" not in batch:
        raise ValueError("batch needs 'completion_mask' [B, T] and 'advantages' [B]")
    clash = [k for k in _INJECTED_KEYS if k in batch]
    if clash:
        raise ValueError(f"batch keys {clash} are reserved (the update step sets them)")
    per_example = {k: v for k, v in batch.items() if k != "shared"}
    b = jnp.shape(batch["completion_mask"])[0]
    if b % num_micro:
        raise ValueError(
            f"batch size {b} is not divisible by gradient_accumulation_steps {num_micro}")

    def split(path, x):
        x = jnp.asarray(x)
        if x.ndim == 0 or x.shape[0] != b:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path)} has shape {x.shape}; per-example leaves "
                f"need leading dim {b} (put shared arrays under batch['shared'])")
        return x.reshape((num_micro, b // num_micro) + x.shape[1:])

    return jax.tree_util.tree_map_with_path(split, per_example)


def make_update_step(logprob_fn: Callable[[Any, Mapping[str, Any]], tuple[jax.Array, jax.Array]],
                     config: Any = None, *, optimizer: optax.GradientTransformation | None = None,
                     donate: bool = False):
    """Build the jit-compiled ``update_step(train_state, batch, step, key) -> (train_state, metrics)``.

    One call is one optimizer update. For ``num_iterations > 1`` (several updates per rollout; TRL's
    ``num_iterations``, GRPO's mu) call it that many times on the same batch, whose ``old_logprobs`` stay
    the rollout's.

    Args:
      logprob_fn: ``(trainable_params, micro_batch) -> (logprobs [b, T] f32, entropy [b, T] f32)``,
        the per-token log-probs (nats) and entropies of the completion tokens under the policy.
        ``micro_batch`` holds all the caller's batch entries sliced to the micro-batch (including
        ``completion_mask``, which the model needs for its attention mask), the unsliced
        ``batch["shared"]`` (e.g. AQN norm noise), and ``"step"`` / ``"key"`` from the call
        (so noise can be drawn inside the jit as a pure function of them).
      config: fields (TRL names): ``loss_type`` ["grpo"], ``epsilon`` [0.2], ``epsilon_high``
        [= epsilon], ``beta`` [0.0], ``kl_estimator`` ["k3"], ``max_completion_length`` [T],
        ``mask_truncated_completions`` [False], ``importance_sampling_level`` ["token"; "sequence" is
        GSPO], ``delta`` [None; INTELLECT-2's two-sided clipping], ``top_entropy_quantile`` [1.0; < 1 keeps
        the policy term on each micro-batch's highest-entropy tokens], ``sapo_temperature_pos`` [1.0] and
        ``sapo_temperature_neg`` [1.05] (``loss_type="sapo"``) (all: ``grpo.policy_loss_terms``),
        ``gradient_accumulation_steps`` [1], and the
        optimizer fields of :func:`make_optimizer` (used when ``optimizer`` is None).
      optimizer: the transformation the train state was made with (default
        ``make_optimizer(config)``).
      donate: donate the input train state's buffers to the output (saves memory; the caller's
        old state is then invalid).

    The batch (a dict; every leaf except under ``"shared"`` has leading dim ``B``):
      ``completion_mask`` [B, T], ``advantages`` [B] f32 (from ``grpo.group_advantages``),
      ``old_logprobs`` [B, T] f32 (rollout log-probs; if absent the ratio is exactly 1 via
      ``stop_gradient`` of the current log-probs, as TRL does for ``num_iterations == 1``),
      ``ref_logprobs`` [B, T] f32 (precomputed by the caller with LoRA switched off; required when
      ``beta > 0``), ``truncated`` [B] bool (required with ``mask_truncated_completions``),
      ``rollout_is_weights`` [B, T] f32 (optional: each token's weight on the clipped policy term, the
      sampler-mismatch correction of ``grpo.rollout_importance_weights``, TRL's
      ``importance_sampling_ratio``; taken as data, never differentiated; absent: 1), plus
      whatever ``logprob_fn`` reads (tokens, positions, ...).

    Gradient accumulation: the batch is split into ``gradient_accumulation_steps`` micro-batches
    scanned with ``lax.scan``; each micro-batch's numerator is divided by the normaliser of the
    whole batch (``grpo.loss_normalizer``), so the summed gradient equals the single-batch one; for
    ``bnpo``, as in TRL, by its own token count times the number of micro-batches instead (the mean of
    the micro-batches' token means).

    A non-finite loss, gradient or parameter update leaves params and optimizer state bit-identical
    and increments ``skipped_updates``.

    Returns: the jitted function. Its metrics (float32 scalars): ``loss``, ``grad_norm`` (before
    clipping), ``learning_rate`` (of this update, from ``config``'s schedule fields; only when
    ``config`` defines a schedule: ``max_steps`` set or a constant one), ``update_skipped`` (0/1),
    ``skipped_updates`` (cumulative), ``num_tokens``, ``clip_ratio/low_mean``,
    ``clip_ratio/high_mean``, ``clip_ratio/region_mean``, ``entropy``, and ``kl`` when the batch
    has ``ref_logprobs``.

    Raises:
      ValueError: here, for bad config values (loss type, clip range, KL estimator, accumulation
        steps, ``importance_sampling_level`` other than ``"token"`` or ``"sequence"``, ``delta`` not a
        float > 1, ``top_entropy_quantile`` outside [0, 1]); at trace time (the first
        call), for a malformed batch.
    """
    loss_type = _opt(config, "loss_type", "grpo")
    epsilon = float(_opt(config, "epsilon", 0.2))
    epsilon_high = _opt(config, "epsilon_high", None)
    beta = float(_opt(config, "beta", 0.0))
    kl_estimator = _opt(config, "kl_estimator", "k3")
    max_len = _opt(config, "max_completion_length", None)
    mask_trunc = bool(_opt(config, "mask_truncated_completions", False))
    is_level = _opt(config, "importance_sampling_level", "token")
    delta = _opt(config, "delta", None)
    top_entropy_quantile = _opt(config, "top_entropy_quantile", 1.0)
    sapo_temperatures = (_opt(config, "sapo_temperature_pos", 1.0), _opt(config, "sapo_temperature_neg", 1.05))
    grpo._check_loss_extras(is_level, delta, top_entropy_quantile, loss_type, sapo_temperatures)
    num_micro = int(_opt(config, "gradient_accumulation_steps", 1))
    if num_micro < 1:
        raise ValueError(f"gradient_accumulation_steps must be >= 1, got {num_micro}")
    grpo._check_loss_options(loss_type, epsilon, epsilon_high, beta, kl_estimator)
    if optimizer is None:
        optimizer = make_optimizer(config)
    schedule = make_lr_schedule(config) if _has_schedule(config) else None

    def update_step(train_state: TrainState, batch: Mapping[str, Any], step, key):
        params = train_state.params
        if beta and "ref_logprobs" not in batch:
            raise ValueError("beta > 0 needs batch['ref_logprobs'] (log-probs with LoRA off)")
        normalizer = grpo.loss_normalizer(
            batch["completion_mask"], loss_type=loss_type, max_completion_length=max_len,
            truncated=batch.get("truncated"), mask_truncated_completions=mask_trunc)
        micro = _split_batch(batch, num_micro)
        shared = batch.get("shared", {})
        extra = {"step": jnp.asarray(step, jnp.int32), "key": key}

        def micro_loss(p, mb):
            logprobs, entropy = logprob_fn(p, {**mb, "shared": shared, **extra})
            terms = grpo.policy_loss_terms(
                logprobs, mb.get("old_logprobs"), mb["advantages"], mb["completion_mask"],
                loss_type=loss_type, epsilon=epsilon, epsilon_high=epsilon_high, beta=beta,
                ref_logprobs=mb.get("ref_logprobs"), kl_estimator=kl_estimator,
                entropy=entropy, truncated=mb.get("truncated"),
                mask_truncated_completions=mask_trunc, rollout_is_weights=mb.get("rollout_is_weights"),
                importance_sampling_level=is_level, delta=delta, top_entropy_quantile=top_entropy_quantile,
                sapo_temperature_pos=sapo_temperatures[0], sapo_temperature_neg=sapo_temperatures[1])
            # bnpo (TRL): each micro-batch's token mean, averaged over the micro-batches; the others: one
            # normaliser for the whole batch
            denom = terms["tokens"] * num_micro if loss_type == "bnpo" else normalizer
            loss = terms["loss_sum"] / jnp.maximum(denom, 1.0)
            return loss, {**terms, "loss": loss}

        grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

        def body(carry, mb):
            g_acc, t_acc = carry
            (_, terms), g = grad_fn(params, mb)
            g_acc = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), g_acc, g)
            t_acc = jax.tree.map(jnp.add, t_acc, terms)
            return (g_acc, t_acc), None

        g0 = jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32), params)
        t0 = {k: jnp.zeros((), jnp.float32) for k in
              ("loss", "loss_sum", "tokens", "clip_low", "clip_high", "clip_region", "kl", "entropy")}
        (grads, terms), _ = jax.lax.scan(body, (g0, t0), micro)
        grads = jax.tree.map(lambda g, p: g.astype(jnp.asarray(p).dtype), grads, params)
        _, loss_metrics = grpo.finalize_policy_loss(terms, normalizer)
        loss = terms["loss"]  # the sum of the micro-batches' losses: the loss the gradient is of

        grad_norm = _global_norm(grads)
        updates, new_opt_state = optimizer.update(grads, train_state.opt_state, params)
        # the update too: finite gradients can still give a non-finite step (an infinite learning rate or
        # weight decay, an optimizer state gone bad), which would write NaN into the adapter
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(_global_norm(updates))
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jnp.where(ok, new, old)
        new_state = TrainState(
            params=jax.tree.map(keep, new_params, params),
            opt_state=jax.tree.map(keep, new_opt_state, train_state.opt_state),
            num_updates=train_state.num_updates + ok.astype(jnp.int32),
            skipped_updates=train_state.skipped_updates + (~ok).astype(jnp.int32),
        )
        metrics = {"loss": loss, "grad_norm": grad_norm,
                   "update_skipped": (~ok).astype(jnp.float32),
                   "skipped_updates": new_state.skipped_updates.astype(jnp.float32),
                   **loss_metrics}
        if schedule is not None:
            metrics["learning_rate"] = schedule(train_state.num_updates)
        if "ref_logprobs" not in batch:
            metrics.pop("kl")
        return new_state, metrics

    return jax.jit(update_step, donate_argnums=(0,) if donate else ())


def _global_norm(tree) -> jax.Array:
    """sqrt of the sum of squares of every leaf (float32); inf/NaN if any leaf is non-finite."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                        for x in jax.tree_util.tree_leaves(tree)))


def _has_schedule(config: Any) -> bool:
    """Whether ``config`` defines a schedule make_lr_schedule can build (for the lr metric)."""
    kind = _opt(config, "lr_scheduler_type", "cosine")
    return kind in ("constant", "constant_with_warmup") or _opt(config, "max_steps", None) is not None
