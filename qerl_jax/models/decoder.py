"""The functional decoder: parameters in, logits (and the updated KV cache) out.

Parameter trees are plain nested dicts (see the package docstring). The
``L`` decoder layers are stacked on a leading axis and run under
``jax.lax.scan``, so a 64-layer model compiles one layer body.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from pallas_kernels import decode_attention as decode_attn
from pallas_kernels import append_attention, decode_chain, residual_norm, w4_gluon
from qerl_jax import nf4, nvfp4
from qerl_jax.models import layers
from qerl_jax.models.config import ModelConfig, rope_inv_freq

LINEARS = (("attn", "q"), ("attn", "k"), ("attn", "v"), ("attn", "o"),
           ("mlp", "gate"), ("mlp", "up"), ("mlp", "down"))
# With fused projections (models.fuse_projections) a base has these in place of q/k/v and gate/up.
FUSED_LINEARS = (("attn", "qkv"), ("mlp", "gate_up"))
NORMS = ("input_norm", "post_attn_norm")
# A decode step with fused q/k/v on the GPU kernels runs bias, RoPE, the KV-cache write and attention
# as one kernel (pallas_kernels.decode_attention.decode_attention_append). False keeps them as XLA
# ops around the plain decode-attention kernel (for A/B measurements; read at trace time).
FUSED_DECODE_ATTENTION = True
# A decode step of at most ACCUMULATE_MAX_ROWS rows on the Gluon W4A16 kernel writes a layer's four
# projections into one zeroed float32 buffer (layers.Accumulator): one memset a layer instead of one a
# kernel. On an H200 (7B shape, NVFP4, 512 new tokens; docs/benchmarks.md, session 15) a decode step
# took 2.41 instead of 2.51 ms at batch 8, 2.88 instead of 2.93 at 16 and 3.58 instead of 3.63 at 32,
# but 5.43 instead of 5.39 at batch 64 (its one memset of 12.7 MB and the barrier's extra kernel cost
# more than its four memsets), hence the limit (33-63 not measured). False gives each kernel its own
# output and memset (for A/B measurements; both read at trace time).
ACCUMULATE_DECODE = True
ACCUMULATE_MAX_ROWS = 32
# 1 ends each layer of an accumulating decode step with one kernel, pallas_kernels.residual_norm: the residual
# add of the down-projection (read in place from the buffer), the next layer's input norm (the final norm after
# the last layer) with its AQN noise, and the next layer's accumulator zeroed, where XLA runs a fusion and the
# launcher a memset (2.2 + 1.3 µs a layer at batch 8). FUSED_POST_ATTENTION = 1 (with it) also runs the
# o-projection's residual add and the post-attention norm (+ AQN noise) as that kernel (no zeroed buffer), o
# read in place, where XLA runs an add and a norm fusion (1.3 + 1.6 µs). On an H200 (7B shape, NVFP4; session
# 23, docs/benchmarks.md) both together: a batch-8 step 2.17 / 2.17 ms against 2.18 / 2.20 at 512 new tokens
# (batch 16: 2.66 / 2.66 against 2.68 / 2.67), 2.27 / 2.28 against 2.30 at 2048. The post-attention kernel
# alone lost (session 22, 202370a): XLA then materialized the previous layer's residual as its own add. 0 keeps
# XLA's ops (for A/B measurements; read at trace time).
FUSED_LAYER_END = 1
FUSED_POST_ATTENTION = 1
# 1 lets decode_attention_append merge its splits' partials itself (its `sync` counters, carried from layer to
# layer with the cache), where XLA runs a combine kernel after it (2.4 µs of a batch-8 layer's 72, 7B shape, on an
# H200; session 37's profile). Session 39 measured it on an H200: the kernel alone 1.8 µs a layer faster, batch-8
# rollouts 0.2-1.2% faster (NVFP4 and bf16; docs/benchmarks.md "Session 39"). 0 restores XLA's combine (for A/B
# measurements). Read at trace time.
FUSED_ATTENTION_COMBINE = 1
# 1: a fused-attention decode step of at least FUSED_ATTENTION_BF16_QKV_MIN_ROWS rows (no accumulator there) whose
# q/k/v weight is on layers.BF16_EPILOGUE's large-M route (pallas_kernels.matmul.dense_path_applies) takes q/k/v from
# layers.linear: the Gluon GEMM's bf16 output with the bias (and an adapter's delta) added in its epilogue, as the
# training forward computes them; the attention kernel then adds no bias. The float32 route it replaces runs at
# M > 128 on dequantize + cuBLAS (the Gluon GEMM writes only bf16): a batch-256 profile (H100, session 57,
# docs/bench_runs/session57_step83_h100.txt) had the 7B q/k/v at 15.8 us of dequantize and 20.6 us of cuBLAS a
# layer; with this route the Gluon GEMM takes them in 26.7 us (session 58, docs/bench_runs/session58_step84_h100.txt),
# and batch-256 decode steps of 7B shape took 10.232 / 10.231 ms against 10.319 / 10.362 ms with 0 (H100, 512 new
# tokens). 0: the float32 route everywhere (for A/B measurements). Read at trace time.
FUSED_ATTENTION_BF16_QKV = 1
# The fewest rows a decode step takes q/k/v in bf16 at (FUSED_ATTENTION_BF16_QKV): 129, one past the decode GEMV's
# 128 (pallas_kernels.w4_gluon.MAX_M). At 33-128 rows the float32 route runs on the GEMV's wgmma builds, and
# those beat the Gluon GEMM's narrow tiles the bf16 route would take: batch-128 decode steps 6.276 / 6.288 ms with
# the bf16 route against 6.176 / 6.200 ms without (H100, session 58, the same run as above). sampling.generate pads
# its batches to powers of two, so there the route starts at 256 rows.
FUSED_ATTENTION_BF16_QKV_MIN_ROWS = w4_gluon.MAX_M + 1
# 3 (the default) runs an accumulating decode step's layer after attention (o, the post-attention norm, gate/up,
# SwiGLU, down, the layer-end norm) and the next layer's fused q/k/v projection as one FFI call of seven Gluon kernels
# joined by programmatic dependent launch (pallas_kernels.decode_chain; layer 0's q/k/v runs before the layer loop),
# where XLA records each FFI call as its own CUDA-graph node and every kernel waits for the one before to drain. 1: the
# six kernels after attention only; 2: those six in one call without PDL; 0: the separate calls (for A/B
# measurements). Batch-8 decode steps, 7B shape, NVFP4, on an H100 (session 60, docs/benchmarks.md): 512 new tokens,
# 2.425 / 2.434 / 2.436 ms with 0, 2.348 / 2.353 / 2.344 with 1, 2.315 / 2.325 / 2.321 with 3, 2.446 with 2 (so the
# gain is PDL's, not the fewer graph nodes'); 2048 new tokens 2.594 -> 2.473 ms (2.19x -> 2.29x of bf16). Applies
# with FUSED_LAYER_END and FUSED_POST_ATTENTION, the decode GEMV's atomic builds (M <= 16), and no bias or adapter on
# o, gate/up and down (3: none on q/k/v either; a rollout without LoRA); elsewhere the separate calls run. Read at
# trace time.
# 4 (lab, session 63): 3, and the next layer's decode attention as an eighth kernel of the chain
# (pallas_kernels.append_attention, a Triton form of decode_attention_append that reads the cache's earlier slots
# before its PDL wait; layer 0's runs alone before the layer loop), so that a layer is one FFI call (bf16 caches,
# the in-kernel merge of FUSED_ATTENTION_COMBINE). 5 (lab, session 63): those calls' kernels for every layer in one
# call (decode_chain.decode_layers), so that no graph node boundary sits between layers. Both were slower on an H100
# (batch 8, 2048 new tokens: 2.686 ms with 4, 2.648-2.680 with 5, against 2.428-2.467 with 3): the Triton attention
# takes 19.0 us a layer where the Pallas kernel takes 14.2 (docs/benchmarks.md, "Session 63").
PDL_CHAIN = 3


def _dtype(cfg: ModelConfig):
  return jnp.dtype(cfg.dtype)


def lora_scale_of(lora_cfg: Any) -> float:
  """The LoRA scale from ``lora_cfg``: None -> 1.0, a number, an object with a ``scale`` attribute or a
  dict with a ``"scale"`` key (e.g. ``alpha / r``).

  Raises:
    TypeError: ``lora_cfg`` is none of these.
  """
  if lora_cfg is None:
    return 1.0
  if isinstance(lora_cfg, (int, float)):
    return float(lora_cfg)
  if isinstance(lora_cfg, dict):
    if "scale" not in lora_cfg:
      raise TypeError(f"lora_cfg as a dict must have a 'scale' key; got keys {sorted(lora_cfg)}")
    return float(lora_cfg["scale"])
  if hasattr(lora_cfg, "scale"):
    return float(lora_cfg.scale)
  raise TypeError(f"lora_cfg must be None, a float, or have a 'scale'; got {type(lora_cfg).__name__}")


# ----------------------------------------------------------------------------- params

def init_params(cfg: ModelConfig, key: jax.Array, *, dtype=jnp.bfloat16, std: float = 0.02) -> dict:
  """Random base parameters (normal(0, std) weights and q/k/v biases, ones for norms).

  For tests and for pretraining a tiny model; real weights come from
  :func:`qerl_jax.hf.load_pretrained`.

  Returns:
    The base tree: ``embed [V, D]``, ``final_norm [D]``, ``lm_head [D, V]``
    (absent when tied), ``layers`` stacked over ``L`` with every linear a
    ``dtype`` array ``[L, K, N]``.
  """
  L, D, V = cfg.num_layers, cfg.hidden_size, cfg.vocab_size
  keys = iter(jax.random.split(key, 16))
  normal = lambda shape: (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)
  lay = {"input_norm": jnp.ones((L, D), dtype), "post_attn_norm": jnp.ones((L, D), dtype),
         "attn": {}, "mlp": {}}
  for (group, name), (k, n) in cfg.linear_shapes().items():
    lay[group][name] = normal((L, k, n))
  if cfg.attention_bias:
    lay["attn"]["q_bias"] = normal((L, cfg.q_dim))
    lay["attn"]["k_bias"] = normal((L, cfg.kv_dim))
    lay["attn"]["v_bias"] = normal((L, cfg.kv_dim))
  if cfg.qk_norm:
    lay["attn"]["q_norm"] = jnp.ones((L, cfg.head_dim), dtype)
    lay["attn"]["k_norm"] = jnp.ones((L, cfg.head_dim), dtype)
  base = {"embed": normal((V, D)), "final_norm": jnp.ones((D,), dtype), "layers": lay}
  if not cfg.tie_word_embeddings:
    base["lm_head"] = normal((D, V))
  return base


def map_linears(fn, base: dict) -> dict:
  """Returns a copy of ``base`` with ``fn(w)`` applied to each stacked linear it holds
  (the 7 of :data:`LINEARS`, or with fused projections ``qkv``, ``o``, ``gate_up``, ``down``)."""
  lay = dict(base["layers"])
  for group in ("attn", "mlp"):
    lay[group] = dict(lay[group])
  for group, name in LINEARS + FUSED_LINEARS:
    if name in lay[group]:
      lay[group][name] = fn(lay[group][name])
  return {**base, "layers": lay}


def quantize_base(base: dict, quant: str = "nvfp4") -> dict:
  """Quantizes every decoder linear (per layer; embeddings, norms, biases, lm_head stay).

  Args:
    base: a base tree with float linears ``[L, K, N]``.
    quant: ``"nvfp4"`` (one global scale per layer and matrix), ``"nf4"`` or ``"none"``.

  Raises:
    ValueError: unknown ``quant``; K not a multiple of the block size (16 / 64).
  """
  if quant == "none":
    return base
  fns = {"nvfp4": nvfp4.quantize, "nf4": nf4.quantize}
  if quant not in fns:
    raise ValueError(f"quant must be 'nvfp4', 'nf4' or 'none', got {quant!r}")
  return map_linears(lambda w: w if layers.is_quantized(w) else fns[quant](w), base)


def to_decode_order(base: dict) -> dict:
  """``base`` with every NVFP4 linear's codes in the GPU decode kernel's order
  (:func:`qerl_jax.nvfp4.to_decode_order`): same values, same bytes; the Gluon decode GEMV spends
  fewer instructions on the E2M1 decode, the large-M dequantize reads it in place, and the other
  paths convert back as they read.

  Raises:
    ValueError: an NVFP4 linear with an odd N.
  """
  return map_linears(lambda w: nvfp4.to_decode_order(w) if isinstance(w, nvfp4.NVFP4Tensor) else w, base)


def dequantizes_linear(w, max_weights: int = 0) -> bool:
  """Whether :func:`dequantize_base` with ``max_weights`` makes a float copy of the linear ``w``: a 4-bit tensor
  (``[L, K, N]`` or ``[K, N]``) of at most ``max_weights`` weights a layer (``K x N``; 0: any size)."""
  return layers.is_quantized(w) and (not max_weights or w.shape[0] * w.shape[1] <= max_weights)


def dequantize_base(base: dict, dtype=jnp.float32, *, backend: str = "reference", max_weights: int = 0) -> dict:
  """The float model a quantized base represents: each 4-bit linear dequantized to ``dtype``
  (``[L, K, N]``; ``K x N x 2`` bytes a layer in bf16).

  ``backend`` is :func:`pallas_kernels.dequantize`'s: ``"reference"`` (default; XLA, exact float32
  products) or ``"auto"`` (the Pallas dequantize kernel on a GPU, one layer at a time: the values the
  large-M matmul path uses). ``max_weights`` > 0 dequantizes only the linears of at most that many
  weights a layer (``K x N``) and leaves the others 4-bit (a mixed base, which the model runs as it
  is); 0 (default): every linear.

  Raises:
    ValueError: unknown ``backend``; ``max_weights`` negative.
  """
  if max_weights < 0:
    raise ValueError(f"dequantize_base: max_weights={max_weights} must be >= 0 (0: every linear)")
  return map_linears(lambda w: (pallas_kernels.dequantize(w, dtype, backend=backend)
                                if dequantizes_linear(w, max_weights) else w), base)


def summarize(tree: dict) -> str:
  """A table of every leaf of a parameter tree: path, format (dtype or 4-bit type),
  logical shape and bytes, plus the total; e.g. ``print(models.summarize(base))``."""
  rows = []

  def walk(node, path):
    if isinstance(node, dict):
      for k in node:
        walk(node[k], path + (str(k),))
      return
    name = "/".join(path)
    if layers.is_quantized(node):
      shape = list(node.packed.shape[:-2]) + list(node.shape)
      rows.append((name, type(node).__name__, shape, node.nbytes))
    else:
      rows.append((name, str(node.dtype), list(node.shape), int(node.size * node.dtype.itemsize)))

  walk(tree, ())
  width = max([len(r[0]) for r in rows] + [5])
  lines = [f"{n:<{width}}  {fmt} {shape}  {nb / 2**20:.2f} MiB" for n, fmt, shape, nb in rows]
  lines.append(f"{'total':<{width}}  {sum(r[3] for r in rows) / 2**20:.2f} MiB")
  return "\n".join(lines)


# ----------------------------------------------------------------------------- cache

def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> dict:
  """An empty KV cache.

  Returns:
    ``{"k": [L, B, S, Hkv, hd], "v": [L, B, S, Hkv, hd]`` in ``dtype``,
    ``"mask": bool [B, S]`` (True at written, non-padding slots),
    ``"index": int32 []`` (next slot to write, shared by all rows)}. ``S = max_len``.
    Prompts are left-padded so one shared write index serves the batch.

  Raises:
    ValueError: ``batch`` or ``max_len`` not an integer >= 1.
  """
  for name, v in (("batch", batch), ("max_len", max_len)):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
      raise ValueError(f"init_cache: {name} must be an integer >= 1, got {v!r}")
  shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
  return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype),
          "mask": jnp.zeros((batch, max_len), bool), "index": jnp.zeros((), jnp.int32)}


def positions_from_mask(mask_BxT: jax.Array) -> jax.Array:
  """``max(cumsum(mask) - 1, 0)``: int32 positions so a left-padded row gets the
  positions it would have alone (padding slots get 0)."""
  return jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=-1) - 1, 0).astype(jnp.int32)


# ----------------------------------------------------------------------------- forward

def _fused_attention(cfg, attn, la, kv, decode, dtype) -> bool:
  """Whether a layer runs bias, RoPE, the cache write and attention in one kernel on the fused q/k/v
  projection's float32 output (:func:`pallas_kernels.decode_attention.decode_attention_append`)."""
  return (FUSED_DECODE_ATTENTION and kv is not None and decode is not None and "qkv" in attn and not cfg.qk_norm
          and all(la.get(n) is None for n in ("q", "k", "v")) and decode_attn.auto_backend(dtype) != "reference")


