"""Adaptive Quantization Noise (AQN): Gaussian noise folded into RMSNorm scales.

QeRL (Huang et al., "QeRL: Beyond Efficiency -- Quantization-enhanced
Reinforcement Learning for LLMs", NVlabs 2025, Sec. 3.3) perturbs the frozen
model with channel-wise Gaussian noise to raise policy entropy early in
training, and folds that noise into the RMSNorm scale vectors so that it costs
nothing at run time::

    RMSNorm_noisy(x) = (w + z) * x / rms(x),   z ~ N(0, sigma(step)^2 I),  z in R^D

The noise is added to each decoder layer's attention-input norm
(``input_norm``) and MLP-input norm (``post_attn_norm``), never to the final
norm. ``sigma`` follows a staged geometric decay (:func:`sigma`), a smooth
exponential decay (:func:`exponential_sigma`), or is 0 (``kind="off"``).

Everything here is a pure function of ``(key, step)``: there is no state, and a
resumed run draws exactly the noise it would have drawn had it not stopped.

Differences from the original implementation (deliberate):

* The noise is formed and added in float32 (the model adds ``w + z`` in
  float32 before the norm), not bf16 -- in bf16 a sigma of 5e-4 added to
  weights near 1.0 rounds away entirely (bf16 spacing near 1 is 2^-7 ~ 7.8e-3).
* Default: the **same** noise is used for the rollout (sampling) and for the
  update's log-probabilities, so the importance ratio ``pi_theta / pi_old``
  compares the policy that actually generated the samples.
  ``AQNConfig.noise_in_update=False`` is the paper's variant (noise in the
  rollout engine only; the update sees the noiseless model). The trainer
  reads that field itself (``trainer.load_policy``'s ``Policy.update_noise``), as
  :func:`update_noise` does, and then takes the update's own (noiseless) policy as
  the ratio's old one, not the sampler's noisy log-probs, as QeRL's TRL loop does.
* Only the per-layer ``input_norm`` / ``post_attn_norm`` get noise. The released
  code's loop (``trl_trainer/noise_scheduler.py``) adds noise in place to the rollout
  engine's modules of Hugging Face's Qwen2 / Llama RMSNorm classes, which makes no
  exception for the final norm (and there, as it is not reloaded from the trainer
  each step, the noise accumulates).
* Each ``(step, norm, layer)`` has its own ``fold_in`` key, where the released
  code draws from torch's global generator (not reproducible on resume).
* Steps count from 0 here; the released loop's step counter is already 1 at the
  first rollout, so its stage boundaries come one step earlier (a step in 100 at
  K = 10 and T = 100; the stage values are the same).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any, Mapping, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("stages", "exponential", "off")
NORM_NAMES = ("input_norm", "post_attn_norm")  # the final norm gets no noise


@dataclasses.dataclass(frozen=True)
class AQNConfig:
  """Static AQN configuration (hashable: usable as a ``jax.jit`` static arg).

  Attributes:
    kind: ``"stages"`` (the paper's staged decay, :func:`sigma`),
      ``"exponential"`` (smooth decay, :func:`exponential_sigma`) or ``"off"``
      (sigma 0 at every step; :func:`noise` returns zeros).
    sigma_start: noise std of the first noisy stage (dimensionless, relative to
      RMSNorm scales that are O(1)). Paper default 1e-2.
    sigma_end: noise std of the last stage. Paper default 5e-4.
    num_stages: K, the number of equal stages over training (>= 3). Stage 0 is
      noiseless. Paper default 10.
    total_steps: number of RL steps in the run (> 0); ``None`` is allowed at
      construction so that a config can be completed later with
      ``dataclasses.replace``, but every schedule function then raises.
    noise_in_update: ``True`` (default): the noise drawn for a step is used
      both in the rollout and in the update's log-probabilities, so the
      importance ratio is computed against the sampling policy. ``False``: the
      paper's variant -- noise in the rollout only, the update runs the
      noiseless model (the trainer then takes the update's own policy as the
      ratio's old one: the noise acts only through the sampled tokens).
  """

  kind: str = "stages"
  sigma_start: float = 1e-2
  sigma_end: float = 5e-4
  num_stages: int = 10
  total_steps: Optional[int] = None
  noise_in_update: bool = True

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"AQNConfig.kind={self.kind!r}; expected one of {KINDS}")
    if self.kind == "off":
      return
    _check_params(self.sigma_start, self.sigma_end, self.num_stages, self.kind)
    if self.total_steps is not None and int(self.total_steps) <= 0:
      raise ValueError(f"AQNConfig.total_steps={self.total_steps}; must be > 0")


def _check_params(sigma_start, sigma_end, num_stages, kind="stages"):
  if not (float(sigma_start) > 0 and float(sigma_end) > 0):
    raise ValueError(
        f"sigma_start={sigma_start} and sigma_end={sigma_end} must both be > 0 "
        "(use kind='off' for no noise)")
  if kind == "stages" and int(num_stages) < 3:
    raise ValueError(
        f"num_stages={num_stages}; must be >= 3 (stage 0 is noiseless and the "
        "first and last noisy stages are sigma_start and sigma_end)")


def _check_total_steps(total_steps):
  if total_steps is None:
    raise ValueError("total_steps is None; set AQNConfig.total_steps to the run's number of steps")
  if int(total_steps) <= 0:
    raise ValueError(f"total_steps={total_steps}; must be > 0")


def _is_concrete_int(step) -> bool:
  return isinstance(step, (int, np.integer)) and not isinstance(step, bool)


def sigma(step: int, *, total_steps: int, sigma_start: float = 1e-2,
          sigma_end: float = 5e-4, num_stages: int = 10) -> float:
  """The paper's staged AQN noise std at a training step (Python float, fp64).

  With ``K = num_stages`` equal stages over ``total_steps`` steps, the stage of
  ``step`` is ``k = min(floor(step * K / total_steps), K - 1)``. Stage 0 has
  sigma 0 (a noiseless warm-up); stage ``k >= 1`` has
  ``sigma_start * (sigma_end / sigma_start) ** ((k - 1) / (K - 2))``, so stage 1
  is ``sigma_start`` and stage ``K - 1`` (and every step past the end) is
  ``sigma_end``. Source: QeRL Sec. 3.3, "noise scheduler" (exponential decay
  across K stages).

  Args:
    step: 0-based integer step, >= 0.
    total_steps: steps in the run, > 0.
    sigma_start, sigma_end: > 0.
    num_stages: K >= 3.

  Returns:
    sigma as a Python float.

  Raises:
    ValueError: negative step, bad total_steps / sigmas / num_stages.
    TypeError: step is not a Python/NumPy integer (use :func:`sigma_jnp` for a
      traced step).
  """
  if not _is_concrete_int(step):
    raise TypeError(f"step={step!r} ({type(step).__name__}) must be an int; use sigma_jnp for traced steps")
  if step < 0:
    raise ValueError(f"step={step}; must be >= 0")
  _check_total_steps(total_steps)
  _check_params(sigma_start, sigma_end, num_stages)
  k_stages = int(num_stages)
  k = min((int(step) * k_stages) // int(total_steps), k_stages - 1)
  return _stage_value(k, sigma_start, sigma_end, k_stages)


def sigma_jnp(step, *, total_steps: int, sigma_start: float = 1e-2,
              sigma_end: float = 5e-4, num_stages: int = 10) -> jax.Array:
  """:func:`sigma` for a (possibly traced) integer step: float32 scalar.

  Same formula; usable inside ``jax.jit`` with ``step`` an int32 array.
  Negative steps are treated as step 0. The other arguments are static Python
  numbers.

  Raises:
    ValueError: bad total_steps / sigmas / num_stages.
  """
  _check_total_steps(total_steps)
  _check_params(sigma_start, sigma_end, num_stages)
  k_stages = int(num_stages)
  step = jnp.maximum(jnp.asarray(step, jnp.int32), 0)
  # floor(step * K / T) without int32 overflow of step * K: split step = q*T + r.
  q, r = jnp.divmod(step, int(total_steps))
  k = jnp.minimum(q * k_stages + (r * k_stages) // int(total_steps), k_stages - 1)
  # A table of the K stage values computed in fp64 by sigma(), so the traced
  # and Python versions agree to float32 rounding (stage K-1 is sigma_end).
  table = np.array([_stage_value(i, sigma_start, sigma_end, k_stages)
                    for i in range(k_stages)], np.float32)
  return jnp.asarray(table)[k]


def _stage_value(k: int, sigma_start: float, sigma_end: float, num_stages: int) -> float:
  """sigma of stage k (fp64): 0 for stage 0, else the geometric interpolation."""
  if k == 0:
    return 0.0
  return float(sigma_start) * (float(sigma_end) / float(sigma_start)) ** ((k - 1) / (num_stages - 2))


def exponential_sigma(step, *, total_steps: int, sigma_start: float = 1e-2,
                      sigma_end: float = 5e-4):
  """Smooth exponential AQN decay (the alternative to the staged schedule).

  ``sigma(step) = sigma_start * (sigma_end / sigma_start) ** t`` with
  ``t = min(step / (total_steps - 1), 1)`` (``t = 1`` when ``total_steps == 1``):
  ``sigma_start`` at step 0, ``sigma_end`` at the last step and after. No
  noiseless warm-up.

  Args:
    step: int (returns a Python float) or an int array, possibly traced
      (returns a float32 scalar array; negative steps act as 0).
    total_steps: > 0. sigma_start, sigma_end: > 0.

  Raises:
    ValueError: negative Python step or bad parameters.
  """
  _check_total_steps(total_steps)
  _check_params(sigma_start, sigma_end, 3, kind="exponential")
  denom = max(int(total_steps) - 1, 1)
  if _is_concrete_int(step):
    if step < 0:
      raise ValueError(f"step={step}; must be >= 0")
    t = 1.0 if int(total_steps) == 1 else min(int(step) / denom, 1.0)
    return float(sigma_start) * (float(sigma_end) / float(sigma_start)) ** t
  step = jnp.maximum(jnp.asarray(step, jnp.int32), 0)
  t = jnp.minimum(step.astype(jnp.float32) / denom, 1.0)
  if int(total_steps) == 1:
    t = jnp.ones_like(t)
  log_ratio = math.log(float(sigma_end) / float(sigma_start))
  return (float(sigma_start) * jnp.exp(t * jnp.float32(log_ratio))).astype(jnp.float32)


def schedule_sigma(schedule: AQNConfig, step):
  """sigma of ``schedule`` at ``step``.

  Args:
    schedule: an :class:`AQNConfig`.
    step: a Python int (returns a Python float) or an int array, possibly
      traced (returns a float32 scalar array).

  Raises:
    TypeError: ``schedule`` is not an :class:`AQNConfig`.
    ValueError: ``schedule.total_steps`` unset (unless kind is ``"off"``), or a
      negative Python step.
  """
  if not isinstance(schedule, AQNConfig):
    raise TypeError(f"schedule must be an AQNConfig, got {type(schedule).__name__}")
  concrete = _is_concrete_int(step)
  if schedule.kind == "off":
    if concrete and step < 0:
      raise ValueError(f"step={step}; must be >= 0")
    return 0.0 if concrete else jnp.zeros((), jnp.float32)
  kw = dict(total_steps=schedule.total_steps, sigma_start=schedule.sigma_start,
            sigma_end=schedule.sigma_end)
  if schedule.kind == "exponential":
    return exponential_sigma(step, **kw)
  if concrete:
    return sigma(step, num_stages=schedule.num_stages, **kw)
  return sigma_jnp(step, num_stages=schedule.num_stages, **kw)


def norm_shapes_of(model_cfg) -> dict[str, tuple[int, int]]:
  """The AQN target shapes for a model config: ``{name: (L, D)}``.

  Args:
    model_cfg: any object with ``num_layers`` and ``hidden_size`` (the model's
      ``ModelConfig``).

  Returns:
    ``{"input_norm": (L, D), "post_attn_norm": (L, D)}``.

  Raises:
    TypeError: ``model_cfg`` lacks ``num_layers`` or ``hidden_size``.
  """
  try:
    num_layers, hidden = int(model_cfg.num_layers), int(model_cfg.hidden_size)
  except AttributeError as e:
    raise TypeError(f"model_cfg needs num_layers and hidden_size: {e}") from None
  return {name: (num_layers, hidden) for name in NORM_NAMES}


def _name_id(name: str) -> int:
  # Stable across processes and Python versions (unlike hash()).
  return zlib.crc32(name.encode("utf-8")) & 0x7FFFFFFF


def noise(key: jax.Array, step, norm_shapes: Union[Mapping[str, Any], Any],
          schedule: AQNConfig) -> dict[str, jax.Array]:
  """Draw the AQN noise of one training step.

  For each named norm of shape ``(L, D)`` and each layer ``l``, the noise row
  ``z[l]`` is ``sigma(step) * N(0, I_D)`` drawn with the key
  ``fold_in(fold_in(fold_in(key, step), crc32(name)), l)``, so the same
  ``(key, step)`` always gives the same noise (and a resumed run reproduces
  it), different steps/norms/layers get independent noise, and adding a layer
  does not change the other layers' draws.

  Args:
    key: a PRNG key (``jax.random.key`` or a legacy uint32 ``[2]`` key). Use
      one key for the whole run (e.g. ``fold_in(run_key, AQN_STREAM)``).
    step: the training step (Python int or int32 scalar, may be traced).
    norm_shapes: ``{name: (L, D)}`` mapping, normally :func:`norm_shapes_of`
      (``{"input_norm": ..., "post_attn_norm": ...}``), or a model config (then
      :func:`norm_shapes_of` is applied to it).
    schedule: :class:`AQNConfig`.

  Returns:
    ``{name: float32 [L, D]}`` -- the model contract's ``norm_noise``, to be
    added to the norm scales in float32 before the norm is applied. When
    ``schedule.kind == "off"`` (or sigma is 0) the arrays are exact zeros.

  Raises:
    ValueError: a shape that is not 2-D or has a negative dim, a negative or >= 2**32 Python step, or
      schedule problems (see :func:`schedule_sigma`).
    TypeError: a step that is not an integer, ``schedule`` not an :class:`AQNConfig`, or a model config
      without ``num_layers`` / ``hidden_size`` (:func:`norm_shapes_of`).
  """
  if not isinstance(norm_shapes, Mapping):
    norm_shapes = norm_shapes_of(norm_shapes)
  if isinstance(step, bool) or not jnp.issubdtype(jnp.result_type(step), jnp.integer):
    raise TypeError(f"step must be an integer, got {step!r}")  # 55.7 drew step 55's noise
  if isinstance(step, (int, np.integer)) and step >= 2**32:
    raise ValueError(f"step={step} must be < 2**32 (it is folded into the key as a uint32)")
  shapes = {}
  for name, shape in norm_shapes.items():
    shape = tuple(int(s) for s in shape)
    if len(shape) != 2 or min(shape) < 0:
      raise ValueError(f"norm_shapes[{name!r}]={shape}; expected (num_layers, hidden), both >= 0")
    shapes[name] = shape
  # First, so that a non-AQNConfig schedule and a negative Python step raise as documented
  # (TypeError / ValueError) for every kind, "off" included.
  s = jnp.asarray(schedule_sigma(schedule, step), jnp.float32)
  if schedule.kind == "off":
    return {name: jnp.zeros(shape, jnp.float32) for name, shape in shapes.items()}
  step_key = jax.random.fold_in(key, jnp.asarray(step, jnp.uint32))
  out = {}
  for name, (num_layers, hidden) in shapes.items():
    name_key = jax.random.fold_in(step_key, _name_id(name))
    layer_keys = jax.vmap(lambda l: jax.random.fold_in(name_key, l))(
        jnp.arange(num_layers, dtype=jnp.uint32))
    z = jax.vmap(lambda k: jax.random.normal(k, (hidden,), jnp.float32))(layer_keys)
    # The barrier stops XLA from fusing the scale into the normal sampler's
    # arithmetic, which otherwise changes the last bit between an eager call and
    # a call inside a larger jit (the sampler's and the update's programs).
    out[name] = s * jax.lax.optimization_barrier(z)
  return out


def update_noise(norm_noise: Optional[Mapping[str, jax.Array]],
                 schedule: AQNConfig) -> Optional[Mapping[str, jax.Array]]:
  """The noise the update step should use, given the rollout's noise.

  Returns ``norm_noise`` unchanged when ``schedule.noise_in_update`` (the
  default: rollout and update see the same perturbed policy) and ``None`` (no
  noise) for the paper's rollout-only variant.
  """
  return norm_noise if schedule.noise_in_update else None


def metrics(schedule: AQNConfig, step) -> dict[str, Any]:
  """Logging helper: ``{"aqn/sigma": sigma}`` for ``step`` (float, or float32 array if traced).

  Raises:
    As :func:`schedule_sigma`.
  """
  return {"aqn/sigma": schedule_sigma(schedule, step)}
