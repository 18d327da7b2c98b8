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
samples do not depend on the shape bucket it was padded into (they do depend on
its index ``r``: the same prompt at another row index samples other tokens).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax import models

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
    temperature: softmax temperature; ``0`` = greedy (argmax), top-k/top-p ignored; otherwise at
      least float32's smallest normal number (about 1.18e-38).
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
    kv_phases: decode in this many phases with a growing KV cache: phase ``i``
      holds ``prompt bucket + ceil(T * (i + 1) / kv_phases)`` slots. The XLA
      attention path (CPU, float32 models) then reads fewer empty slots (about
      ``(n + 1) / 2n`` of the completion slots on average instead of all); the
      GPU decode-attention kernel reads only written slots anyway, so there it
      only lowers the cache's memory in early phases. Each phase compiles its
      own decode step; the cache is copied once per phase boundary. 1 = one
      cache of ``prompt bucket + T`` slots from the start.
    unroll_decode: unroll the decode step's layer loop (default;
      :func:`qerl_jax.models.forward`'s ``unroll_layers``): no per-layer
      slicing copies or loop bookkeeping kernels. On an H200 at batch 8
      (Qwen2.5-7B shape, 2048 new tokens) a step took 2.79 instead of 2.93 ms
      with NVFP4 weights and 4.61 instead of 4.80 with bf16; the decode step
      compiled in 6-12 s instead of about 3 (docs/benchmarks_rollout.md,
      session 10). Same tokens and log-probabilities.
    dequantize_min_rows: ``0`` (default) keeps a 4-bit base 4-bit throughout. Otherwise,
      when the decode rows (the batch bucket times ``num_generations``) are at least
      this many, the 4-bit linears of the base (all, or those ``dequantize_max_weights``
      picks) are dequantized to the compute dtype once, at the start of the call, and
      prefill and decode run on that dense copy; it lives for the rollout and costs
      ``K x N x itemsize`` bytes a layer and linear (13.1 GB for all the linears of
      Qwen2.5-7B in bf16, reported in ``metrics["dequantized_base_bytes"]``). It was
      added when a decode step of more than 128 rows had no 4-bit kernel and
      dequantized every layer each step (H200, Qwen2.5-7B shape, batch 256: 0.72x of
      bf16's tokens/s without it, 1.01x with it, session 18); since session 46 the
      Gluon GEMM takes those rows on sm_90 (1.04x of bf16 at batch 256 on an H100,
      session 55). The values are those of the large-M matmul path, so tokens may
      differ from the 4-bit kernels' (different rounding), as they do between batch
      sizes.
    dequantize_max_weights: with ``dequantize_min_rows``, copy only the linears of at
      most this many weights a layer (``K x N``); ``0`` (default): every linear. The
      small matrices are where the 4-bit products trail bf16 at many rows (H100,
      session 55, ``bench_kernels.py``: the Qwen2.5-7B q/k/v at 0.77x / 0.58x and o at
      0.82x / 0.64x of bf16 at M = 128 / 256, while gate and down run at 0.97-1.45x), and
      they are a small part of the weights: ``20_000_000`` copies the 7B's q/k/v
      (16.5M weights fused) and o (12.8M), 1.6 GB in bf16 for 28 layers.

  Raises:
    ValueError: naming the field, for a value out of range or of the wrong kind (ids that
      are not ints >= 0, a float where an int is due, a ``cache_dtype`` that is not floating).
    TypeError: ``unroll_decode`` or ``early_stop`` not a bool; id fields neither an int nor iterable.
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
  kv_phases: int = 1
  unroll_decode: bool = True
  dequantize_min_rows: int = 0
  dequantize_max_weights: int = 0

  def __post_init__(self):
    # Accept lists for the id fields but store tuples (hashable).
    object.__setattr__(self, "eos_token_ids", _as_ids(self.eos_token_ids, "eos_token_ids"))
    object.__setattr__(self, "stop_token_ids", _as_ids(self.stop_token_ids, "stop_token_ids"))
    if not _is_int(self.pad_id) or self.pad_id < 0:
      raise ValueError(f"SamplingConfig.pad_id must be an int >= 0 (a token id), got {self.pad_id!r}")
    if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
      raise ValueError(f"SamplingConfig.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
    if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
      raise ValueError(
          f"SamplingConfig.min_new_tokens must be an int in [0, max_new_tokens={self.max_new_tokens}], "
          f"got {self.min_new_tokens!r}")
    if not self.eos_token_ids:
      raise ValueError("SamplingConfig.eos_token_ids is empty: give every end-of-sequence id of the checkpoint")
    if not (_is_real(self.temperature) and math.isfinite(self.temperature)
            and (self.temperature == 0 or self.temperature >= _MIN_TEMPERATURE)):
      raise ValueError(f"SamplingConfig.temperature must be 0 (greedy) or a finite float >= {_MIN_TEMPERATURE:.3g} "
                       f"(float32's smallest normal number), got {self.temperature!r}")
    object.__setattr__(self, "temperature", float(self.temperature))  # numpy scalars too; a plain float
    if not (_is_real(self.top_p) and 0.0 < self.top_p <= 1.0):
      raise ValueError(f"SamplingConfig.top_p must be a float in (0, 1], got {self.top_p!r}")
    object.__setattr__(self, "top_p", float(self.top_p))
    if not _is_int(self.top_k) or self.top_k < 0:
      raise ValueError(f"SamplingConfig.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
    if not _is_int(self.kv_phases) or not 1 <= self.kv_phases <= self.max_new_tokens:
      raise ValueError(f"SamplingConfig.kv_phases must be an int in [1, max_new_tokens], got {self.kv_phases!r}")
    if not isinstance(self.unroll_decode, bool):
      raise TypeError(f"SamplingConfig.unroll_decode must be a bool, got {self.unroll_decode!r}")
    if not isinstance(self.early_stop, bool):
      raise TypeError(f"SamplingConfig.early_stop must be a bool, got {self.early_stop!r}")
    if not _is_int(self.num_generations) or self.num_generations < 1:
      raise ValueError(f"SamplingConfig.num_generations must be an int >= 1, got {self.num_generations!r}")
    if not _is_int(self.dequantize_min_rows) or self.dequantize_min_rows < 0:
      raise ValueError(f"SamplingConfig.dequantize_min_rows must be an int >= 0 (0 = never), "
                       f"got {self.dequantize_min_rows!r}")
    if not _is_int(self.dequantize_max_weights) or self.dequantize_max_weights < 0:
      raise ValueError(f"SamplingConfig.dequantize_max_weights must be an int >= 0 (0 = every linear), "
                       f"got {self.dequantize_max_weights!r}")
    try:
      floating = jnp.issubdtype(jnp.dtype(self.cache_dtype), jnp.floating)
    except TypeError:
      floating = False
    if not floating:
      raise ValueError(f"SamplingConfig.cache_dtype must be a floating dtype (e.g. jnp.bfloat16), "
                       f"got {self.cache_dtype!r}")

  def dequantizes(self, decode_rows: int) -> bool:
    """Whether a rollout of ``decode_rows`` rows (batch bucket x ``num_generations``) runs on a
    dense copy of a 4-bit base (``dequantize_min_rows``)."""
    return 0 < self.dequantize_min_rows <= decode_rows

  @property
  def end_ids(self) -> tuple[int, ...]:
    """Every id that ends a row: ``eos_token_ids + stop_token_ids`` (deduplicated, order kept)."""
    return tuple(dict.fromkeys(self.eos_token_ids + self.stop_token_ids))

  @property
  def greedy(self) -> bool:
    """True when ``temperature == 0``: every token is the argmax (top-p and top-k do not apply)."""
    return self.temperature == 0

  def phase_ends(self) -> tuple[int, ...]:
    """Completion steps at which each decode phase ends: ``ceil(T * (i + 1) / kv_phases)``."""
    n, t = self.kv_phases, self.max_new_tokens
    return tuple(-(-t * (i + 1) // n) for i in range(n))


_MIN_TEMPERATURE = float(np.finfo(np.float32).tiny)  # below it a float32 temperature flushes to 0 on GPUs


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _as_ids(ids, name) -> tuple[int, ...]:
  """``ids`` (one id or an iterable of them) as a tuple of Python ints.

  Raises:
    TypeError: ``ids`` is neither an int nor iterable.
    ValueError: an id that is not an int >= 0 (a float is not truncated, a string not parsed).
  """
  if _is_int(ids):
    ids = (ids,)
  try:
    ids = tuple(ids)
  except TypeError:
    raise TypeError(f"SamplingConfig.{name} must be a tuple of ints, got {ids!r}") from None
  bad = [i for i in ids if not _is_int(i) or i < 0]
  if bad:
    raise ValueError(f"SamplingConfig.{name} must hold token ids (ints >= 0), got {bad!r} in {ids!r}")
  return tuple(int(i) for i in ids)


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
    policy_logprobs: float32 ``[B*G, T]``, the policy's log-probability at the
      sampling temperature, ``log_softmax(logits / temperature)`` (temperature 1
      for greedy) with no top-k / top-p filtering and no min-new-tokens mask:
      what a full forward over prompt + completion gives
      (``models.token_logprobs(..., temperature=temperature)``), and the old
      log-probs of the trainer's importance ratio (TRL divides the logits by the
      temperature in the same way). With top_k 0, top_p 1 and past
      ``min_new_tokens`` it equals ``logprobs``. 0 where ``mask`` is 0.
    mask: int32 ``[B*G, T]``, 1 up to and including each row's first end token,
      0 after it.
    lengths: int32 ``[B*G]``, tokens with mask 1 (end token included).
    finished: bool ``[B*G]``, the row emitted an end token.
    truncated: bool ``[B*G]``, the row hit ``max_new_tokens`` without ending
      (``truncated == ~finished``).
    prompt_tokens: int32 ``[B*G, P]``, each row's prompt (left-padded, as given).
    prompt_mask: int32 ``[B*G, P]``, 1 on real prompt tokens.
    metrics: dict of scalars: ``kv_cache_bytes`` (int, bytes of the decode KV
      cache), ``dequantized_base_bytes`` (int, the dense copy of the base,
      0 without one; ``SamplingConfig.dequantize_min_rows``), ``decode_steps``
      (int32 jax scalar, forward calls after prefill, which samples token 0),
      ``bucket_batch`` / ``bucket_prompt_len`` (ints, the compiled shape),
      ``generated_tokens`` (int32 jax scalar, ``sum(lengths)``).
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
    temperature: >= float32's smallest normal number (about 1.18e-38; use :func:`sample_tokens`
      for greedy). The logits are shifted by their row maximum before the division, so a tiny
      temperature gives a point mass, never NaN.
    top_k: keep tokens whose logit is >= the k-th largest (ties at the
      threshold are kept); 0 = off.
    top_p: nucleus mass in (0, 1]: sorted by probability, token ``i`` is kept
      when the mass of the tokens before it is < ``top_p`` (so the smallest set
      reaching ``p``; ties with the last kept logit are kept too); 1 = off.

  Returns:
    float32 ``[..., V]``: ``log_softmax`` renormalised over the kept tokens,
    ``-inf`` on the removed ones.

  Raises:
    ValueError: temperature below float32's smallest normal number (0 included), top_p outside
      (0, 1], top_k < 0.
  """
  if not temperature >= _MIN_TEMPERATURE:
    raise ValueError(f"sampling_logprobs: temperature must be >= {_MIN_TEMPERATURE:.3g} (float32's smallest normal "
                     f"number; 0 is greedy), got {temperature}")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"sampling_logprobs: top_p must be in (0, 1], got {top_p}")
  if top_k < 0:
    raise ValueError(f"sampling_logprobs: top_k must be >= 0, got {top_k}")
  x = logits.astype(jnp.float32)
  if temperature != 1.0:
    # shifted by the row's max first (softmax is shift-invariant): at a tiny temperature x / T would
    # overflow to inf and inf - inf to NaN, where (x - max) / T is <= 0 (-inf at worst, never NaN)
    x = (x - jnp.max(x, axis=-1, keepdims=True)) / jnp.float32(temperature)
  vocab = x.shape[-1]
  threshold = None
  if 0 < top_k < vocab:
    top_vals, _ = jax.lax.top_k(x, top_k)  # sorted descending, [..., k]
    threshold = top_vals[..., -1:]
    sorted_desc = top_vals
  elif top_p < 1.0:
    sorted_desc = -jnp.sort(-x, axis=-1)
  if top_p < 1.0:
    if threshold is None:
      probs = jax.nn.softmax(sorted_desc, axis=-1)
    else:  # over the whole top-k set, logits tied with the k-th included (as HF's and vLLM's top-k keep them)
      lse = jax.nn.logsumexp(jnp.where(x >= threshold, x, NEG_INF), axis=-1, keepdims=True)
      probs = jnp.exp(sorted_desc - lse)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < jnp.float32(top_p)  # always true at index 0
    n_keep = jnp.sum(keep, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(sorted_desc, n_keep - 1, axis=-1)
  if threshold is not None:
    x = jnp.where(x >= threshold, x, NEG_INF)
  return jax.nn.log_softmax(x, axis=-1)


INVERSE_CDF = 0  # 1: sample_tokens draws a token by inverse-CDF sampling over vocabulary chunks (one uniform
  # number a row; draw_by_inverse_cdf); 0 (default): the Gumbel-max trick (jax.random.categorical: one Gumbel
  # number per vocabulary entry). Read at trace time. Same distribution; for a given key the two give different
  # tokens. Measured on an H200 (session 29; 7B shape, NVFP4, batch 8, 512 new tokens, alternating): a decode step
  # 2.117 / 2.116 ms with 1 against 2.104 / 2.106 with 0, so XLA's chunk sums, running sums and gathers cost more
  # than the Gumbel numbers they save (docs/benchmarks.md "Session 29")
DRAW_CHUNKS = 128  # the vocabulary chunks draw_by_inverse_cdf sums first (at most; fewer for small vocabularies)


def _draw_chunks(vocab: int) -> int:
  return max(1, min(DRAW_CHUNKS, math.isqrt(vocab)))


def draw_by_inverse_cdf(key: jax.Array, log_weights: jax.Array) -> tuple[jax.Array, jax.Array]:
  """One token per row, drawn with probability ``softmax(log_weights)`` by inverse-CDF sampling.

  Each row takes one uniform number ``u`` in [0, 1) and returns the first token whose cumulative
  weight exceeds ``u`` times the row's total (the inverse transform method; Devroye 1986,
  "Non-Uniform Random Variate Generation", section 2.1). The vocabulary is cut into ``C`` chunks
  (:data:`DRAW_CHUNKS`, at most ``sqrt(V)``): the chunks' weights are summed first, the chunk is
  chosen from their running sum, and only that chunk's ``ceil(V / C)`` weights get a running sum.
  This costs one random number a row, where the Gumbel-max trick (``jax.random.categorical``) needs
  one a vocabulary entry. Weights are ``exp(log_weights - max)`` in float32; a token of weight 0
  (``-inf``) is never drawn, and neither is one beyond the last chunk with weight.

  Args:
    key: one PRNG key (independent draws for every row) or a batch of keys matching
      ``log_weights.shape[:-1]`` (one a row; new-style typed or raw ``uint32`` keys).
    log_weights: float ``[..., V]``, unnormalised log-probabilities (computed in float32); ``-inf``
      excludes a token. A row with no finite entry draws token 0 with ``lse`` ``-inf``.

  Returns:
    ``(tokens int32 [...], lse float32 [...])``: the drawn tokens and each row's
    ``logsumexp(log_weights)`` (so ``log_weights[token] - lse`` is the token's log-probability).

  Raises:
    nothing of its own; a key that is neither one key nor one a row fails in ``jax.random.uniform``.
  """
  x = log_weights.astype(jnp.float32)
  lead, vocab = x.shape[:-1], x.shape[-1]
  rows = math.prod(lead)
  x = x.reshape(rows, vocab)
  if _is_batched_key(key, len(lead)):
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(_flat_keys(key, len(lead)))
  else:
    u = jax.random.uniform(key, (rows,), jnp.float32)
  c = _draw_chunks(vocab)
  width = -(-vocab // c)
  if c * width != vocab:
    x = jnp.pad(x, ((0, 0), (0, c * width - vocab)), constant_values=NEG_INF)
  m = jnp.max(x, axis=-1)
  m = jnp.where(jnp.isfinite(m), m, 0.0)  # a row of -inf: all weights 0 (no NaN)
  chunks = x.reshape(rows, c, width)
  chunk_sums = jnp.sum(jnp.exp(chunks - m[:, None, None]), axis=-1)  # [rows, C]
  running = jnp.cumsum(chunk_sums, axis=-1)
  total = running[:, -1]
  target = u * total
  chunk = _first_past(running, target, chunk_sums)
  before = jnp.where(chunk > 0, jnp.take_along_axis(running, jnp.maximum(chunk - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
  inner_w = jnp.exp(jnp.take_along_axis(chunks, chunk[:, None, None], axis=1)[:, 0] - m[:, None])  # [rows, width]
  inner = _first_past(before[:, None] + jnp.cumsum(inner_w, axis=-1), target, inner_w)
  tokens = jnp.where(total > 0, chunk * width + inner, 0).astype(jnp.int32)  # (no weight at all: token 0)
  lse = jnp.where(total > 0, m + jnp.log(total), NEG_INF)
  return tokens.reshape(lead), lse.reshape(lead)


def _first_past(running: jax.Array, target: jax.Array, weights: jax.Array) -> jax.Array:
  """int ``[rows]``: the first index whose running sum ``[rows, n]`` exceeds ``target [rows]``. It has weight (its
  weight raised the running sum past the target); where none does (``u * total`` rounded up to the total), the
  last index with weight ``> 0`` in ``weights [rows, n]``."""
  above = running > target[:, None]
  last_with_weight = (weights.shape[-1] - 1) - jnp.argmax((weights > 0)[:, ::-1], axis=-1)
  return jnp.where(jnp.any(above, axis=-1), jnp.argmax(above, axis=-1), last_with_weight)


def _flat_keys(key: jax.Array, batch_ndim: int) -> jax.Array:
  """A batch of keys ``[...]`` (:func:`_is_batched_key`) as ``[rows]`` (raw ``uint32`` keys keep their key axis)."""
  return key.reshape((-1,) + key.shape[batch_ndim:])


def sample_tokens(key: jax.Array, logits: jax.Array, *, temperature: float, top_k: int = 0,
                  top_p: float = 1.0) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Draw one token per row and return it with its log-probabilities.

  Args:
    key: PRNG key(s): one key for all rows (still independent draws per row) or a
      batch of keys ``[...]`` matching ``logits.shape[:-1]`` (one key per row).
    logits: float ``[..., V]`` (already min-new-tokens masked if wanted).
    temperature, top_k, top_p: see :class:`SamplingConfig`; temperature 0 is
      greedy (argmax of ``logits``; the first index wins ties).

  The token is drawn by ``jax.random.categorical`` (the Gumbel-max trick; the default) or, with
  :data:`INVERSE_CDF` = 1, by :func:`draw_by_inverse_cdf` (one uniform number a row). At temperature 1
  with no top-k / top-p the sampling distribution is the raw one, and the inverse-CDF path then
  needs no ``[..., V]`` log-softmax: both log-probabilities are ``logits[token] - logsumexp(logits)``.

  Returns:
    ``(tokens int32 [...], sample_logprob f32 [...], policy_logprob f32 [...])``:
    the log-probability under the sampling distribution (0 for greedy) and
    under the policy at the sampling temperature, ``log_softmax(logits / temperature)`` with no top-k /
    top-p (``log_softmax(logits)`` for greedy): what the trainer's forward gives at that temperature, as
    TRL computes the policy's log-probs (logits divided by the temperature).

  Raises:
    ValueError: ``temperature`` < 0 or above 0 but below float32's smallest normal number (1.18e-38; 0 is
      greedy), ``top_p`` outside (0, 1] or ``top_k`` < 0
      (:func:`sampling_logprobs`).
  """
  unfiltered = temperature == 1.0 and (top_k == 0 or top_k >= logits.shape[-1]) and top_p == 1.0
  if temperature != 0:
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  if INVERSE_CDF and unfiltered:  # the sampling distribution is the raw one: no [..., V] log-softmax at all
    x = logits.astype(jnp.float32)
    tokens, lse = draw_by_inverse_cdf(key, x)
    policy_lp = jnp.take_along_axis(x, tokens[..., None], axis=-1)[..., 0] - lse
    return tokens, policy_lp, policy_lp
  if temperature == 0:
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sample_lp = jnp.zeros(tokens.shape, jnp.float32)
  else:
    lp = sampling_logprobs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    if INVERSE_CDF:
      tokens, _ = draw_by_inverse_cdf(key, lp)
    elif _is_batched_key(key, lp.ndim - 1):
      flat = jax.vmap(lambda k, l: jax.random.categorical(k, l))(_flat_keys(key, lp.ndim - 1),
                                                                 lp.reshape(-1, lp.shape[-1]))
      tokens = flat.reshape(lp.shape[:-1]).astype(jnp.int32)
    else:
      tokens = jax.random.categorical(key, lp, axis=-1).astype(jnp.int32)
    sample_lp = jnp.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0]
  return tokens, sample_lp, policy_logprob(logits, tokens, temperature)


def policy_logprob(logits: jax.Array, tokens: jax.Array, temperature: float) -> jax.Array:
  """float32 ``[...]``: ``log_softmax(logits / temperature)[tokens]``, the policy's log-probability of each
  token at the sampling temperature, before any top-k / top-p or min-new-tokens masking (``logits`` as they are
  for temperature 0, greedy). ``logits`` float ``[..., V]``, ``tokens`` int ``[...]``. What the trainer's forward
  gives at that temperature (TRL divides the logits by it for the policy's log-probs)."""
  x = logits.astype(jnp.float32)
  if temperature not in (0, 1):
    x = x / temperature
  return jnp.take_along_axis(x, tokens[..., None], axis=-1)[..., 0] - jax.nn.logsumexp(x, axis=-1)


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

  Args:
    prompt_tokens: int ``[B, P]``, left-padded.
    prompt_mask: int or bool ``[B, P]``, 1 on real tokens.
    batch, length: the padded shape, ``batch >= B`` and ``length >= P``.
    pad_id: token written in the new positions.

  Returns:
    ``(tokens int32 [batch, length], mask int32 [batch, length])``.

  Raises:
    ValueError: ``batch < B`` or ``length < P``.
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


def _check_norm_noise(norm_noise, shape: tuple) -> None:
  """ValueError for AQN noise that is not ``{name: [L, D]}`` of ``shape``, or (when concrete) not finite: a NaN
  in it made every sampled log-prob NaN, a wrong shape failed deep in the layer scan."""
  if norm_noise is None:
    return
  for name, z in norm_noise.items():
    if tuple(jnp.shape(z)) != tuple(shape):
      raise ValueError(f"generate: norm_noise[{name!r}] has shape {tuple(jnp.shape(z))}; expected [L, D] = {shape}")
    try:
      finite = bool(np.isfinite(np.asarray(z)).all())
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
      continue
    if not finite:
      raise ValueError(f"generate: norm_noise[{name!r}] holds NaN or infinite values")


def validate_prompts(prompt_tokens, prompt_mask, vocab_size: Optional[int] = None) -> None:
  """Check shapes and left padding of concrete prompt arrays.

  Args:
    prompt_tokens: int ``[B, P]``; with ``vocab_size``, its values are checked unless it is traced.
    prompt_mask: int or bool ``[B, P]``, 1 on real tokens; its values are checked
      unless it is traced.
    vocab_size: the model's vocabulary size ``V``: every id, padding included, must be in ``[0, V)`` (an id
      beyond the embedding table reads NaN, which reaches every row of the batch through masked attention;
      a negative id would wrap around to another token).

  Raises:
    TypeError: ``prompt_tokens`` is not an integer array.
    ValueError: rank or shape mismatch, no rows (``B = 0``), a row with no prompt
      token, a mask that is not 0/1, a row that is not left-padded (a 1
      followed by a 0), or (with ``vocab_size``) an id outside ``[0, V)``.
  """
  if not hasattr(prompt_tokens, "ndim") or not hasattr(prompt_mask, "shape"):
    raise TypeError(f"generate: prompt_tokens and prompt_mask must be arrays, got {type(prompt_tokens).__name__} "
                    f"and {type(prompt_mask).__name__}")
  if not jnp.issubdtype(prompt_tokens.dtype, jnp.integer):
    raise TypeError(f"generate: prompt_tokens must hold integer token ids, got dtype {prompt_tokens.dtype}")
  if prompt_tokens.ndim != 2:
    raise ValueError(f"generate: prompt_tokens must be [B, P], got shape {prompt_tokens.shape}")
  if prompt_mask.shape != prompt_tokens.shape:
    raise ValueError(f"generate: prompt_mask shape {prompt_mask.shape} != prompt_tokens shape {prompt_tokens.shape}")
  if prompt_tokens.shape[0] == 0:
    raise ValueError(f"generate: no prompts (prompt_tokens shape {prompt_tokens.shape})")
  try:
    m = np.asarray(prompt_mask)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return  # traced: values unknown here
  if not np.all((m == 0) | (m == 1)):
    raise ValueError("generate: prompt_mask must hold only 0 and 1")
  m = m.astype(np.int32)  # bool masks too: np.diff of bools would be XOR
  empty = np.nonzero(m.sum(-1) == 0)[0]
  if empty.size:
    raise ValueError(f"generate: prompt rows {empty.tolist()} have no tokens (all-zero prompt_mask)")
  not_left = np.nonzero(np.any(np.diff(m, axis=-1) < 0, axis=-1))[0]
  if not_left.size:
    raise ValueError(f"generate: prompt rows {not_left.tolist()} are not left-padded (mask goes 1 -> 0); "
                     "pad on the left, e.g. tokenizer.padding_side = 'left'")
  problem = None if vocab_size is None else models.token_ids_outside(prompt_tokens, vocab_size)
  if problem:
    raise ValueError(f"generate: prompt_tokens {problem} (padding included)")


# ----------------------------------------------------------------------------
# The engine.
# ----------------------------------------------------------------------------


def kv_cache_bytes(cfg_model, batch: int, max_len: int, dtype=jnp.bfloat16) -> int:
  """Bytes of a KV cache for ``batch`` rows of ``max_len`` slots: keys + values
  ``2 * L * batch * max_len * Hkv * head_dim * itemsize`` plus the bool slot mask."""
  kv = 2 * cfg_model.num_layers * batch * max_len * cfg_model.num_kv_heads * cfg_model.head_dim
  return int(kv * jnp.dtype(dtype).itemsize + batch * max_len)


def dequantized_base_bytes(base: dict, dtype, max_weights: int = 0) -> int:
  """Bytes of the dense copy :attr:`SamplingConfig.dequantize_min_rows` makes of ``base``: every
  4-bit linear (with ``max_weights`` > 0, those of at most that many weights a layer, ``K x N``) at
  ``K x N`` elements of ``dtype`` a layer (0 for a base without 4-bit linears)."""
  quantized = [w for w in jax.tree.leaves(base, is_leaf=models.is_quantized)
               if models.dequantizes_linear(w, max_weights)]
  elements = sum(math.prod(w.packed.shape[:-2]) * w.shape[0] * w.shape[1] for w in quantized)
  return int(elements) * jnp.dtype(dtype).itemsize


def _extend_cache(cache: dict, extra: int) -> dict:
  """Append ``extra`` empty slots to every row of a KV cache (k, v ``[L, B, S, Hkv, hd]``, mask ``[B, S]``)."""
  return {"k": jnp.pad(cache["k"], ((0, 0), (0, 0), (0, extra), (0, 0), (0, 0))),
          "v": jnp.pad(cache["v"], ((0, 0), (0, 0), (0, extra), (0, 0), (0, 0))),
          "mask": jnp.pad(cache["mask"], ((0, 0), (0, extra))), "index": cache["index"]}


def _grow_cache(cache: dict, groups: int, extra: int) -> dict:
  """Repeat each prompt's cache ``groups`` times along the batch axis and append ``extra`` empty slots.

  ``{"k","v": [L, B, P, Hkv, hd], "mask": [B, P], "index"}`` ->
  ``{"k","v": [L, B*G, P+extra, Hkv, hd], "mask": [B*G, P+extra], "index"}``.
  """
  if groups > 1:
    cache = {"k": jnp.repeat(cache["k"], groups, axis=1), "v": jnp.repeat(cache["v"], groups, axis=1),
             "mask": jnp.repeat(cache["mask"], groups, axis=0), "index": cache["index"]}
  return _extend_cache(cache, extra)


def _decode_adapter(cfg_model, base, lora):
  """The adapter as prefill and decode use it, built once per rollout outside the decode loop:
  ``a`` / ``b`` cast to the compute dtype (the forward would cast them on every step) and,
  for a fused base, regrouped by :func:`models.fuse_adapter` (two matmuls per fused
  projection instead of two per part). Same results as the per-part float32 tree."""
  lora = models.cast_adapter(lora, jnp.dtype(cfg_model.dtype))
  return models.fuse_adapter(lora, cfg_model) if lora is not None and models.is_fused(base) else lora


def _generate_impl(cfg_model, config: SamplingConfig, lora_scale: float, base, lora, norm_noise,
                   prompt_BxP, mask_BxP, key, num_prompts):
  """The jit-compiled body: one prefill of the B prompts, then decode B*G rows in a while loop."""
  b, p = prompt_BxP.shape
  g, t_max = config.num_generations, config.max_new_tokens
  n = b * g
  end_ids = config.end_ids
  if config.dequantizes(n):  # one dense copy for the whole rollout (see SamplingConfig.dequantize_min_rows)
    base = models.dequantize_base(base, jnp.dtype(cfg_model.dtype), backend="auto",
                                  max_weights=config.dequantize_max_weights)
  fwd = dict(lora=_decode_adapter(cfg_model, base, lora), lora_cfg=lora_scale, norm_noise=norm_noise)

  # Prefill: B prompts once, cache of P slots; then repeat it G times and add T empty slots.
  pos_BxP = models.positions_from_mask(mask_BxP)
  cache = models.init_cache(cfg_model, b, p, dtype=config.cache_dtype)
  hidden_BxPxD, cache = models.forward(cfg_model, base, prompt_BxP, pos_BxP, cache=cache, attn_mask=mask_BxP,
                                       return_hidden=True, **fwd)
  logits_BxV = models.lm_head_logits(cfg_model, base, hidden_BxPxD[:, -1])  # last column is real (left padding)
  ends = config.phase_ends()
  cache = _grow_cache(cache, g, ends[0])
  logits_NxV = jnp.repeat(logits_BxV, g, axis=0)
  next_pos_N = jnp.repeat(pos_BxP[:, -1], g, axis=0) + 1  # position of completion token 0

  rows = jnp.arange(n, dtype=jnp.int32)
  row_keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(rows)
  done_N = rows >= num_prompts * g  # bucket padding rows start finished

  def choose(t, logits, done, bufs):
    """Sample completion token ``t`` for every row; rows already ended get pad / mask 0."""
    tokens_buf, lp_buf, plp_buf, mask_buf = bufs
    raw_logits = logits
    if config.min_new_tokens > 0:
      logits = forbid_tokens(logits, end_ids, t < config.min_new_tokens)
    keys = jax.vmap(lambda k: jax.random.fold_in(k, t))(row_keys)
    tok, lp, plp = sample_tokens(keys, logits, temperature=config.temperature, top_k=config.top_k,
                                 top_p=config.top_p)
    if config.min_new_tokens > 0:  # policy_logprobs: the policy's, not renormalised over the non-end ids
      plp = policy_logprob(raw_logits, tok, config.temperature)
    live = ~done
    tok = jnp.where(live, tok, jnp.int32(config.pad_id))
    col = lambda buf, v: jax.lax.dynamic_update_slice_in_dim(buf, v[:, None].astype(buf.dtype), t, axis=1)
    bufs = (col(tokens_buf, tok), col(lp_buf, jnp.where(live, lp, 0.0)), col(plp_buf, jnp.where(live, plp, 0.0)),
            col(mask_buf, live.astype(jnp.int32)))
    done = done | (live & is_end_token(tok, end_ids))
    return tok, done, bufs

  bufs = (jnp.full((n, t_max), config.pad_id, jnp.int32), jnp.zeros((n, t_max), jnp.float32),
          jnp.zeros((n, t_max), jnp.float32), jnp.zeros((n, t_max), jnp.int32))
  tok, done_N, bufs = choose(jnp.int32(0), logits_NxV, done_N, bufs)

  def body(state):
    t, cache, tok, done, bufs = state
    # Feed completion token t-1 (position next_pos + t - 1, cache slot P + t - 1) and sample token t.
    logits, cache = models.forward(cfg_model, base, tok[:, None], (next_pos_N + t - 1)[:, None], cache=cache,
                                   unroll_layers=config.unroll_decode, **fwd)
    tok, done, bufs = choose(t, logits[:, 0], done, bufs)
    return t + 1, cache, tok, done, bufs

  state = (jnp.int32(1), cache, tok, done_N, bufs)
  for i, end in enumerate(ends):  # kv_phases while loops, each over a longer cache
    if i > 0:
      state = (state[0], _extend_cache(state[1], end - ends[i - 1])) + state[2:]

    def cond(state, end=end):
      t, _, _, done, _ = state
      keep_going = t < end
      if config.early_stop:
        keep_going = keep_going & ~jnp.all(done)
      return keep_going

    state = jax.lax.while_loop(cond, body, state)
  t_end, _, _, done_N, bufs = state
  tokens, lp, plp, mask = bufs
  lengths = jnp.sum(mask, axis=-1).astype(jnp.int32)
  return tokens, lp, plp, mask, lengths, done_N, t_end - 1


_generate_jit = jax.jit(_generate_impl, static_argnums=(0, 1, 2))


def generate(cfg_model, base: dict, prompt_tokens, prompt_mask, key: jax.Array, config: SamplingConfig, *,
             lora: Optional[dict] = None, lora_cfg: Any = None, norm_noise: Optional[dict] = None,
             min_prompt_bucket: int = 16) -> Rollout:
  """Sample ``G = config.num_generations`` completions for each of ``B`` left-padded prompts.

  The prompts are padded up to a shape bucket (batch and prompt length each
  to the next power of two, prompt length at least ``min_prompt_bucket``), so
  a training run compiles once per bucket; the padding rows are dropped from
  the result. Inside one jit-compiled call: prefill the ``B`` prompts once
  (KV cache of the prompt bucket), repeat the cache ``G`` times with
  ``max_new_tokens`` empty slots, then decode in a ``lax.while_loop`` that
  stops once every row has emitted an end token (unless
  ``config.early_stop`` is False). Positions come from the mask
  (``cumsum - 1``), so a left-padded row generates what it would alone.
  Randomness of row ``r = b * G + g`` at completion step ``t`` is
  ``fold_in(fold_in(key, r), t)``: independent of the bucket.

  LoRA and AQN noise go through :func:`qerl_jax.models.forward`, the same code
  as training.

  Args:
    cfg_model: :class:`qerl_jax.models.ModelConfig` (``cfg_model.dtype`` is the compute dtype).
    base: frozen base parameter tree (bf16 or NVFP4/NF4 linears).
    prompt_tokens: int ``[B, P]`` token ids, left-padded.
    prompt_mask: int/bool ``[B, P]``, 1 on real tokens (each row's ones at the end).
    key: a PRNG key (typed or raw uint32 ``[2]``); required even when greedy, where
      its value does not matter.
    config: :class:`SamplingConfig` (a static jit argument).
    lora: optional adapter tree (see :mod:`qerl_jax.models`).
    lora_cfg: LoRA scale: None, a float, or anything with ``.scale``.
    norm_noise: optional AQN noise ``{"input_norm", "post_attn_norm": f32 [L, D]}``.
    min_prompt_bucket: smallest compiled prompt length (tokens).

  Returns:
    :class:`Rollout` with ``B * G`` rows (row ``b * G + g``) and ``T =
    config.max_new_tokens`` columns. ``metrics["kv_cache_bytes"]`` is the size
    of the decode KV cache (bytes, the padded bucket), which dominates the
    sampler's activation memory; ``metrics["dequantized_base_bytes"]`` the dense
    copy of the base made for this rollout (0 when none; ``config.dequantize_min_rows``).

  Raises:
    TypeError: ``config`` is not a :class:`SamplingConfig`, or ``lora_cfg`` has no LoRA scale
      (:func:`qerl_jax.models.lora_scale_of`).
    ValueError: bad prompt shapes, no rows, a row without tokens, a mask that is not 0/1,
      right padding, a token id outside the vocabulary (:func:`validate_prompts`); a ``config.pad_id``
      outside the vocabulary (an end or stop id outside it is allowed: it never ends a row);
      ``norm_noise`` not ``[L, D]`` or (concrete) not finite.
  """
  if not isinstance(config, SamplingConfig):
    raise TypeError(f"generate: config must be a SamplingConfig, got {type(config).__name__}")
  validate_prompts(prompt_tokens, prompt_mask, vocab_size=cfg_model.vocab_size)
  # The pad id is read as a token (the bucket's padding, a finished row's next input): one beyond the embedding
  # table turned the whole batch to NaN. End and stop ids are only compared with sampled tokens; one outside the
  # vocabulary never ends a row, which the benchmarks use to decode a fixed length.
  if not 0 <= config.pad_id < cfg_model.vocab_size:
    raise ValueError(f"generate: SamplingConfig.pad_id={config.pad_id} is outside [0, {cfg_model.vocab_size}) "
                     "(the vocabulary)")
  _check_norm_noise(norm_noise, (cfg_model.num_layers, cfg_model.hidden_size))
  b, p = prompt_tokens.shape
  bb, pb = bucket(b), bucket(p, min_prompt_bucket)
  tokens_np, mask_np = pad_prompts(np.asarray(prompt_tokens), np.asarray(prompt_mask), bb, pb, config.pad_id)
  g = config.num_generations
  tokens, lp, plp, mask, lengths, done, steps = _generate_jit(
      cfg_model, config, models.lora_scale_of(lora_cfg), base, lora, norm_noise, jnp.asarray(tokens_np),
      jnp.asarray(mask_np), key, jnp.int32(b))
  n = b * g
  finished = done[:n]
  metrics = {
      "kv_cache_bytes": kv_cache_bytes(cfg_model, bb * g, pb + config.max_new_tokens, config.cache_dtype),
      "dequantized_base_bytes": (dequantized_base_bytes(base, cfg_model.dtype, config.dequantize_max_weights)
                                 if config.dequantizes(bb * g) else 0),
      "decode_steps": steps,
      "bucket_batch": bb,
      "bucket_prompt_len": pb,
      "generated_tokens": jnp.sum(lengths[:n]),
  }
  return Rollout(
      tokens=tokens[:n], logprobs=lp[:n], policy_logprobs=plp[:n], mask=mask[:n], lengths=lengths[:n],
      finished=finished, truncated=~finished,
      prompt_tokens=jnp.repeat(jnp.asarray(prompt_tokens, jnp.int32), g, axis=0),
      prompt_mask=jnp.repeat(jnp.asarray(prompt_mask, jnp.int32), g, axis=0), metrics=metrics)