def _new_accumulator(cfg, rows, lp, ll, kv, decode, dtype):
  """A layer's :class:`layers.Accumulator` for a decode step of ``rows`` rows (None where none applies)."""
  if not (ACCUMULATE_DECODE and decode is not None and rows <= ACCUMULATE_MAX_ROWS):
    return None
  attn, la = lp["attn"], ll.get("attn", {})
  return layers.new_accumulator(rows, [attn["qkv"] if _fused_attention(cfg, attn, la, kv, decode, dtype) else None,
                                       attn["o"], *_mlp_in_weights(lp["mlp"], ll.get("mlp", {})),
                                       lp["mlp"]["down"]], dtype)


class _NextNorms(NamedTuple):
  """The norm stacks ``[L, D]`` a fused decode step's layer ends read at the layer index (:data:`FUSED_LAYER_END`,
  made once a step by :func:`_layer_end_inputs`): the norm after each layer (the next input norm, then the final
  norm; float32) and its AQN noise (zero after the last layer; None without noise), and with
  :data:`FUSED_POST_ATTENTION` the post-attention norm's weight and noise (else None). ``qkv_ahead``
  (:data:`PDL_CHAIN` = 3): each layer's fused q/k/v product is already in the head of its accumulator, written by
  the previous layer's chain (layer 0's before the loop). ``attn_ahead`` (:data:`PDL_CHAIN` = 4): its attention too,
  whose output the layer receives (layer 0's run before the loop)."""
  w_next: jax.Array
  noise_next: Optional[jax.Array]
  w_post: Optional[jax.Array]
  noise_post: Optional[jax.Array]
  qkv_ahead: bool = False
  attn_ahead: bool = False


