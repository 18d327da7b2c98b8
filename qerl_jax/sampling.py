"""The rollout engine: batched prefill + decode with a KV cache, jit-compiled per shape bucket.

``generate`` turns ``B`` left-padded prompts into ``B * G`` completions (``G`` =
``num_generations``, the GRPO group size) with one prefill per prompt: the
prompt's KV cache is computed once and repeated ``G`` times before decoding.
Decoding runs inside a ``jax.lax.while_loop`` that stops as soon as every row
has emitted an end token (or after ``max_new_tokens``).

Sampling follows the order of Hugging Face's logits processors: min-new-tokens
(end ids forbidden), temperature, top-k, top-p (nucleus sampling, Holtzman et
al. 2020, "The Curious Case of Neural Text Degeneration": keep the smallest set
of most likely tokens whose probability mass reaches ``p``). Temperature 0
means greedy (argmax), with no division.

Everything here is a pure function of its inputs and the PRNG key; each row
``r`` draws its randomness from ``fold_in(fold_in(key, r), step)``, so a row's
samples do not depend on the batch or shape bucket it was padded into.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How to sample completions. Frozen and hashable (it is a static jit argument).

  Attributes:
    max_new_tokens: completion length ``T`` (tokens); the rollout arrays are
      ``[B * G, T]`` and the KV cache holds ``prompt bucket + T`` positions.
    eos_token_ids: ALL end-of-sequence ids of the checkpoint (Qwen2.5-Instruct:
      ``(151645, 151643)``, ``<|im_end|>`` and ``<|endoftext|>``). A row ends at
      its first end token, which is kept in the completion with mask 1.
    pad_id: token written after a row's end (mask 0). It may equal an end id;
      the mask never compares token values with it.
    temperature: softmax temperature; ``0`` = greedy (argmax), top-k/top-p ignored.
    top_p: nucleus mass in ``(0, 1]``; ``1`` disables it.
    top_k: keep the ``k`` most likely tokens; ``0`` disables it. When set, top-p
      is computed over those ``k`` candidates only (no full-vocabulary sort).
    min_new_tokens: end ids are forbidden (logit ``-inf``) before this many
      tokens have been generated (Hugging Face ``MinNewTokensLogitsProcessor``).
    stop_token_ids: extra ids that also end a row (treated exactly like eos).
    num_generations: ``G``, completions per prompt (group size).
    early_stop: stop decoding when every row has ended (``False`` always runs
      ``T`` steps: benchmarks).
    cache_dtype: dtype of the KV cache (bf16 by default).
  """

  max_new_tokens: int
  eos_token_ids: tuple[int, ...]
  pad_id: int
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  min_new_tokens: int = 0
  stop_token_ids: tuple[int, ...] = ()
  num_generations: int = 1
  early_stop: bool = True
  cache_dtype: Any = jnp.bfloat16

  def __post_init__(self):
    # Accept lists for the id fields but store tuples (hashable).
    object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in _as_ids(self.eos_token_ids, "eos_token_ids")))
    object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in _as_ids(self.stop_token_ids, "stop_token_ids")))
    if not isinstance(self.max_new_tokens, (int, np.integer)) or self.max_new_tokens < 1:
      raise ValueError(f"SamplingConfig.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
    if not 0 <= self.min_new_tokens <= self.max_new_tokens:
      raise ValueError(
          f"SamplingConfig.min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}")
    if not self.eos_token_ids:
      raise ValueError("SamplingConfig.eos_token_ids is empty: give every end-of-sequence id of the checkpoint")
    if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0):
      raise ValueError(f"SamplingConfig.temperature must be a finite float >= 0, got {self.temperature!r}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p!r}")
    if not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
      raise ValueError(f"SamplingConfig.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
    if not isinstance(self.num_generations, (int, np.integer)) or self.num_generations < 1:
      raise ValueError(f"SamplingConfig.num_generations must be an int >= 1, got {self.num_generations!r}")

  @property
  def end_ids(self) -> tuple[int, ...]:
    """Every id that ends a row: ``eos_token_ids + stop_token_ids`` (deduplicated, order kept)."""
    return tuple(dict.fromkeys(self.eos_token_ids + self.stop_token_ids))

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def _as_ids(ids, name) -> tuple:
  if isinstance(ids, (int, np.integer)):
    return (ids,)
  try:
    return tuple(ids)
  except TypeError:
    raise TypeError(f"SamplingConfig.{name} must be a tuple of ints, got {ids!r}") from None


@flax.struct.dataclass
class Rollout:
  """``B * G`` sampled completions (row ``b * G + g`` is generation ``g`` of prompt ``b``).

  Attributes:
    tokens: int32 ``[B*G, T]`` completion tokens; after a row's end, ``pad_id``.
    logprobs: float32 ``[B*G, T]``, log-probability of each token under the
      distribution it was sampled from: ``log_softmax`` of the logits after
      min-new-tokens masking, division by the temperature, top-k and top-p
      (renormalised over the kept tokens). Greedy (temperature 0) samples from
      a point mass, so its ``logprobs`` are 0. 0 where ``mask`` is 0.
    policy_logprobs: float32 ``[B*G, T]``, the raw policy's log-probability,
      ``log_softmax(logits)`` at temperature 1 with no filtering: what a full
      forward over prompt + completion gives (``models.token_logprobs``).
      At temperature 1 with top_k 0, top_p 1 and past ``min_new_tokens`` it
      equals ``logprobs``. 0 where ``mask`` is 0.
    mask: int32 ``[B*G, T]``, 1 up to and including each row's first end token,
      0 after it.
    lengths: int32 ``[B*G]``, tokens with mask 1 (end token included).
    finished: bool ``[B*G]``, the row emitted an end token.
    truncated: bool ``[B*G]``, the row hit ``max_new_tokens`` without ending
      (``truncated == ~finished``).
    prompt_tokens: int32 ``[B*G, P]``, each row's prompt (left-padded, as given).
    prompt_mask: int32 ``[B*G, P]``, 1 on real prompt tokens.
    metrics: dict of scalars: ``kv_cache_bytes`` (int, bytes of the decode KV
      cache), ``decode_steps`` (int32, forward calls after prefill),
      ``bucket_batch`` / ``bucket_prompt_len`` (ints, the compiled shape),
      ``generated_tokens`` (int32, ``sum(lengths)``).
  """

  tokens: jax.Array
  logprobs: jax.Array
  policy_logprobs: jax.Array
  mask: jax.Array
  lengths: jax.Array
  finished: jax.Array
  truncated: jax.Array
  prompt_tokens: jax.Array
  prompt_mask: jax.Array
  metrics: dict


# ----------------------------------------------------------------------------
# Logit processing and sampling (pure, shape-generic over leading axes).
# ----------------------------------------------------------------------------


def forbid_tokens(logits: jax.Array, token_ids: Sequence[int], forbid: jax.Array | bool = True) -> jax.Array:
  """Set ``logits[..., id] = -inf`` for ``id`` in ``token_ids`` where ``forbid`` is true.

  Args:
    logits: float ``[..., V]``.
    token_ids: ids to forbid (static; ids >= V are ignored).
    forbid: bool scalar or broadcastable to ``logits.shape[:-1]``.

  Returns:
    float ``[..., V]`` same dtype.
  """
  vocab = logits.shape[-1]
  ids = [int(i) for i in token_ids if 0 <= int(i) < vocab]
  if not ids:
    return logits
  hit = jnp.zeros((vocab,), bool).at[jnp.asarray(ids)].set(True)
  forbid = jnp.asarray(forbid)[..., None]
  return jnp.where(hit & forbid, jnp.asarray(NEG_INF, logits.dtype), logits)


def sampling_logprobs(logits: jax.Array, *, temperature: float, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
  """Log-probabilities of the sampling distribution: temperature, then top-k, then top-p.

  Args:
    logits: ``[..., V]`` (any float dtype; computed in float32).
    temperature: > 0 (use :func:`sample_tokens` for greedy).
    top_k: keep tokens whose logit is >= the k-th largest (ties at the
      threshold are kept); 0 = off.
    top_p: nucleus mass in (0, 1]: sorted by probability, token ``i`` is kept
      when the mass of the tokens before it is < ``top_p`` (so the smallest set
      reaching ``p``; ties with the last kept logit are kept too); 1 = off.

  Returns:
    float32 ``[..., V]``: ``log_softmax`` renormalised over the kept tokens,
    ``-inf`` on the removed ones.

  Raises:
    ValueError: temperature <= 0, top_p outside (0, 1], top_k < 0.
  """
  if not temperature > 0:
    raise ValueError(f"sampling_logprobs: temperature must be > 0 (0 is greedy), got {temperature}")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"sampling_logprobs: top_p must be in (0, 1], got {top_p}")
  if top_k < 0:
    raise ValueError(f"sampling_logprobs: top_k must be >= 0, got {top_k}")
  x = logits.astype(jnp.float32)
  if temperature != 1.0:
    x = x / jnp.float32(temperature)
  vocab = x.shape[-1]
  threshold = None
  if 0 < top_k < vocab:
    top_vals, _ = jax.lax.top_k(x, top_k)  # sorted descending, [..., k]
    threshold = top_vals[..., -1:]
    sorted_desc = top_vals
  elif top_p < 1.0:
    sorted_desc = -jnp.sort(-x, axis=-1)
  if top_p < 1.0:
    probs = jax.nn.softmax(sorted_desc, axis=-1)  # over the top-k set when top_k is on
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < jnp.float32(top_p)  # always true at index 0
    n_keep = jnp.sum(keep, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(sorted_desc, n_keep - 1, axis=-1)
  if threshold is not None:
    x = jnp.where(x >= threshold, x, NEG_INF)
  return jax.nn.log_softmax(x, axis=-1)


def sample_tokens(key: jax.Array, logits: jax.Array, *, temperature: float, top_k: int = 0,
                  top_p: float = 1.0) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Draw one token per row and return it with its log-probabilities.

  Args:
    key: PRNG key(s): one key (shared draw over all rows) or a batch of keys
      ``[...]`` matching ``logits.shape[:-1]`` (one independent draw per row).
    logits: float ``[..., V]`` (already min-new-tokens masked if wanted).
    temperature, top_k, top_p: see :class:`SamplingConfig`; temperature 0 is
      greedy (argmax of ``logits``; the first index wins ties).

  Returns:
    ``(tokens int32 [...], sample_logprob f32 [...], policy_logprob f32 [...])``:
    the log-probability under the sampling distribution (0 for greedy) and
    under ``log_softmax(logits)`` (raw, temperature 1).
  """
  raw = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  if temperature == 0:
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sample_lp = jnp.zeros(tokens.shape, jnp.float32)
  else:
    lp = sampling_logprobs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if _is_batched_key(key, lp.ndim - 1):
      flat_keys = key.reshape((-1,) + key.shape[lp.ndim - 1:])
      flat = jax.vmap(lambda k, l: jax.random.categorical(k, l))(flat_keys, lp.reshape(-1, lp.shape[-1]))
      tokens = flat.reshape(lp.shape[:-1]).astype(jnp.int32)
    else:
      tokens = jax.random.categorical(key, lp, axis=-1).astype(jnp.int32)
    sample_lp = jnp.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0]
  policy_lp = jnp.take_along_axis(raw, tokens[..., None], axis=-1)[..., 0]
  return tokens, sample_lp, policy_lp


def _is_batched_key(key: jax.Array, batch_ndim: int) -> bool:
  if batch_ndim == 0:
    return False
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key.ndim == batch_ndim
  return key.ndim == batch_ndim + 1  # raw uint32 keys carry a trailing key axis


# ----------------------------------------------------------------------------
# End-of-sequence bookkeeping.
# ----------------------------------------------------------------------------


def is_end_token(tokens: jax.Array, end_ids: Sequence[int]) -> jax.Array:
  """bool, same shape as ``tokens``: the token is one of ``end_ids`` (static ids)."""
  ids = jnp.asarray(tuple(end_ids), jnp.int32)
  return jnp.any(tokens[..., None] == ids, axis=-1)


def completion_mask(tokens: jax.Array, end_ids: Sequence[int], pad_id: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Mask a batch of raw completions at each row's first end token.

  Used after the fact (e.g. on completions produced elsewhere); ``generate``
  applies the same rule step by step.

  Args:
    tokens: int ``[N, T]`` generated tokens (anything after the end is ignored).
    end_ids: every end id (eos + stop ids).
    pad_id: written after each row's end token.

  Returns:
    ``(tokens int32 [N, T] with pad after the end, mask int32 [N, T] 1 up to and
    including the first end token, lengths int32 [N], finished bool [N])``.
  """
  tokens = jnp.asarray(tokens, jnp.int32)
  end = is_end_token(tokens, end_ids).astype(jnp.int32)
  ended_before = jnp.cumsum(end, axis=-1) - end  # end tokens strictly before t
  mask = (ended_before == 0).astype(jnp.int32)
  finished = jnp.any(end > 0, axis=-1)
  return jnp.where(mask > 0, tokens, jnp.int32(pad_id)), mask, jnp.sum(mask, axis=-1).astype(jnp.int32), finished


# ----------------------------------------------------------------------------
# Shape buckets.
# ----------------------------------------------------------------------------


def bucket(n: int, minimum: int = 1) -> int:
  """The smallest power of two >= max(n, minimum): the padded size compiled for ``n``.

  Raises:
    ValueError: ``n < 1``.
  """
  if n < 1:
    raise ValueError(f"bucket: size must be >= 1, got {n}")
  return 1 << (max(int(n), int(minimum)) - 1).bit_length()


def pad_prompts(prompt_tokens: np.ndarray, prompt_mask: np.ndarray, batch: int, length: int,
                pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Left-pad ``[B, P]`` prompts to ``[batch, length]``; new rows hold one dummy token.

  The extra columns are prepended (mask 0). Extra rows get ``pad_id`` with
  mask 1 only on the last column, so they are well defined (no fully masked
  attention row) and are dropped from the result.

  Returns:
    ``(tokens int32 [batch, length], mask int32 [batch, length])``.
  """
  b, p = prompt_tokens.shape
  if batch < b or length < p:
    raise ValueError(f"pad_prompts: cannot pad [{b}, {p}] down to [{batch}, {length}]")
  tokens = np.full((batch, length), pad_id, np.int32)
  mask = np.zeros((batch, length), np.int32)
  tokens[:b, length - p:] = prompt_tokens
  mask[:b, length - p:] = prompt_mask
  mask[b:, -1] = 1
  return tokens, mask


def positions_from_mask(mask: jax.Array) -> jax.Array:
  """int32 ``[B, P]`` positions ``cumsum(mask) - 1`` (pad slots get -1 -> clipped to 0).

  With left padding, a row's first real token has position 0, exactly as if
  the row were alone.
  """
  return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def validate_prompts(prompt_tokens, prompt_mask) -> None:
  """Check shapes and left padding of concrete prompt arrays.

  Raises:
    ValueError: rank or shape mismatch, a row with no prompt token, a mask that
      is not 0/1, or a row that is not left-padded (a 1 followed by a 0).
  """
  if prompt_tokens.ndim != 2:
    raise ValueError(f"generate: prompt_tokens must be [B, P], got shape {prompt_tokens.shape}")
  if prompt_mask.shape != prompt_tokens.shape:
    raise ValueError(f"generate: prompt_mask shape {prompt_mask.shape} != prompt_tokens shape {prompt_tokens.shape}")
  if isinstance(prompt_mask, jax.core.Tracer):
    return
  m = np.asarray(prompt_mask)
  if not np.all((m == 0) | (m == 1)):
    raise ValueError("generate: prompt_mask must hold only 0 and 1")
  empty = np.nonzero(m.sum(-1) == 0)[0]
  if empty.size:
    raise ValueError(f"generate: prompt rows {empty.tolist()} have no tokens (all-zero prompt_mask)")
  not_left = np.nonzero(np.any(np.diff(m, axis=-1) < 0, axis=-1))[0]
  if not_left.size:
    raise ValueError(f"generate: prompt rows {not_left.tolist()} are not left-padded (mask goes 1 -> 0); "
                     "pad on the left, e.g. tokenizer.padding_side = 'left'")
