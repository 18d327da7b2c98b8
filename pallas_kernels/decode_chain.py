"""A decode step's layer after attention as one FFI call of six Gluon kernels (seven with the next layer's q/k/v),
joined by programmatic dependent launch (PDL).

In an accumulating decode step (``qerl_jax.models.decoder``, batch <= 32 on the Gluon W4A16 GEMV) a layer runs,
after attention: the o-projection into the layer's float32 accumulator, the residual add and post-attention
RMSNorm (:mod:`pallas_kernels.residual_norm`), the fused gate/up projection, SwiGLU (an XLA fusion), the
down-projection, and the residual add with the next layer's input norm. Each is its own FFI call, and XLA records
each FFI call as its own node of the step's CUDA graph, so every kernel waits for the one before it to drain
before it launches. :func:`post_attention` launches all six from one FFI call (``w4_gluon.chain_call``): with
``pdl`` each kernel after the first is launched with programmatic stream serialization and built with grid
dependency control (``GDC``): it loads its own weights (the GEMV its first K step's codes and scales, the
norms their weight and noise) before ``griddepcontrol.wait``, and lets the next kernel launch first. A probe
outside XLA (``experiments/lab/pdl_probe.py``, session 59) measured 4.8 µs a batch-8 7B layer on an H100 from PDL
on four of these boundaries. In the decoder (``decoder.PDL_CHAIN`` = 3, the default since session 60, with the next
layer's q/k/v) a batch-8 7B decode step took 2.473 instead of 2.594 ms at 2048 new tokens on an H100 (2.29x of bf16
instead of 2.19x); the same call without PDL gained nothing (docs/benchmarks.md, "Session 60").

Numerics equal the unchained path's: the same kernels (the GEMV's float32 atomics in another order only), SwiGLU
as ``silu(g) * u`` on the products rounded to bf16, as the decoder's ``(jax.nn.silu(g.f32) * u.f32).astype(bf16)``
up to the hardware exponential. GPU only; :func:`applies` says when.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import append_attention, residual_norm, w4_gluon, w4_triton

SWIGLU_CHUNK = 2048  # elements of y a SwiGLU program writes (4 a thread at 16 warps)
SWIGLU_WARPS = 16
GEMV_GDC = 6  # the GEMVs' GDC: step 0's codes and scales before the wait, the next kernel released (w4_gluon._gdc)
NORM_GDC = 5  # the norms' and SwiGLU's: their weights (none for SwiGLU) before the wait, the next kernel released


class NormStacks(NamedTuple):
  """A norm's ``[L, D]`` weight stack (bf16 or float32) and optional float32 AQN noise stack (QeRL Sec. 3.3),
  read at the layer index by :mod:`pallas_kernels.residual_norm`'s kernel."""
  weight: jax.Array
  noise: Optional[jax.Array]


class NextAttention(NamedTuple):
  """What the chain needs to run the next layer's decode attention after its q/k/v (``decoder.PDL_CHAIN`` = 4; the
  kernel of :mod:`pallas_kernels.append_attention`): the stacked bf16 KV caches ``[L, B, S, Hkv, hd]`` and the
  attention's int32 counters ``[B Hkv]`` (all updated in place), the fused q/k/v bias stack ``[L, (H + 2 Hkv) hd]``
  (bf16 or float32) or None, the step's int8 slot mask ``[B, S]``, filled length (int32 scalar), RoPE's float32 cos
  and sin ``[B, hd / 2]``, and the query heads ``H``."""
  k_cache: jax.Array
  v_cache: jax.Array
  sync: jax.Array
  bias: Optional[jax.Array]
  slot_mask: jax.Array
  length: jax.Array
  cos: jax.Array
  sin: jax.Array
  num_heads: int