def _bf16_qkv(x, w, acc) -> bool:
  """Whether a fused-attention decode step takes its q/k/v in bf16 from :func:`layers.linear`
  (:data:`FUSED_ATTENTION_BF16_QKV`): no accumulator, at least :data:`FUSED_ATTENTION_BF16_QKV_MIN_ROWS` rows (the
  product of ``x``'s leading dims), and ``w`` on the large-M route of ``layers.BF16_EPILOGUE``. Shapes and dtypes only
  are read.

  Raises:
    ValueError: a malformed kernel setting (as :func:`layers.bf16_epilogue_applies`).
  """
  rows = int(np.prod(x.shape[:-1]))
  return (bool(FUSED_ATTENTION_BF16_QKV) and acc is None and rows >= FUSED_ATTENTION_BF16_QKV_MIN_ROWS
          and layers.bf16_epilogue_applies(x, w))


def _region_finished(x, w, lora, lora_scale, bias, before, after) -> bool:
  """Whether a projection of ``x`` by ``w`` ran into the accumulator (``after`` advanced past ``before``, see
  :func:`layers.linear_f32_into`) and its region holds the finished product, for a kernel to read in place: no
  bias left to add, and no adapter or one the 4-bit kernel added (:func:`layers.adapter_in_kernel`)."""
  return (before is not None and after is not before and bias is None
          and (lora is None or layers.adapter_in_kernel(x, w, lora, lora_scale)))


def _layer(cfg, inv_freq, lora_scale, h, lp, ll, nn, kv, mask_BxTxS, positions, write_at, q_chunk,
           decode=None, layer_end=None, attn_impl="xla"):
  """One decoder layer.

  ``kv`` is None or ``(k_LxBxSxHxD, v_LxBxSxHxD, layer, sync)``: the whole stacked
  cache, this layer's index and the decode attention kernel's counters (or None; see
  :data:`FUSED_ATTENTION_COMBINE`). Only the ``T`` new slots
  ``[layer, :, write_at:write_at + T]`` are written (an in-place
  dynamic-update-slice of the carried buffer); returns the updated stacked
  ``(k, v, sync)`` as ``new_kv``. (Slicing the layer out, updating it and writing the
  whole layer back costs a full KV-cache copy per decode step.) A decode step with
  fused q/k/v weights (no per-part adapters, no q/k norm) on the kernel does all of
  that and attention in one call,
  :func:`pallas_kernels.decode_attention.decode_attention_append`. Otherwise, for attention,
  a decode step (``decode = (slot_mask [B, S] int8, length, rope cos [B, hd/2], sin)`` given, T = 1)
  where the kernel applies
  (:func:`pallas_kernels.decode_attention.auto_backend`: a GPU and 16-bit
  queries) calls :func:`pallas_kernels.decode_attention.decode_attention`,
  which reads the layer in place and only the written slots; otherwise (prefill,
  CPU, float32) the layer is read back with a dynamic slice for
  :func:`layers.attention`.

  ``layer_end`` (with :data:`FUSED_LAYER_END`, from :func:`forward`): ``(x, buffer, norms, o)``, this layer's normed
  input and zeroed accumulator (made by the previous layer's end), the :class:`_NextNorms` stacks and, with
  ``norms.attn_ahead``, this layer's attention output ``[B T, H hd]`` (else None); the layer then returns ``(h,
  x_next, buffer_next)`` in place of ``h`` (``(h, x_next, buffer_next, o_next)`` with ``norms.attn_ahead``).
  """
  b, t, _ = h.shape
  eps = cfg.rms_norm_eps
  attn, la = lp["attn"], ll.get("attn", {})
  norms = None
  if layer_end is None:
    x = layers.rms_norm(h, ll.get("input_norm", lp["input_norm"]), eps, nn.get("input_norm"))
    acc = _new_accumulator(cfg, b * t, lp, ll, kv, decode, h.dtype)  # (into one buffer)
  else:  # normed and zeroed by the previous layer's end
    x, buffer, norms = layer_end[:3]
    # (PDL_CHAIN = 3: with this layer's q/k/v product in the buffer's head)
    acc = layers.Accumulator(buffer, b * t * attn["qkv"].tensor.shape[1] if norms.qkv_ahead else 0, buffer.shape[0])
  # A decode step on the GPU kernels with fused q/k/v: bias, rounding, RoPE, the cache write and
  # attention run in one kernel on the projection's float32 output.
  fused_attention = _fused_attention(cfg, attn, la, kv, decode, x.dtype)
  if fused_attention:
    kc, vc, li, sync = kv
    bias_stack = attn.get("qkv_bias")
    if norms is not None and norms.attn_ahead:  # attention ran in the previous layer's chain (PDL_CHAIN = 4)
      o = layer_end[3]
      nxt = decode_chain.NextAttention(kc, vc, sync, _stack_of(bias_stack), *decode, cfg.num_heads)
      out = _after_attention(cfg, lora_scale, h, o.reshape(b, t, cfg.q_dim), lp, ll, nn, acc, norms, li,
                             next_attention=nxt)
      return out[:4], out[4]
    if norms is not None and norms.qkv_ahead:  # written by the previous layer's chain (PDL_CHAIN = 3)
      qkv, bias = acc.buffer, _stack_of(bias_stack)
    elif _bf16_qkv(x, attn["qkv"], acc):  # the large-M route's bf16 q/k/v, bias and adapter in the GEMM's epilogue
      qkv, bias = layers.linear(x, attn["qkv"], bias=layers.layer_array(bias_stack), lora=la.get("qkv"),
                                lora_scale=lora_scale).reshape(b, -1), None
    else:
      before = acc
      y, bias, acc = layers.linear_f32_into(x, attn["qkv"], acc, bias=layers.layer_array(bias_stack),
                                            lora=la.get("qkv"), lora_scale=lora_scale)
      # The kernel reads in place what XLA would copy out for it: the bias stack's layer li and, when
      # q/k/v went unchanged into the head of the accumulator (no adapter, or one the 4-bit kernel added), that head.
      if bias is not None and isinstance(bias_stack, layers.StackedWeight):
        bias = bias_stack.tensor
      qkv = y.reshape(b, -1)
      # (the bias goes to the kernel apart)
      if _region_finished(x, attn["qkv"], la.get("qkv"), lora_scale, None, before, acc) and before.offset == 0:
        qkv = acc.buffer
    o, kc, vc, *sync = decode_attn.decode_attention_append(qkv, bias, kc, vc, li, *decode, num_heads=cfg.num_heads,
                                                           dtype=x.dtype, sync=sync)
    return (_after_attention(cfg, lora_scale, h, o.reshape(b, t, cfg.q_dim), lp, ll, nn, acc, norms, li),
            (kc, vc, sync[0] if sync else None))
  if "qkv" in attn:  # fused projections (models.fuse_projections): one matmul, split back
    q, k, v = layers.fused_linear(x, attn["qkv"], (cfg.q_dim, cfg.kv_dim, cfg.kv_dim),
                                  bias=layers.layer_array(attn.get("qkv_bias")),
                                  loras=(la.get("q"), la.get("k"), la.get("v")), lora=la.get("qkv"),
                                  lora_scale=lora_scale)
  else:
    q, k, v = (_linear(attn, la, name, x, lora_scale) for name in ("q", "k", "v"))
  q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
  k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
  v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
  if cfg.qk_norm:
    q = layers.rms_norm(q, attn["q_norm"], eps)
    k = layers.rms_norm(k, attn["k_norm"], eps)
  q = layers.rope(q, positions, inv_freq)
  k = layers.rope(k, positions, inv_freq)
  if kv is None:
    new_kv = None
    o = layers.attention(q, k, v, mask_BxTxS, q_chunk=q_chunk, implementation=attn_impl)
  else:
    kc, vc, li, sync = kv
    at = (li, 0, write_at, 0, 0)
    kc = jax.lax.dynamic_update_slice(kc, k[None].astype(kc.dtype), at)
    vc = jax.lax.dynamic_update_slice(vc, v[None].astype(vc.dtype), at)
    new_kv = (kc, vc, sync)
    if decode is not None and decode_attn.auto_backend(q.dtype) != "reference":
      # Decode step on the kernel: layer li of the stacked cache is read in place.
      o = decode_attn.decode_attention(q[:, 0], kc, vc, li, *decode[:2])
    else:
      keys = jax.lax.dynamic_index_in_dim(kc, li, 0, keepdims=False)
      values = jax.lax.dynamic_index_in_dim(vc, li, 0, keepdims=False)
      o = layers.attention(q, keys, values, mask_BxTxS, q_chunk=q_chunk)
  return _after_attention(cfg, lora_scale, h, o.reshape(b, t, cfg.q_dim), lp, ll, nn, acc, norms,
                          None if kv is None else kv[2]), new_kv


def _stack_of(bias):
  """The array of a (possibly stacked) bias: a :class:`layers.StackedWeight`'s whole stack, or ``bias`` itself."""
  return bias.tensor if isinstance(bias, layers.StackedWeight) else bias


def _linear(grp, lgrp, name, x, lora_scale):
  """:func:`layers.linear` by weight ``grp[name]``, its optional bias and adapter ``lgrp[name]``."""
  return layers.linear(x, grp[name], bias=grp.get(name + "_bias"), lora=lgrp.get(name), lora_scale=lora_scale)


def _linear_into(grp, lgrp, name, x, lora_scale, acc):
  """:func:`_linear` run into the :class:`layers.Accumulator` ``acc`` where that applies (else as
  :func:`_linear`); returns ``(y, acc)``."""
  y, bias, acc, _ = _linear_region(grp, lgrp, name, x, lora_scale, acc)
  return layers.finish_linear(y, bias, grp[name], x.dtype), acc


def _linear_region(grp, lgrp, name, x, lora_scale, acc):
  """:func:`layers.linear_f32_into` of ``grp[name]`` (its bias and ``lgrp``'s adapter deferred) into ``acc``;
  returns ``(y, bias, acc, finished)``, ``finished`` as :func:`_region_finished`: the new region of ``acc`` holds
  the finished product, for a kernel to read in place. Without an accumulator (prefill, training, CPU) ``y`` is
  :func:`_linear`'s finished result (with :func:`layers.linear`'s bf16 route) and ``bias`` None."""
  if acc is None:
    return _linear(grp, lgrp, name, x, lora_scale), None, acc, False
  before = acc
  y, bias, acc = layers.linear_f32_into(x, grp[name], acc, bias=grp.get(name + "_bias"), lora=lgrp.get(name),
                                        lora_scale=lora_scale)
  return y, bias, acc, _region_finished(x, grp[name], lgrp.get(name), lora_scale, bias, before, acc)


def _mlp_in_weights(mlp, lm) -> list:
  """The MLP's input projections that :func:`_after_attention` runs through an accumulator: the fused
  gate/up unless it has per-part adapters, else gate and up."""
  if "gate_up" in mlp:
    return [] if (lm.get("gate") is not None or lm.get("up") is not None) else [mlp["gate_up"]]
  return [mlp["gate"], mlp["up"]]