def attention_applies(nxt: NextAttention, rows: int, w_qkv) -> bool:
  """Whether :func:`post_attention` can run the next layer's attention from ``nxt`` after a q/k/v product of
  ``rows`` rows by ``w_qkv`` ``[L, D, (H + 2 Hkv) hd]``: bf16 caches of ``rows`` rows and of ``w_qkv``'s layers, a
  head dim of at least 32 (the Triton kernel's RoPE halves feed 16-wide dots), counters and a bias of the right
  shapes."""
  kc = nxt.k_cache
  if kc.ndim != 5 or nxt.v_cache.shape != kc.shape or kc.dtype != jnp.bfloat16 or nxt.v_cache.dtype != jnp.bfloat16:
    return False
  n_layers, b, s, kh, hd = kc.shape
  n = (nxt.num_heads + 2 * kh) * hd
  if b != rows or hd < 32 or hd % 2 or nxt.num_heads % kh or w_qkv.shape[1] != n or w_qkv.packed.shape[0] != n_layers:
    return False
  if nxt.bias is not None and (nxt.bias.shape != (n_layers, n) or nxt.bias.dtype not in (jnp.bfloat16, jnp.float32)):
    return False
  return (nxt.sync.shape == (b * kh,) and nxt.sync.dtype == jnp.int32 and nxt.slot_mask.shape == (b, s)
          and nxt.cos.shape == (b, hd // 2) and nxt.sin.shape == (b, hd // 2))


def _attention_io(na: NextAttention, m: int, w_qkv) -> tuple:
  """The chain's operands and results for :class:`NextAttention` ``na`` (``m`` rows, q/k/v stack ``w_qkv``): ``(bias,
  operands, results)``, the operands bias, cos, sin, k, v, mask, length, sync (8), the results k, v, the partials
  o / m / l, the output and sync (7); k, v and sync are aliased operand -> result (:func:`_attention_aliases`).
  ``bias`` is ``na.bias``, or where there is none and :data:`append_attention.FORM` is ``"pallas"`` (whose kernel
  always reads one) a float32 zero stack."""
  n_layers, _, slots, kh, hd = na.k_cache.shape
  bias = na.bias
  if bias is None and append_attention.FORM == "pallas":
    bias = jnp.zeros((n_layers, w_qkv.shape[1]), jnp.float32)
  operands = [jnp.zeros((1,), jnp.float32) if bias is None else bias, na.cos.astype(jnp.float32),
              na.sin.astype(jnp.float32), na.k_cache, na.v_cache, na.slot_mask.astype(jnp.int8),
              jnp.asarray(na.length, jnp.int32).reshape(1), na.sync]
  geo = append_attention.geometry(m, na.num_heads, kh, slots)
  results = [jax.ShapeDtypeStruct(na.k_cache.shape, jnp.bfloat16), jax.ShapeDtypeStruct(na.v_cache.shape, jnp.bfloat16)]
  results += [jax.ShapeDtypeStruct((size,), jnp.float32) for size in append_attention.partial_shapes(m, kh, hd, geo)]
  results += [jax.ShapeDtypeStruct((m * na.num_heads, hd), jnp.bfloat16), jax.ShapeDtypeStruct(na.sync.shape, jnp.int32)]
  return bias, operands, results


def _attention_aliases(i_att: int, r_att: int) -> dict:
  """``{operand: result}`` of :func:`_attention_io`'s k, v and sync, its operands from ``i_att`` and its results from
  result index ``r_att``."""
  return {i_att + 3: r_att, i_att + 4: r_att + 1, i_att + 7: r_att + 6}


def _attention_launch(na: NextAttention, bias, m: int, i_att: int, r_att: int, qkv_buf: int, layer_buf: int, *,
                      layer_offset: int = 0, skip_past_last: bool = False, pdl: bool) -> w4_gluon.ChainLaunch:
  """:mod:`pallas_kernels.append_attention`'s kernel over :func:`_attention_io`'s buffers (operands from buffer
  ``i_att``, results from buffer ``r_att``), the q/k/v product at the head of ``qkv_buf`` and the layer index in
  ``layer_buf`` at ``layer_offset`` bytes."""
  n_layers, _, slots, kh, hd = na.k_cache.shape
  bufs = append_attention.Buffers(qkv=qkv_buf, bias=i_att, cos=i_att + 1, sin=i_att + 2, k=r_att, v=r_att + 1,
                                  mask=i_att + 5, layer=layer_buf, length=i_att + 6, o_part=r_att + 2,
                                  m_part=r_att + 3, l_part=r_att + 4, out=r_att + 5, sync=r_att + 6,
                                  layer_offset=layer_offset)
  return append_attention.launch(bufs, batch=m, heads=na.num_heads, heads_kv=kh, slots=slots, head_dim=hd,
                                 layers=n_layers, bias_dtype=None if bias is None else bias.dtype,
                                 bias_stacked=bias is not None, skip_past_last=skip_past_last, pdl=pdl)


@functools.lru_cache(maxsize=None)
def _swiglu_kernel():
  """The Gluon SwiGLU kernel (imports triton lazily): program ``p`` writes ``y``'s elements ``p * C .. p * C + C
  - 1`` (``y`` row-major ``[M, I]``) from the fused gate/up product ``[M, 2I]`` (float32, at element ``OFF`` of
  its buffer)."""
  from triton.experimental import gluon
  from triton.experimental.gluon import language as ttgl

  gdc = w4_gluon._gdc()

  @gluon.jit
  def swiglu_rows(gu_ptr, y_ptr, M: ttgl.constexpr, I: ttgl.constexpr, OFF: ttgl.constexpr, C: ttgl.constexpr,
                  WARPS: ttgl.constexpr, GDC: ttgl.constexpr = 0):
    lay: ttgl.constexpr = ttgl.BlockedLayout([C // (32 * WARPS)], [32], [WARPS], [0])
    e = ttgl.program_id(0) * C + ttgl.arange(0, C, layout=lay)
    m = e < M * I
    row = e // I
    g_at = gu_ptr + OFF + row * (2 * I) + (e - row * I)
    if GDC:
      gdc(GDC)
    # the products rounded to bf16 first, as the decoder's finish_linear
    g = ttgl.load(g_at, mask=m, other=0.0).to(ttgl.bfloat16).to(ttgl.float32)
    u = ttgl.load(g_at + I, mask=m, other=0.0).to(ttgl.bfloat16).to(ttgl.float32)
    ttgl.store(y_ptr + e, (g / (1.0 + ttgl.exp(-g)) * u).to(ttgl.bfloat16), mask=m)

  return swiglu_rows


@functools.lru_cache(maxsize=None)
def _swiglu_compiled(meta: tuple):
  """``(ptx, kernel name, shared bytes)`` of the SwiGLU kernel for the constexprs ``meta``."""
  return w4_gluon._load(w4_gluon._compile_gluon(_swiglu_kernel(), ("*fp32", "*bf16"), dict(meta),
                                                w4_gluon._target_cc(), num_warps=SWIGLU_WARPS))


def _with_gdc(meta: dict, g: int, pdl: bool) -> tuple:
  """``meta``'s items, with the constexpr ``GDC = g`` when launched under PDL."""
  return tuple(dict(meta, **({"GDC": g} if pdl else {})).items())


def _gemv_launch(m: int, w, i_w: int, x_buf: int, layer_buf: int, out: int, at: int, *, pdl: bool,
                 first: bool = False, layer_offset: int = 0, release: bool = True) -> w4_gluon.ChainLaunch:
  """The decode GEMV ``buffer[out][at:] += buffer[x_buf] @ W`` (``m`` rows) as a chain launch: ``W``'s codes, scales
  and global scales the operands ``i_w .. i_w + 2``, its layer read from ``layer_buf`` at ``layer_offset`` bytes;
  without ``release`` the next kernel launches only as it ends."""
  b = w4_gluon._build_for(m, w, 0)
  ptx = w4_gluon._compiled(_with_gdc(b.meta, GEMV_GDC if release else GEMV_GDC & ~4, pdl), b.wg, b.narrow_n,
                           b.maxnreg, b.w8)
  # x, codes, scales, global scales, layer, the zeros operand (the output buffer), the output at its region
  params = ((x_buf, 0), (i_w, 0), (i_w + 1, 0), (i_w + 2, 0), (layer_buf, layer_offset), (out, 0), (out, 4 * at))
  return w4_gluon.ChainLaunch(*ptx, b.grid, b.threads, params, pdl=pdl and not first)


def _norm_launch(m: int, d: int, stacks: NormStacks, i_stacks: int, eps: float, h_buf: int, acc_buf: int, at: int,
                 layer_buf: int, h_out: int, x_out: int, zeros: int, zeros_buf: int, *, pdl: bool,
                 layer_offset: int = 0) -> w4_gluon.ChainLaunch:
  """:mod:`pallas_kernels.residual_norm`'s kernel as a chain launch: ``h_out = h + acc[at:]``, ``x_out`` its RMSNorm by
  the stacks (operands ``i_stacks``, ``i_stacks + 1``) at the layer in ``layer_buf``, and ``zeros`` float32 zeros
  into ``zeros_buf`` (none for 0)."""
  meta = residual_norm._meta(m, d, stacks.weight.shape[0], at, eps, stacks.noise is not None, zeros)
  ptx = residual_norm._compiled(_with_gdc(meta, NORM_GDC, pdl),
                                "*bf16" if stacks.weight.dtype == jnp.bfloat16 else "*fp32")
  params = ((h_buf, 0), (acc_buf, 0), (i_stacks, 0), (i_stacks + 1, 0), (layer_buf, layer_offset), (h_out, 0),
            (x_out, 0), (zeros_buf if zeros else acc_buf, 0))
  grid = (m + -(-zeros // residual_norm.ZERO_CHUNK), 1, 1)
  return w4_gluon.ChainLaunch(*ptx, grid, 32 * residual_norm.WARPS, params, pdl=pdl)


def _swiglu_launch(m: int, inter: int, acc_buf: int, gu_at: int, y_buf: int, *, pdl: bool) -> w4_gluon.ChainLaunch:
  """The SwiGLU kernel as a chain launch: ``y = silu(g) * u`` from the gate/up product at ``acc[gu_at:]``."""
  sw_meta = dict(M=m, I=inter, OFF=gu_at, C=SWIGLU_CHUNK, WARPS=SWIGLU_WARPS)
  return w4_gluon.ChainLaunch(*_swiglu_compiled(_with_gdc(sw_meta, NORM_GDC, pdl)),
                              (-(-m * inter // SWIGLU_CHUNK), 1, 1), 32 * SWIGLU_WARPS, ((acc_buf, 0), (y_buf, 0)),
                              pdl=pdl)


def _gemv_build(m: int, w):
  """The decode GEMV's build for ``m`` rows times the stack ``w``, or None where the chain cannot launch it: it
  must add its split-K parts by atomics into the accumulator, and be an mma.sync build (M <= 16) on the main loop
  that honours ``GDC`` (the wgmma, warp-specialized, TMA and x-ring main loops have no ``griddepcontrol.wait``: under
  PDL they would read x before the kernel that writes it has finished)."""
  b = w4_gluon._build_for(m, w, 0)
  if not b.meta["ATOMIC"] or b.wg or b.meta.get("XS") or b.meta.get("WS") or "TS" in b.meta or b.meta.get("LP"):
    return None
  return b


def applies(o: jax.Array, h: jax.Array, w_o, w_gate_up, w_down, post: NormStacks, nxt: NormStacks,
            w_qkv=None) -> bool:
  """Whether :func:`post_attention` takes these: NVFP4 weight stacks ``[L, K, N]`` that
  :func:`w4_gluon.into_applies` takes for the rows at hand (o ``[M, Q]`` -> ``[M, D]``, gate/up ``[M, D]`` ->
  ``[M, 2I]``, down ``[M, I]`` -> ``[M, D]``, and the optional next q/k/v ``[M, D]`` -> ``[M, N]``) with builds
  :func:`post_attention` can chain, and norm stacks that :func:`residual_norm.applies` takes for ``h`` (bf16
  ``[M, D]``)."""
  if o.ndim != 2 or h.ndim != 2 or o.shape[0] != h.shape[0]:
    return False
  m, d = h.shape
  if not (residual_norm.applies(h, post.weight, post.noise) and residual_norm.applies(h, nxt.weight, nxt.noise)):
    return False
  shapes = ((o.shape[1], d), (d, None), (None, d))
  for w, (k, n) in zip((w_o, w_gate_up, w_down), shapes):
    if getattr(w, "packed", None) is None or w.packed.ndim != 3 or (k is not None and w.shape[0] != k) or (
        n is not None and w.shape[1] != n):
      return False
  inter = w_gate_up.shape[1] // 2
  if w_gate_up.shape[1] != 2 * inter or w_down.shape[0] != inter:
    return False
  products = [(o.shape[1], w_o), (d, w_gate_up), (inter, w_down)]
  if w_qkv is not None:
    if getattr(w_qkv, "packed", None) is None or w_qkv.packed.ndim != 3 or w_qkv.shape[0] != d:
      return False
    products.append((d, w_qkv))
  for x_cols, w in products:
    x = jax.ShapeDtypeStruct((m, x_cols), jnp.bfloat16)
    if not w4_gluon.into_applies(x, w, 0) or _gemv_build(m, w) is None:
      return False
  return o.dtype == jnp.bfloat16


def post_attention(o: jax.Array, h: jax.Array, acc: jax.Array, offset: int, w_o, w_gate_up, w_down, index,
                   post: NormStacks, nxt: NormStacks, eps: float, *, zero_size: int, pdl: bool = True,
                   next_qkv=None, next_attention: Optional[NextAttention] = None):
  """A decode layer after attention, as one FFI call of six kernels (module docstring).

  In order: ``acc[o_at] = o @ W_o``; ``h1 = h + acc[o_at]``, ``x1 = RMSNorm(h1) * (post.weight + post.noise)``;
  ``acc[gu_at] = x1 @ W_gate_up``; ``y = silu(g) * u`` (SwiGLU, Shazeer 2020; ``g, u`` the halves of the product,
  each rounded to bf16); ``acc[down_at] = y @ W_down``; ``h2 = h1 + acc[down_at]``, ``x_next = RMSNorm(h2) *
  (nxt.weight + nxt.noise)``, and a zeroed float32 buffer for the next layer. Regions follow each other from
  ``offset``: ``o_at = [offset, offset + M D)``, then ``M 2I`` elements for gate/up, then ``M D`` for down. With
  ``next_qkv`` a seventh kernel (PDL too) writes the next layer's fused q/k/v product ``x_next @ W_qkv`` into the
  head of the new buffer (``[0, M N)``, float32), where that layer's attention reads it. With ``next_attention``
  too, an eighth kernel (PDL: it reads the caches' earlier slots before its wait) runs that attention
  (:mod:`pallas_kernels.append_attention`: bias, RoPE, the cache append at slot ``length - 1`` and attention over
  the filled slots); past the last layer it writes nothing.

  Args:
    o: bf16 ``[M, Q]``, attention's output.
    h: bf16 ``[M, D]``, the residual stream.
    acc: float32 ``[S]``, the layer's accumulator, zero from ``offset`` on (aliased: its update is returned).
    offset: static int, elements, a multiple of 4 (the kernels' pointers are 16-byte aligned).
    w_o, w_gate_up, w_down: :class:`~qerl_jax.nvfp4.NVFP4Tensor` stacks ``[L, Q, D]``, ``[L, D, 2I]``,
      ``[L, I, D]`` (gate's columns before up's), read at layer ``index``.
    index: int32 scalar (may be traced), clamped to ``[0, L)`` by the kernels.
    post, nxt: :class:`NormStacks` ``[L, D]`` of the post-attention norm and of the norm after the layer.
    eps: the norms' epsilon (compiled in).
    zero_size: static int > 0, the next layer's accumulator's length.
    pdl: launch kernels 2-6 (7) with PDL (their ``GDC`` builds; sm_90 and later, else ignored); False launches the
      library's builds in order.
    next_qkv: optional ``(w_qkv, next_index)``: the fused q/k/v stack ``[L, D, N]`` (``M N <= zero_size``) and the
      next layer's index (int32 scalar, may be traced; clamped to ``[0, L)``: after the last layer the product is
      of no use but harmless).
    next_attention: optional :class:`NextAttention` (needs ``next_qkv``; :func:`attention_applies`).

  Returns:
    ``(h2, x_next, zeros, acc)``: bf16 ``[M, D]`` twice, float32 ``[zero_size]`` zeros (with ``next_qkv``, the next
    q/k/v at the head), and ``acc`` with the three regions written; with ``next_attention`` a fifth,
    ``(o_next bf16 [M, H hd], k cache, v cache, sync)``: the next layer's attention output (unwritten after the last
    layer) and the updated caches and counters.

  Raises:
    ValueError: :func:`applies` is False, ``acc`` is not 1-D float32, ``offset`` is not a multiple of 4, the regions
      do not fit in it, ``zero_size`` is not positive (or too small for the next q/k/v), or ``next_attention``
      without ``next_qkv`` or that :func:`attention_applies` refuses.
  """
  w_qkv = None if next_qkv is None else next_qkv[0]
  if not applies(o, h, w_o, w_gate_up, w_down, post, nxt, w_qkv):
    raise ValueError(f"decode_chain.post_attention: no chain for o {o.dtype}{list(o.shape)}, h {h.dtype}"
                     f"{list(h.shape)} and weights {[list(w.shape) for w in (w_o, w_gate_up, w_down)]} here "
                     "(needs the Gluon FFI launcher, NVFP4 stacks on atomic GEMV builds; see applies)")
  m, d = h.shape
  inter = w_down.shape[0]
  offset, zero_size = int(offset), int(zero_size)
  if acc.ndim != 1 or acc.dtype != jnp.float32:
    raise ValueError(f"decode_chain.post_attention: acc must be 1-D float32, got {acc.dtype}{list(acc.shape)}")
  o_at, gu_at = offset, offset + m * d
  down_at = gu_at + 2 * m * inter
  if offset % 4:  # (the kernels take their pointers as 16-byte aligned, as Triton specializes them)
    raise ValueError(f"decode_chain.post_attention: offset {offset} is not a multiple of 4 elements (16 bytes)")
  if offset < 0 or down_at + m * d > acc.shape[0]:
    raise ValueError(f"decode_chain.post_attention: regions [{offset}, {down_at + m * d}) do not fit a buffer of "
                     f"{acc.shape[0]} elements")
  if zero_size <= 0 or (w_qkv is not None and m * w_qkv.shape[1] > zero_size):
    raise ValueError(f"decode_chain.post_attention: zero_size must be > 0 and hold the next q/k/v, got {zero_size}")

  if next_attention is not None and (w_qkv is None or not attention_applies(next_attention, m, w_qkv)):
    raise ValueError("decode_chain.post_attention: next_attention needs next_qkv and bf16 caches of its rows and "
                     "layers, head dim >= 32, counters, mask, cos/sin and bias of matching shapes (attention_applies)")

  pdl = pdl and w4_gluon._target_cc() >= 90  # (griddepcontrol is sm_90's; older GPUs launch the chain in order)

  ops = [o]  # operand 0; then each weight's codes, scales, global scales; one layer index
  gemvs = []
  for w in (w_o, w_gate_up, w_down) + (() if w_qkv is None else (w_qkv,)):
    codes, scales, gs, _ = w4_triton._layer_operands(w, w4_triton._format_of(w), index)
    gemvs.append((len(ops), w))
    ops += [codes, scales, gs]
  layer = jnp.asarray(index, jnp.int32).reshape(1)
  i_layer, i_h = len(ops), len(ops) + 1
  ops += [layer, h]
  if w_qkv is not None:  # (after h: the operands before it keep their places)
    i_next = len(ops)
    ops.append(jnp.asarray(next_qkv[1], jnp.int32).reshape(1))
  i_norm = len(ops)  # post weight, post noise, next weight, next noise
  for stacks in (post, nxt):
    ops += [stacks.weight, jnp.zeros((1,), jnp.float32) if stacks.noise is None else stacks.noise]
  i_acc = len(ops)
  ops.append(acc)
  aliases = {i_acc: 0}
  if next_attention is not None:  # (after acc: the operands before it keep their places)
    att_bias, att_ops, att_out = _attention_io(next_attention, m, w_qkv)
    i_att = len(ops)  # bias, cos, sin, k, v, mask, length, sync
    ops += att_ops
  n_ops = len(ops)
  r_acc, r_h1, r_x1, r_y, r_h2, r_x, r_z = range(n_ops, n_ops + 7)
  out = [jax.ShapeDtypeStruct(acc.shape, jnp.float32)] + [jax.ShapeDtypeStruct((m, d), jnp.bfloat16)] * 2 + [
      jax.ShapeDtypeStruct((m, inter), jnp.bfloat16)] + [jax.ShapeDtypeStruct((m, d), jnp.bfloat16)] * 2 + [
      jax.ShapeDtypeStruct((zero_size,), jnp.float32)]
  if next_attention is not None:  # results: k, v (aliased), the partials, o_next, sync (aliased)
    r_att = n_ops + len(out)
    aliases.update(_attention_aliases(i_att, len(out)))
    out += att_out

  def gemv(which: int, x_buf: int, at: int, first: bool, out: int | None = None,
           layer_buf: int | None = None) -> w4_gluon.ChainLaunch:
    i_w, w = gemvs[which]
    return _gemv_launch(m, w, i_w, x_buf, i_layer if layer_buf is None else layer_buf, r_acc if out is None else out,
                        at, pdl=pdl, first=first)

  def norm(stacks: NormStacks, i_stacks: int, h_buf: int, at: int, h_out: int, x_out: int, zeros: int):
    return _norm_launch(m, d, stacks, i_stacks, eps, h_buf, r_acc, at, i_layer, h_out, x_out, zeros, r_z, pdl=pdl)

  launches = [gemv(0, 0, o_at, True),
              norm(post, i_norm, i_h, o_at, r_h1, r_x1, 0),
              gemv(1, r_x1, gu_at, False),
              _swiglu_launch(m, inter, r_acc, gu_at, r_y, pdl=pdl),
              gemv(2, r_y, down_at, False),
              norm(nxt, i_norm + 2, r_h1, down_at, r_h2, r_x, zero_size)]
  if w_qkv is not None:  # the next layer's q/k/v into the head of the new buffer
    launches.append(gemv(3, r_x, 0, False, out=r_z, layer_buf=i_next))
  if next_attention is not None:  # the next layer's attention on it (nothing past the last layer)
    launches.append(_attention_launch(next_attention, att_bias, m, i_att, r_att, r_z, i_next, skip_past_last=True,
                                      pdl=pdl))
  res = w4_gluon.chain_call(launches, ops, out, aliases=aliases)
  acc, _, _, _, h2, x_next, zeros = res[:7]
  if next_attention is None:
    return h2, x_next, zeros, acc
  kc, vc, _, _, _, o_next, sync = res[7:]
  return h2, x_next, zeros, acc, (o_next, kc, vc, sync)


def decode_layers(h: jax.Array, o0: jax.Array, buffer0: jax.Array, offset: int, w_qkv, w_o, w_gate_up, w_down,
                  post: NormStacks, nxt: NormStacks, attention: NextAttention, eps: float, *, zero_size: int,
                  pdl: bool = True):
  """Every layer of a decode step after layer 0's attention as one FFI call (``decoder.PDL_CHAIN`` = 5, lab): for
  each layer :func:`post_attention`'s kernels, then (but after the last layer) the next layer's q/k/v and attention,
  ``8 L - 2`` kernels joined by PDL, so that no CUDA-graph node boundary sits inside the step's layers.

  The layer's float32 accumulators alternate between ``buffer0`` (layer 0's, its q/k/v at the head) and a second
  buffer of ``zero_size`` elements, which each layer's end zeroes for the next; the residual stream alternates
  between two bf16 buffers. The layer index each kernel reads comes from an int32 operand holding ``l`` at element
  ``4 l`` (a 16-byte aligned pointer a layer).

  Args:
    h: bf16 ``[M, D]``, the residual stream entering layer 0 (the embeddings).
    o0: bf16 ``[M, H hd]``, layer 0's attention output.
    buffer0: float32 ``[zero_size]``, layer 0's accumulator: its q/k/v product at the head, zero from ``offset``.
    offset: static int, the o region's first element (``M (H + 2 Hkv) hd``), a multiple of 4.
    w_qkv, w_o, w_gate_up, w_down: :class:`~qerl_jax.nvfp4.NVFP4Tensor` stacks ``[L, D, N]``, ``[L, Q, D]``, ``[L, D,
      2I]``, ``[L, I, D]``.
    post, nxt: :class:`NormStacks` ``[L, D]``: the post-attention norms, and the norm after each layer (the next
      layer's input norm, the final norm after the last).
    attention: :class:`NextAttention`, the step's caches, counters, bias, mask, length, cos and sin.
    eps: the norms' epsilon.
    zero_size: static int, an accumulator's length (``buffer0``'s).
    pdl: as :func:`post_attention`.

  Returns:
    ``(h, x, k cache, v cache, sync)``: the residual stream after the last layer and its final norm (bf16 ``[M, D]``),
    the caches with this step's slot written in every layer, and the counters (zero).

  Raises:
    ValueError: :func:`applies` or :func:`attention_applies` is False, a buffer of the wrong size, or ``offset``
      not a multiple of 4.
  """
  m, d = h.shape
  n_layers = w_o.packed.shape[0]
  if not (applies(o0, h, w_o, w_gate_up, w_down, post, nxt, w_qkv) and attention_applies(attention, m, w_qkv)):
    raise ValueError(f"decode_chain.decode_layers: no chain for h {h.dtype}{list(h.shape)}, o {o0.dtype}"
                     f"{list(o0.shape)} and these weights and caches (see applies, attention_applies)")
  inter = w_down.shape[0]
  offset, zero_size = int(offset), int(zero_size)
  o_at, gu_at = offset, offset + m * d
  down_at = gu_at + 2 * m * inter
  if offset % 4 or buffer0.shape != (zero_size,) or buffer0.dtype != jnp.float32 or down_at + m * d > zero_size or (
      m * w_qkv.shape[1] > offset):
    raise ValueError(f"decode_chain.decode_layers: buffer0 must be float32 [zero_size = {zero_size}] holding the "
                     f"q/k/v head before offset {offset} (a multiple of 4) and the o, gate/up and down regions "
                     f"after it; got {buffer0.dtype}{list(buffer0.shape)}")
  pdl = pdl and w4_gluon._target_cc() >= 90
  na = attention

  ops, weights = [], []
  for w in (w_o, w_gate_up, w_down, w_qkv):
    codes, scales, gs, _ = w4_triton._layer_operands(w, w4_triton._format_of(w), 0)
    weights.append(len(ops))
    ops += [codes, scales, gs]
  i_o, i_gu, i_down, i_qkv = weights
  i_idx = len(ops)  # layer l's index at element 4 l
  ops.append(jnp.asarray(np.repeat(np.arange(n_layers + 1, dtype=np.int32), 4)))
  i_norm = len(ops)  # post weight, post noise, next weight, next noise
  for stacks in (post, nxt):
    ops += [stacks.weight, jnp.zeros((1,), jnp.float32) if stacks.noise is None else stacks.noise]
  i_h0, i_o0, i_buf0 = len(ops), len(ops) + 1, len(ops) + 2
  ops += [h, o0, buffer0]
  bias, att_ops, att_out = _attention_io(na, m, w_qkv)
  i_att = len(ops)  # bias, cos, sin, k, v, mask, length, sync
  ops += att_ops
  n_ops = len(ops)
  bf, f32 = jnp.bfloat16, jnp.float32
  out = [jax.ShapeDtypeStruct((zero_size,), f32)] * 2  # the accumulators A (aliased to buffer0) and B
  out += [jax.ShapeDtypeStruct((m, d), bf)] * 4  # the residual stream's two buffers, x after attention, x next
  out += [jax.ShapeDtypeStruct((m, inter), bf)]  # SwiGLU's y
  # then the attention's: k, v, the partials, its output o (each layer's), sync
  r_a, r_b, r_ha, r_hb, r_x1, r_x, r_y = range(n_ops, n_ops + len(out))
  r_att, r_o = n_ops + len(out), n_ops + len(out) + 5
  aliases = {i_buf0: 0, **_attention_aliases(i_att, len(out))}
  out += att_out
  gemv = lambda i_w, w, x_buf, out_buf, at, layer, first=False, release=True: _gemv_launch(
      m, w, i_w, x_buf, i_idx, out_buf, at, pdl=pdl, first=first, layer_offset=16 * layer, release=release)
  launches = []
  for layer in range(n_layers):
    acc, new = (r_a, r_b) if layer % 2 == 0 else (r_b, r_a)
    h_in, o_in = (i_h0, i_o0) if layer == 0 else (r_ha, r_o)
    last = layer == n_layers - 1
    launches += [
        gemv(i_o, w_o, o_in, acc, o_at, layer, first=layer == 0),
        _norm_launch(m, d, post, i_norm, eps, h_in, acc, o_at, i_idx, r_hb, r_x1, 0, acc, pdl=pdl,
                     layer_offset=16 * layer),
        gemv(i_gu, w_gate_up, r_x1, acc, gu_at, layer),
        _swiglu_launch(m, inter, acc, gu_at, r_y, pdl=pdl),
        gemv(i_down, w_down, r_y, acc, down_at, layer),
        _norm_launch(m, d, nxt, i_norm + 2, eps, r_hb, acc, down_at, i_idx, r_ha, r_x, 0 if last else zero_size,
                     new, pdl=pdl, layer_offset=16 * layer)]
    if not last:  # the next layer's q/k/v into the head of its (just zeroed) accumulator, then its attention. The
      # q/k/v GEMV does not release the attention early: launched under it, the attention's programs landed on the SMs
      # the GEMV had left, and a batch-8 step took 2.604 against 2.516 ms (session 65, H100)
      launches += [gemv(i_qkv, w_qkv, r_x, new, 0, layer + 1, release=False),
                   _attention_launch(na, bias, m, i_att, r_att, new, i_idx, layer_offset=16 * (layer + 1), pdl=pdl)]
  res = w4_gluon.chain_call(launches, ops, out, aliases=aliases)
  k_out = r_att - n_ops
  return res[r_ha - n_ops], res[r_x - n_ops], res[k_out], res[k_out + 1], res[k_out + 6]


__all__ = ["NextAttention", "NormStacks", "applies", "attention_applies", "decode_layers", "post_attention"]