def _after_attention(cfg, lora_scale, h, o, lp, ll, nn, acc=None, norms=None, li=None, next_attention=None):
  """The rest of a layer after attention ``o [B, T, H * hd]``: the o projection and the
  residual, then the MLP and its residual. Returns the new ``h``. With ``acc`` (a decode step's
  :class:`layers.Accumulator`) the 4-bit projections write into it. With ``norms`` (:class:`_NextNorms`,
  :data:`FUSED_LAYER_END`) and the layer index ``li`` the last residual, the next norm and the next accumulator
  come from one :func:`pallas_kernels.residual_norm.residual_rms_norm` (and with ``norms.w_post`` the o
  residual and the post-attention norm from another): returns ``(h, x_next, buffer_next)``; with ``next_attention``
  (:data:`PDL_CHAIN` = 4, ``norms.attn_ahead``) the chain also runs the next layer's attention, and this returns
  ``(h, x_next, buffer_next, o_next, (k cache, v cache, sync))``."""
  eps = cfg.rms_norm_eps
  attn, la = lp["attn"], ll.get("attn", {})
  mlp, lm = lp["mlp"], ll.get("mlp", {})
  if PDL_CHAIN and norms is not None and norms.w_post is not None and acc is not None and acc.buffer is not None:
    chained = _chained_after_attention(cfg, h, o, lp, ll, acc, norms, next_attention)
    if chained is not None:
      return chained
  if norms is not None and norms.qkv_ahead:  # (_layer_end_inputs checked layer 0; every layer has its shapes)
    raise RuntimeError("decoder: PDL_CHAIN = 3 computed the next q/k/v ahead, but a layer did not take the chain")
  y, bias, acc, finished = _linear_region(attn, la, "o", o, lora_scale, acc)
  w_post = ll.get("post_attn_norm", lp["post_attn_norm"])
  if norms is not None and norms.w_post is not None and finished:
    # FUSED_POST_ATTENTION: o read in place from its region; norms.w_post is w_post's stack
    b, t, d = h.shape
    h, x = residual_norm.residual_rms_norm(h.reshape(b * t, d), acc.buffer, acc.offset - y.size, norms.w_post,
                                           li, eps, norms.noise_post)
    h, x = h.reshape(b, t, d), x.reshape(b, t, d)
  else:
    h = h + layers.finish_linear(y, bias, attn["o"], o.dtype)
    x = layers.rms_norm(h, w_post, eps, nn.get("post_attn_norm"))
  if acc is not None:
    # h is read again by the layer's last residual. Without the barrier XLA recomputes h + y there
    # (fusing the add into both consumers), reading o's region after the next projections wrote
    # into the buffer, and so copies the whole buffer first (2 copies a layer: slower at batch 64).
    h, x = jax.lax.optimization_barrier((h, x))
  if "gate_up" in mlp and not _mlp_in_weights(mlp, lm):  # per-part adapters
    g, u = layers.fused_linear(x, mlp["gate_up"], (cfg.intermediate_size,) * 2,
                               loras=(lm.get("gate"), lm.get("up")), lora=lm.get("gate_up"),
                               lora_scale=lora_scale)
  elif "gate_up" in mlp:
    gu, acc = _linear_into(mlp, lm, "gate_up", x, lora_scale, acc)
    g, u = gu[..., :cfg.intermediate_size], gu[..., cfg.intermediate_size:]
  else:
    g, acc = _linear_into(mlp, lm, "gate", x, lora_scale, acc)
    u, acc = _linear_into(mlp, lm, "up", x, lora_scale, acc)
  y = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(h.dtype)
  if norms is not None:
    return _fused_layer_end(cfg, lora_scale, h, y, mlp, lm, acc, norms.w_next, norms.noise_next, li)
  y, acc = _linear_into(mlp, lm, "down", y, lora_scale, acc)
  return h + y


_CHAIN_LINEARS = (("attn", "o"), ("mlp", "gate_up"), ("mlp", "down"))  # what decode_chain.post_attention runs


def _chain_weights(layer: dict) -> Optional[list]:
  """o, gate/up and down of ``layer`` (a layer's tree, or the base's stacked 4-bit leaves) for
  :func:`pallas_kernels.decode_chain.post_attention`, or None where it cannot take them: a bias on one of them, or one
  that is not NVFP4 (a :class:`layers.StackedWeight`'s tensor counts)."""
  ws = []
  for grp, name in _CHAIN_LINEARS:
    g = layer.get(grp, {})
    w = g.get(name)
    if name + "_bias" in g or not isinstance(w.tensor if isinstance(w, layers.StackedWeight) else w,
                                             nvfp4.NVFP4Tensor):
      return None
    ws.append(w)
  return ws


def _chain_norms(norms: _NextNorms) -> tuple:
  """The post-attention and next norms' :class:`pallas_kernels.decode_chain.NormStacks` of ``norms``."""
  return (decode_chain.NormStacks(norms.w_post, norms.noise_post),
          decode_chain.NormStacks(norms.w_next, norms.noise_next))


def _chained_after_attention(cfg, h, o, lp, ll, acc, norms, next_attention=None):
  """:data:`PDL_CHAIN`: the layer after attention by :func:`pallas_kernels.decode_chain.post_attention` (o, gate/up
  and down into their regions of ``acc`` from ``acc.offset`` on, as :func:`_new_accumulator` laid them out),
  returning ``(h, x_next, buffer_next)`` as :func:`_fused_layer_end`; or None where the chain does not apply (a
  bias or adapter on o, gate/up or down, separate gate and up, weights not on stacked 4-bit tensors, builds it
  cannot chain). With ``next_attention`` (:class:`pallas_kernels.decode_chain.NextAttention`, ``norms.attn_ahead``)
  the chain also runs the next layer's attention: returns ``(h, x_next, buffer_next, o_next, (k cache, v cache,
  sync))``."""
  la, lm = ll.get("attn", {}), ll.get("mlp", {})
  if la.get("o") is not None or any(lm.get(n) is not None for n in ("gate", "up", "gate_up", "down")):
    return None
  ws = _chain_weights(lp)
  if ws is None or not all(isinstance(w, layers.StackedWeight) for w in ws):
    return None
  b, t, d = h.shape
  o2, h2 = o.reshape(b * t, -1), h.reshape(b * t, d)
  post, nxt = _chain_norms(norms)
  w_o, w_gu, w_down = (w.tensor for w in ws)
  w_qkv = lp["attn"]["qkv"].tensor if norms.qkv_ahead else None
  if not decode_chain.applies(o2, h2, w_o, w_gu, w_down, post, nxt, w_qkv):
    return None
  if acc.offset + b * t * (2 * d + w_gu.shape[1]) > acc.size:
    return None
  if next_attention is not None and not decode_chain.attention_applies(next_attention, b * t, w_qkv):
    return None
  index = ws[0].index
  out = decode_chain.post_attention(
      o2, h2, acc.buffer, acc.offset, w_o, w_gu, w_down, index, post, nxt, cfg.rms_norm_eps, zero_size=acc.size,
      pdl=PDL_CHAIN != 2, next_qkv=None if w_qkv is None else (w_qkv, jnp.asarray(index, jnp.int32) + 1),
      next_attention=next_attention)
  h2, x_next, buffer = out[0], out[1], out[2]
  if next_attention is None:
    return h2.reshape(b, t, d), x_next.reshape(b, t, d), buffer
  o_next, kc, vc, sync = out[4]
  return h2.reshape(b, t, d), x_next.reshape(b, t, d), buffer, o_next.reshape(b * t, -1), (kc, vc, sync)


def _fused_layer_end(cfg, lora_scale, h, x, mlp, lm, acc, w_next, noise_next, li):
  """The down-projection of ``x`` into ``acc``, then :func:`pallas_kernels.residual_norm.residual_rms_norm`: the
  residual add (the product read in place from its region when nothing is left to add to it), the next
  norm by layer ``li`` of ``w_next`` / ``noise_next``, and a zeroed accumulator of ``acc``'s size for the next
  layer. Returns ``(h, x_next, buffer_next)``."""
  y, bias, acc, finished = _linear_region(mlp, lm, "down", x, lora_scale, acc)
  if finished:
    src, offset = acc.buffer, acc.offset - y.size
  else:  # the product with its bias or XLA's adapter delta, as finish_linear adds them (float32)
    src, offset = (y if bias is None else layers.finish_linear(y, bias, mlp["down"], jnp.float32)).reshape(-1), 0
  b, t, d = h.shape
  h, x_next, buffer = residual_norm.residual_rms_norm(h.reshape(b * t, d), src, offset, w_next, li, cfg.rms_norm_eps,
                                                      noise_next, zero_size=acc.size)
  return h.reshape(b, t, d), x_next.reshape(b, t, d), buffer


def _split_leaves(tree: dict, pick):
  """(the leaves ``pick(name, leaf)`` selects, the rest) of a nested dict, as two nested dicts."""
  picked, rest = {}, {}
  for name, v in tree.items():
    if isinstance(v, dict):
      picked[name], rest[name] = _split_leaves(v, pick)
    elif pick(name, v):
      picked[name] = v
    else:
      rest[name] = v
  return picked, rest


def _bind_stacked(rest: dict, quant: dict, li) -> dict:
  """``rest`` with each stack of ``quant`` (4-bit weights, adapters' b) added back as layer ``li``
  (a :class:`layers.StackedWeight`)."""
  out = dict(rest)
  for name, v in quant.items():
    out[name] = _bind_stacked(rest.get(name, {}), v, li) if isinstance(v, dict) else layers.StackedWeight(v, li)
  return out


def forward(cfg: ModelConfig, base: dict, tokens: jax.Array, positions: jax.Array, *,
            lora: Optional[dict] = None, lora_cfg: Any = None,
            norm_noise: Optional[dict] = None, cache: Optional[dict] = None,
            attn_mask: Optional[jax.Array] = None, remat: bool = False,
            return_hidden: bool = False, attn_chunk: Optional[int] = None,
            unroll_layers: bool = False, attn_impl: str = "xla"):
  """Runs the decoder (optionally against a KV cache: prefill or decode).

  Args:
    cfg: static config (``cfg.dtype`` is the compute dtype).
    base: frozen base tree (bf16/f32 arrays, NVFP4Tensor or NF4Tensor linears).
    tokens: int32 ``[B, T]``.
    positions: int32 ``[B, T]`` RoPE positions, normally
      :func:`positions_from_mask` of the attention mask (with a cache: the
      positions of the new tokens, e.g. last position + 1 when decoding).
    lora: optional adapter tree ``{"layers": {"attn": {"q": {"a": [L, K, r],
      "b": [L, r, N]}, ...}, "mlp": {...}, optional "input_norm"/"post_attn_norm"
      [L, D] replacing the base norm weights}}``.
    lora_cfg: the LoRA scale: None (1.0), a float, or anything with ``.scale``.
    norm_noise: optional AQN noise ``{"input_norm": f32 [L, D], "post_attn_norm": f32 [L, D]}``
      added to the norm weights (QeRL Sec. 3.3).
    cache: optional KV cache from :func:`init_cache`; the new keys/values are
      written at slots ``[index, index + T)`` and ``index`` advances by ``T``.
      The caller keeps ``index + T <= S``: checked (ValueError) when the index is concrete, not under
      ``jit``, where an overrun silently overwrites earlier slots.
    attn_mask: ``[B, T]`` 1/True for real tokens, 0 for padding (default all 1).
      Causal masking is always applied.
    remat: ``jax.checkpoint`` each layer body (training memory; same numbers).
    return_hidden: return the final-normed hidden ``[B, T, D]`` (compute dtype)
      instead of float32 logits ``[B, T, V]``.
    attn_chunk: run attention in query chunks of this many tokens so float32
      scores are ``[B, H, attn_chunk, S]`` at a time, not ``[B, H, T, S]``
      (long training sequences); None = one piece. Same numbers.
    attn_impl: attention without a cache (the training forward): ``"xla"`` (default), ``"cudnn"``
      (a GPU's fused attention, :func:`layers.attention`; ``attn_chunk`` then does not apply) or
      ``"auto"`` (``"cudnn"`` where it applies: :func:`layers.resolve_attention_implementation`). A
      forward with a cache (prefill, decode) always runs ``"xla"`` or the decode kernels.
    unroll_layers: unroll the layer loop (``jax.lax.scan(unroll=True)``): every layer's weights
      become static slices and its index a constant, so a decode step runs without the loop's
      per-layer dynamic-slice copies and counter updates (a few microseconds per layer on a GPU,
      where a batch-8 layer takes about 100) at the cost of compiling ``L`` copies of the layer.
      Same numbers.

  Returns:
    ``(logits_or_hidden, new_cache)`` (``new_cache`` is None without a cache).

  Raises:
    TypeError: ``tokens`` not integer.
    ValueError: tokens/positions/mask shape mismatch, a cache of another batch size, more new tokens
      than cache slots, (outside ``jit``) ``index + T`` past the cache's last slot or a token id outside
      ``[0, vocab_size)`` (inside ``jit`` such an id reads NaN: JAX's out-of-bounds gather fills), an unknown
      ``attn_impl``, or ``"cudnn"`` off a GPU backend.
  """
  if attn_impl not in layers.ATTENTION_IMPLEMENTATIONS:
    raise ValueError(f"attn_impl={attn_impl!r} is not one of {layers.ATTENTION_IMPLEMENTATIONS}")
  if tokens.ndim != 2 or positions.shape != tokens.shape:
    raise ValueError(f"tokens must be [B, T] with positions of the same shape; got tokens "
                     f"{tokens.shape}, positions {positions.shape}")
  b, t = tokens.shape
  if cache is not None and cache["mask"].shape[0] != b:
    raise ValueError(f"tokens have {b} rows but the KV cache holds {cache['mask'].shape[0]}")
  if attn_mask is None:
    attn_mask = jnp.ones((b, t), bool)
  elif attn_mask.shape != tokens.shape:
    raise ValueError(f"attn_mask shape {attn_mask.shape} != tokens shape {tokens.shape}")
  attn_mask = attn_mask.astype(bool)
  _check_token_ids(tokens, cfg.vocab_size)
  dt = _dtype(cfg)
  inv_freq = jnp.asarray(rope_inv_freq(cfg))
  lora_scale = lora_scale_of(lora_cfg)
  h = jnp.take(base["embed"], tokens, axis=0).astype(dt)

  if cache is None:
    causal = jnp.tril(jnp.ones((t, t), bool))
    mask = causal[None] & attn_mask[:, None, :]
    write_at = decode = None
  else:
    s = cache["k"].shape[2]
    if t > s:
      raise ValueError(f"{t} new tokens do not fit a KV cache of {s} slots")
    write_at = cache["index"]
    if not isinstance(write_at, jax.core.Tracer) and int(write_at) + t > s:
      # (under jit the index is traced and the caller must keep this; dynamic_update_slice would clamp the
      # write start, overwriting earlier slots, and later slots' queries would see the overwritten keys)
      raise ValueError(f"{t} new tokens at cache index {int(write_at)} overrun the KV cache's {s} slots")
    slot_mask = jax.lax.dynamic_update_slice(cache["mask"], attn_mask, (0, write_at))
    q_slot = write_at + jnp.arange(t)
    mask = (jnp.arange(s)[None, :] <= q_slot[:, None])[None] & slot_mask[:, None, :]
    # A decode step's kernel inputs, made once per step rather than in every layer: the slot mask
    # as int8, the filled length, and RoPE's cos and sin for decode_attention_append.
    decode = None
    if t == 1:
      decode = (slot_mask.astype(jnp.int8), write_at + 1, *decode_attn.rope_cos_sin(positions[:, 0], inv_freq))

  lay_lora = (lora or {}).get("layers", {})
  noise = norm_noise or {}

  # With a KV cache (prefill / decode), 4-bit weights stay out of the scanned
  # xs: the kernels read layer li of the stack in place (layers.StackedWeight),
  # where slicing them would copy every layer's weights on every decode step.
  # On a 4-bit base with the LoRA epilogue on, the adapters' b factors (in the compute dtype: the
  # sampler casts them once per rollout) stay out too: for a few rows the W4A16 kernel's epilogue
  # reads layer li of the b stack in place (layers._lora_factors); elsewhere the body slices it, as
  # the scan would. A float base keeps them in the scan (its GEMMs read scanned slices as before).
  if cache is not None:
    # (the fused q/k/v bias too: the decode attention kernel reads its layer in place)
    stacked, scanned = _split_leaves(base["layers"], lambda name, v: layers.is_quantized(v) or name == "qkv_bias")
    # an adapter's b (and with pallas_kernels.w4_gluon.LORA_XA its a, which lora_xa reads in place), in the
    # compute dtype
    in_place_b = lambda name, v: (name == "b" or (name == "a" and pallas_kernels.w4_gluon.LORA_XA)) and v.dtype == dt
    lora_b, lay_lora = _split_leaves(lay_lora, in_place_b) if stacked and layers.LORA_EPILOGUE else ({}, lay_lora)
  else:
    stacked, scanned, lora_b = {}, base["layers"], {}
  # FUSED_LAYER_END: each layer's end makes the next layer's normed input and zeroed accumulator
  end = _layer_end_inputs(cfg, base, scanned, stacked, lay_lora, noise, h, decode) if cache is not None else None

  def body(carry, xs):
    h, x, buf, kc, vc, sync, o = carry
    lp, ll, nn, li = xs
    lp = _bind_stacked(lp, stacked, li)
    ll = _bind_stacked(ll, lora_b, li)
    if kc is None:
      h, _ = _layer(cfg, inv_freq, lora_scale, h, lp, ll, nn, None, mask, positions, None,
                    attn_chunk, attn_impl=attn_impl)
    else:
      # The stacked cache rides in the carry so XLA updates it in place.
      h, (kc, vc, sync) = _layer(cfg, inv_freq, lora_scale, h, lp, ll, nn, (kc, vc, li, sync), mask,
                           positions, write_at, attn_chunk, decode=decode,
                           layer_end=None if end is None else (x, buf, end[2], o))
      if end is not None and end[2].attn_ahead:  # (with the next layer's attention output)
        h, x, buf, o = h
      elif end is not None:
        h, x, buf = h
    return (h, x, buf, kc, vc, sync, o), None

  if remat:
    body = jax.checkpoint(body, prevent_cse=False)
  kc0 = None if cache is None else cache["k"]
  vc0 = None if cache is None else cache["v"]
  # The layer indices as a constant, not an iota: in an unrolled decode step XLA folds each layer's slice of
  # a constant into its own constant, where an iota's slice stays a small kernel a layer (0.8 µs on an H200).
  xs = (scanned, lay_lora, noise, np.arange(cfg.num_layers, dtype=np.int32))
  x0, buf0 = (None, None) if end is None else end[:2]
  # FUSED_ATTENTION_COMBINE: the decode attention kernel's zeroed counters, carried through the layers
  sync0 = (decode_attn.new_sync(b, cfg.num_kv_heads) if FUSED_ATTENTION_COMBINE and decode is not None else None)
  o0 = None
  if end is not None and PDL_CHAIN in (4, 5) and end[2].qkv_ahead and sync0 is not None:
    # layer 0's attention on its q/k/v (computed before the loop), alone; each layer's chain then runs the next's
    bias = _stack_of(stacked["attn"].get("qkv_bias"))
    first = decode_chain.NextAttention(kc0, vc0, sync0, bias, *decode, cfg.num_heads)
    if decode_chain.attention_applies(first, b * t, stacked["attn"]["qkv"]):
      o0, kc0, vc0, sync0 = append_attention.attend_append(buf0, bias, kc0, vc0, np.int32(0), *decode,
                                                           num_heads=cfg.num_heads, sync=sync0)
      o0 = o0.reshape(b, cfg.q_dim)
      end = (end[0], end[1], end[2]._replace(attn_ahead=True))
  if o0 is not None and PDL_CHAIN == 5 and _layers_call_applies(scanned):
    # every layer after layer 0's attention in one FFI call (the final norm at its end)
    w_o, w_gu, w_down = _chain_weights(stacked)
    post, nxt = _chain_norms(end[2])
    w_qkv = stacked["attn"]["qkv"]
    _, x, kc, vc, _ = decode_chain.decode_layers(
        h.reshape(b * t, -1), o0, buf0, b * t * w_qkv.shape[1], w_qkv, w_o, w_gu, w_down, post, nxt,
        decode_chain.NextAttention(kc0, vc0, sync0, _stack_of(stacked["attn"].get("qkv_bias")), *decode,
                                   cfg.num_heads), cfg.rms_norm_eps, zero_size=buf0.shape[0])
    x = x.reshape(h.shape)
  else:
    (h, x, _, kc, vc, _, _), _ = jax.lax.scan(body, (h, x0, buf0, kc0, vc0, sync0, o0), xs,
                                             unroll=bool(unroll_layers))

  # (with FUSED_LAYER_END the last layer's end applied the final norm)
  h = layers.rms_norm(h, base["final_norm"], cfg.rms_norm_eps) if end is None else x
  new_cache = None
  if cache is not None:
    new_cache = {"k": kc, "v": vc, "mask": slot_mask, "index": cache["index"] + t}
  if return_hidden:
    return h, new_cache
  return lm_head_logits(cfg, base, h), new_cache


def _layer_end_inputs(cfg, base, scanned, stacked, lay_lora, noise, h, decode):
  """What :data:`FUSED_LAYER_END` needs for a decode step, or None where it does not apply (the setting off, not
  a decode step, no accumulator, the kernel not here): ``(x0, buffer0, norms)``, the first layer's normed input
  and zeroed accumulator, and the :class:`_NextNorms` stacks. Trained norms (``lay_lora``'s ``input_norm`` /
  ``post_attn_norm`` ``[L, D]``, :class:`qerl_jax.lora.LoRAConfig` ``train_norms``) replace the base's, as in
  the layer."""
  b, t, d = h.shape
  if not FUSED_LAYER_END or decode is None or not residual_norm.available():
    return None
  w_in = lay_lora.get("input_norm", base["layers"]["input_norm"])
  if not residual_norm.applies(h.reshape(b * t, d), w_in):
    return None
  layer0 = lambda tree: jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape[1:], v.dtype), tree)  # (shapes only)
  acc = _new_accumulator(cfg, b * t, _bind_stacked(layer0(scanned), stacked, np.int32(0)), layer0(lay_lora),
                         (None, None, 0), decode, h.dtype)
  if acc is None:
    return None
  w_next = jnp.concatenate([w_in[1:].astype(jnp.float32), base["final_norm"][None].astype(jnp.float32)])
  n_in = noise.get("input_norm")
  n_next = None if n_in is None else jnp.concatenate([n_in[1:].astype(jnp.float32), jnp.zeros((1, d), jnp.float32)])
  x0 = layers.rms_norm(h, w_in[0], cfg.rms_norm_eps, None if n_in is None else n_in[0])
  w_post = n_post = None
  if FUSED_POST_ATTENTION:  # the post-attention norm's stacks, read in place by that kernel
    w_post, n_post = lay_lora.get("post_attn_norm", base["layers"]["post_attn_norm"]), noise.get("post_attn_norm")
    if not residual_norm.applies(h.reshape(b * t, d), w_post, n_post):
      w_post = n_post = None
  norms = _NextNorms(w_next, n_next, w_post, n_post)
  if PDL_CHAIN in (3, 4, 5) and w_post is not None and _qkv_ahead_applies(cfg, stacked, layer0(lay_lora), norms, b * t, h.dtype):
    # layer 0's q/k/v into its new buffer (the launcher zeroes it); each chain then writes the next layer's
    w_qkv = stacked["attn"]["qkv"]
    _, buffer0 = pallas_kernels.quantized_matmul_into(x0.reshape(b * t, d), w_qkv, None, 0, index=np.int32(0),
                                                      size=acc.size)
    return x0, buffer0, norms._replace(qkv_ahead=True)
  return x0, jnp.zeros((acc.size,), jnp.float32), norms


def _layers_call_applies(scanned: dict) -> bool:
  """Whether :data:`PDL_CHAIN` = 5 can run a decode step's layers as one call: besides what the chained layer needs
  (checked on the stacked 4-bit leaves), no bias on o, gate/up or down among the ``scanned`` leaves."""
  return not any(name + "_bias" in scanned.get(grp, {}) for grp, name in _CHAIN_LINEARS)


def _qkv_ahead_applies(cfg, stacked, ll0, norms, rows, dtype) -> bool:
  """Whether :data:`PDL_CHAIN` = 3 can compute each layer's fused q/k/v ahead (in the previous layer's chain): the
  4-bit stacks of q/k/v, o, gate/up and down, none with a bias (but q/k/v's, which the attention kernel adds) or an
  adapter (``ll0``: layer 0's adapter shapes), the fused decode attention, and :func:`decode_chain.applies` for
  ``rows`` rows; every layer has layer 0's shapes, so every layer then takes the chain."""
  ws, w_qkv = _chain_weights(stacked), stacked.get("attn", {}).get("qkv")
  if ws is None or not isinstance(w_qkv, nvfp4.NVFP4Tensor) or cfg.qk_norm or not FUSED_DECODE_ATTENTION:
    return False
  if any(v is not None for grp in ll0.values() if isinstance(grp, dict) for v in grp.values()):
    return False
  if decode_attn.auto_backend(dtype) == "reference":
    return False
  w_o, w_gu, w_down = ws
  o, h = jax.ShapeDtypeStruct((rows, w_o.shape[0]), dtype), jax.ShapeDtypeStruct((rows, cfg.hidden_size), dtype)
  return decode_chain.applies(o, h, w_o, w_gu, w_down, *_chain_norms(norms), w_qkv)


def lm_head_logits(cfg: ModelConfig, base: dict, hidden: jax.Array) -> jax.Array:
  """float32 logits ``[..., V]`` from final-normed hidden ``[..., D]`` (tied: ``embed.T``)."""
  dt = hidden.dtype
  if cfg.tie_word_embeddings or "lm_head" not in base:
    return jnp.einsum("...d,vd->...v", hidden, base["embed"].astype(dt),
                      preferred_element_type=jnp.float32)
  return jnp.dot(hidden, base["lm_head"].astype(dt), preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- log-probs

def token_ids_outside(tokens, vocab_size: int) -> Optional[str]:
  """What is out of range in concrete ``[B, T]`` token ids: ``"hold N id(s) outside [0, V) (the vocabulary), e.g.
  v at row r, column c"``, or None when every id is in range or ``tokens`` is traced (its values are unknown).
  An id beyond the embedding table reads NaN (JAX's out-of-bounds gather fills), a negative one another token."""
  try:
    t = np.asarray(tokens)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return None
  bad = np.argwhere((t < 0) | (t >= vocab_size))
  if not bad.size:
    return None
  (r, c), v = bad[0], t[tuple(bad[0])]
  return f"hold {len(bad)} id(s) outside [0, {vocab_size}) (the vocabulary), e.g. {v} at row {r}, column {c}"


def _check_token_ids(tokens, vocab_size: int) -> None:
  """TypeError for non-integer ``tokens``; ValueError for an id outside ``[0, vocab_size)`` when ``tokens`` is
  concrete (:func:`token_ids_outside`)."""
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise TypeError(f"tokens must hold integer ids, got dtype {tokens.dtype}")
  problem = token_ids_outside(tokens, vocab_size)
  if problem:
    raise ValueError(f"tokens {problem}")


def logprobs_from_hidden(cfg: ModelConfig, base: dict, hidden: jax.Array, targets: jax.Array, *,
                         chunk_size: int = 256, temperature: float = 1.0):
  """Log-probabilities and entropies from hidden states, chunked over the sequence.

  Each chunk computes ``[B, C, V]`` float32 logits, divides by ``temperature``,
  takes ``log_softmax``, gathers the target and the entropy
  ``-sum_v p_v log p_v`` (nats), and is rematerialised in the backward pass, so
  ``[B, T, V]`` float32 logits never exist at once (forward or gradient).

  Args:
    hidden: ``[B, T, D]`` final-normed hidden states.
    targets: int32 ``[B, T]``, the token whose log-probability is read at each position.
    chunk_size: C, tokens per chunk (T is padded up to a multiple).
    temperature: logits divisor (> 0).

  Returns:
    ``(logprobs [B, T] f32, entropy [B, T] f32)``.

  Raises:
    ValueError: ``temperature`` not a finite number > 0 (0 gave NaN, a negative one wrong values).
  """
  try:
    tau = float(temperature)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    tau = 1.0  # traced: not checked
  if not (math.isfinite(tau) and tau > 0):
    raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
  b, t, d = hidden.shape
  c = max(1, min(chunk_size, t))
  n = -(-t // c)
  pad = n * c - t
  if pad:
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
  h_chunks = hidden.reshape(b, n, c, d).swapaxes(0, 1)  # [n, B, C, D]
  t_chunks = targets.reshape(b, n, c).swapaxes(0, 1)

  @jax.checkpoint
  def one(args):
    h, tg = args
    logits = lm_head_logits(cfg, base, h) / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    lp = jnp.take_along_axis(logp, tg[..., None].astype(jnp.int32), axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return lp, ent

  lp, ent = jax.lax.map(one, (h_chunks, t_chunks))
  lp = lp.swapaxes(0, 1).reshape(b, n * c)[:, :t]
  ent = ent.swapaxes(0, 1).reshape(b, n * c)[:, :t]
  return lp, ent


def token_logprobs(cfg: ModelConfig, base: dict, tokens: jax.Array, positions: jax.Array, *,
                   lora: Optional[dict] = None, lora_cfg: Any = None,
                   norm_noise: Optional[dict] = None, attn_mask: Optional[jax.Array] = None,
                   remat: bool = True, chunk_size: int = 256, temperature: float = 1.0,
                   attn_chunk: Optional[int] = None, attn_impl: str = "xla"):
  """Log-probability of each token given its prefix, and the entropy of that prediction.

  ``logprobs[b, t] = log p(tokens[b, t] | tokens[b, :t])`` for ``t >= 1``
  (aligned with ``tokens``, so a completion mask over ``tokens`` applies
  directly); ``logprobs[:, 0] = 0`` and ``entropy[:, 0] = 0``.
  ``entropy[b, t]`` is the entropy (nats) of the distribution that predicted
  ``tokens[b, t]``. Differentiable w.r.t. ``lora`` (and ``norm_noise``).

  Args: as :func:`forward` (including ``attn_chunk`` and ``attn_impl``), plus ``chunk_size`` and
    ``temperature`` (see :func:`logprobs_from_hidden`). ``remat`` defaults to True (training).

  Returns:
    ``(logprobs [B, T] f32, entropy [B, T] f32)``.

  Raises:
    As :func:`forward`: ValueError for mismatched tokens / positions / mask shapes, TypeError for a
    bad ``lora_cfg``.
  """
  hidden, _ = forward(cfg, base, tokens, positions, lora=lora, lora_cfg=lora_cfg,
                      norm_noise=norm_noise, attn_mask=attn_mask, remat=remat, return_hidden=True,
                      attn_chunk=attn_chunk, attn_impl=attn_impl)
  lp, ent = logprobs_from_hidden(cfg, base, hidden[:, :-1], tokens[:, 1:],
                                 chunk_size=chunk_size, temperature=temperature)
  zeros = jnp.zeros((tokens.shape[0], 1), jnp.float32)
  return jnp.concatenate([zeros, lp], axis=1), jnp.concatenate([zeros, ent], axis=1)
