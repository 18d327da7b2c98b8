"""A decode step's attention with the KV-cache append, as a Triton kernel that a PDL chain can launch.

:func:`pallas_kernels.decode_attention.decode_attention_append` does, for one layer of a decode step, the bias add
and rounding of the fused q/k/v product, RoPE on the new token's queries and key, the write of its key and value
into the stacked KV cache, and grouped-query attention over the filled slots (flash-decoding splits merged in the
kernel by the last program of each (row, KV head)). It is a Pallas kernel, so XLA launches it as its own node of the
decode step's CUDA graph, after the q/k/v projection has drained and before the o-projection may start.

This module is the same computation written in Triton directly, compiled ahead of time to PTX so that
:func:`pallas_kernels.w4_gluon.chain_call` can launch it in one FFI call with the layer's other kernels, joined by
programmatic dependent launch (PDL, :mod:`pallas_kernels.decode_chain`). With the constexpr ``GDC`` it reads
everything that no kernel of the chain writes before ``griddepcontrol.wait`` (layer and length, RoPE's cos and sin,
the bias, the slot mask and the first block of its chunk of keys and values: slots before this step's were written
by earlier steps) and the q/k/v product after it.

Numerics follow :func:`~pallas_kernels.decode_attention.decode_attention_append`: ``y = qkv + bias`` in float32
rounded to bf16, RoPE (Su et al. 2021, "rotate half") with each product and sum rounded to bf16, scores in
float32 from bf16 operands, the online softmax of Milakov & Gimelshein (2018) over blocks of slots, splits merged
by running max and rescaled sums. Only bf16 models and caches.

:func:`attend_append` runs the kernel on its own: through the FFI launcher on a GPU, or in Triton's interpreter on
torch CPU tensors (tests).

Status (H100, batch 8, 7B heads, 1300 filled slots). In session 63 the kernel took 19.0 µs a layer against the
Pallas kernel's 14.2. Session 64 traced the gap to Triton 3.6's lowering of the merge of the splits. The kernel now
takes 14.6 µs a layer against 13.9 for XLA's build, yet the chained decode step is still slower than the default:
2.557 against 2.422 ms. ``decoder.PDL_CHAIN`` 4 and 5 stay lab settings; see docs/benchmarks.md, "Session 64".
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from pallas_kernels import decode_attention as da

BLOCK_S = 64  # slots a loop step (decode_attention.APPEND_BLOCK_S)
TARGET_PROGRAMS = 528  # programs over (row, KV head, split) the splits aim at (decode_attention.APPEND_TARGET_PROGRAMS)
WARPS = 4
PREFETCH = 0  # 0: each loop step loads its own block, staged by Triton's pipeliner over STAGES (the Pallas kernel's
# form: 156 registers at the 7B heads, offline sm_90, three programs an SM); 1: each program loads the first block of
# keys and values before its PDL wait and the next block in registers while it works on the current one (STAGES 1):
# 210 registers, two programs an SM, so a batch-8 step's 384 programs take two waves (session 63 on an H100: a
# batch-8 decode step 2.686 ms with it in the chain against 2.467 with the Pallas kernel alone); 2: 0, and before the
# PDL wait each thread asks the L2 for a line of the first block's keys and one of its values (prefetch.global.L2; 157
# registers)
STAGES = 2
MERGE_CHUNK = 8  # splits' partials the merging program loads at once. It merges them one after another,
# elementwise: session 63's reduction over a chunk of them ([chunk, rows, hd]) is lowered by Triton 3.6 through shared
# memory (offline, sm_90, 7B heads: after the main loop 92 shared loads, 90 stores, 77 shuffles and 22 barriers
# against 10, 6, 5 and 6; 158 registers against 96). On an H100 (28 layers, batch 8, 1300 slots) 524.0 against
# 409.5 µs, and 389.1 for the Pallas kernel built and launched by XLA (session 64)
FORM = "tl"  # "tl": this module's Triton kernel; "pallas" (lab, session 63): the Pallas kernel's own Triton IR,
# captured from its lowering and compiled here (its PDL build waits first thing), for the chain of
# decode_chain.decode_layers (PDL_CHAIN = 5) only: it clamps the layer index and never skips, so it cannot run past
# the last layer as PDL_CHAIN = 4's chain asks
GDC = 5  # launched under PDL: the next kernel released at the start (bit 2), the wait before the q/k/v loads


class Geometry(NamedTuple):
  """A launch's shape: ``group`` query heads a KV head, padded to ``group_pad`` rows (tensor-core dots need 16),
  ``group_rows`` (a power of two) for the merge, ``nsplit`` splits of ``chunk`` slots over ``block_s`` blocks,
  ``parts`` partial rows (``nsplit`` rounded up to whole merge chunks)."""
  group: int
  group_pad: int
  group_rows: int
  block_s: int
  nsplit: int
  chunk: int
  merge_chunk: int
  parts: int


def geometry(batch: int, heads: int, heads_kv: int, slots: int, *, block_s: int | None = None,
             splits: int | None = None, target_programs: int | None = None) -> Geometry:
  """The launch geometry for a cache of ``slots`` slots (as :func:`decode_attention_append`'s; None takes the module's
  :data:`BLOCK_S` and :data:`TARGET_PROGRAMS`, read at the call).

  Raises:
    ValueError: ``heads`` not a multiple of ``heads_kv``, or ``block_s`` not a power of 2 >= 16.
  """
  block_s = BLOCK_S if block_s is None else block_s
  target_programs = TARGET_PROGRAMS if target_programs is None else target_programs
  if heads % heads_kv:
    raise ValueError(f"append_attention: {heads} query heads are not a multiple of {heads_kv} KV heads")
  if block_s < 16 or block_s & (block_s - 1):
    raise ValueError(f"append_attention: block_s must be a power of 2 >= 16, got {block_s}")
  g, g_pad, block_s, nsplit, chunk = da._geometry(batch, heads, heads_kv, slots, block_s, splits, target_programs)
  mc = min(MERGE_CHUNK, da._pow2(nsplit))
  return Geometry(g, g_pad, da._pow2(g), block_s, nsplit, chunk, mc, -(-nsplit // mc) * mc)


@functools.lru_cache(maxsize=None)
def _kernel(interpret: bool = False):
  """The Triton kernel (:mod:`pallas_kernels._append_attention_kernel`, imported lazily: it imports triton);
  ``interpret`` wraps it for Triton's CPU interpreter."""
  import triton

  from pallas_kernels import _append_attention_kernel as k

  if interpret:
    from triton.runtime.interpreter import InterpretedFunction
    return InterpretedFunction(k.attend_append)
  return triton.jit(k.attend_append)


def meta(batch: int, heads: int, heads_kv: int, slots: int, head_dim: int, layers: int, *, has_bias: bool,
         bias_stacked: bool, skip_past_last: bool = False, gdc: int = 0, geo: Geometry | None = None) -> dict:
  """The kernel's constexprs for a cache ``[layers, batch, slots, heads_kv, head_dim]``."""
  geo = geo or geometry(batch, heads, heads_kv, slots)
  return dict(B=batch, H=heads, HKV=heads_kv, G=geo.group, GP=geo.group_pad, GR=geo.group_rows, S=slots,
              HD=head_dim, BS=geo.block_s, CHUNK=geo.chunk, NSPLIT=geo.nsplit, MC=geo.merge_chunk, L=layers,
              SCALE=float(head_dim) ** -0.5, HAS_BIAS=int(has_bias), BIAS_STACKED=int(bias_stacked),
              SKIP_PAST_LAST=int(skip_past_last), GDC=gdc, PREFETCH=int(PREFETCH),
              WIDE=int(layers * batch * slots * heads_kv * head_dim >= 2 ** 31))


def arg_dtypes(bias_dtype: str = "*fp32") -> tuple:
  """The kernel's pointer types in order (``bias_dtype`` that of the bias, ``*fp32`` or ``*bf16``)."""
  return ("*fp32", bias_dtype, "*fp32", "*fp32", "*bf16", "*bf16", "*i8", "*i32", "*i32",
          "*fp32", "*fp32", "*fp32", "*bf16", "*i32")


@functools.lru_cache(maxsize=None)
def compiled(meta_items: tuple, bias_dtype: str = "*fp32", warps: int = 4, stages: int = 1):
  """``(ptx, kernel name, shared bytes)`` of the kernel for the constexprs ``meta_items`` and ``warps`` warps a
  program (loaded into the FFI launcher on a GPU; :func:`pallas_kernels.w4_gluon._load`)."""
  from pallas_kernels import w4_gluon

  return w4_gluon._load(w4_gluon._compile_gluon(_kernel(), arg_dtypes(bias_dtype), dict(meta_items),
                                                w4_gluon._target_cc(), num_warps=warps,
                                                options={"num_stages": stages}, gluon=False))


_GDC_ASM = ('    %qerl_gdc = tt.elementwise_inline_asm "griddepcontrol.launch_dependents; griddepcontrol.wait; mov.u32 $0, 0;"'
            ' {constraints = "=r", packed_element = 1 : i32, pure = false} -> i32')


def pallas_ttir(batch: int, heads: int, heads_kv: int, slots: int, head_dim: int, layers: int,
                bias_dtype: str) -> str:
  """The Triton IR (text) of :func:`pallas_kernels.decode_attention.decode_attention_append`'s Pallas kernel (with
  the in-kernel merge, the module's launch settings) for these shapes and a bias stack of ``bias_dtype``
  (``"bfloat16"`` or ``"float32"``), captured from its lowering for CUDA (a JAX internal,
  ``jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module``, wrapped for the call). Its parameters: q/k/v
  (float32 rows of hd), bias, cos, sin, k, v, mask, layer, length, sync, the partials o / m / l, k and v again (the
  outputs), the merged output, sync again.

  Raises:
    RuntimeError: this JAX has no such lowering, or it was not captured.
  """
  import jax
  import jax.numpy as jnp
  from jax._src.pallas.triton import pallas_call_registration

  captured = []
  real = getattr(getattr(pallas_call_registration, "lowering", None), "lower_jaxpr_to_triton_module", None)
  if real is None:
    raise RuntimeError("append_attention.pallas_ttir: this JAX has no Pallas Triton lowering to capture")

  def capture(*args, **kwargs):
    out = real(*args, **kwargs)
    captured.append(out)
    return out
  pallas_call_registration.lowering.lower_jaxpr_to_triton_module = capture
  try:
    S = jax.ShapeDtypeStruct
    n = (heads + 2 * heads_kv) * head_dim
    cache = S((layers, batch, slots, heads_kv, head_dim), jnp.bfloat16)
    fn = lambda qkv, bias, kc, vc, mask, cos, sin, sync, layer, length: da.decode_attention_append(
        qkv, bias, kc, vc, layer, mask, length, cos, sin, num_heads=heads, backend="pallas", sync=sync)
    jax.jit(fn).trace(S((batch, n), jnp.float32), S((layers, n), jnp.dtype(bias_dtype)), cache, cache,
                      S((batch, slots), jnp.int8), S((batch, head_dim // 2), jnp.float32),
                      S((batch, head_dim // 2), jnp.float32), S((batch * heads_kv,), jnp.int32),
                      S((), jnp.int32), S((), jnp.int32)).lower(lowering_platforms=("cuda",))
  finally:
    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = real
  if not captured:
    raise RuntimeError("append_attention.pallas_ttir: the Pallas kernel's Triton IR was not captured")
  module = getattr(captured[0], "module", captured[0])
  return module.operation.get_asm(enable_debug_info=False)


def compile_ttir(text: str, num_warps: int, num_stages: int):
  """``triton.compile`` of Triton IR ``text`` for this GPU's compute capability (:func:`w4_gluon._target_cc`)."""
  import os
  import tempfile

  import triton
  from triton.backends.compiler import GPUTarget

  from pallas_kernels import w4_gluon

  w4_gluon._ensure_triton_cache_dir()
  with tempfile.NamedTemporaryFile("w", suffix=".ttir", delete=False) as f:
    f.write(text)
  try:
    return triton.compile(f.name, target=GPUTarget("cuda", w4_gluon._target_cc(), 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})
  finally:
    os.unlink(f.name)


@functools.lru_cache(maxsize=None)
def pallas_build(batch: int, heads: int, heads_kv: int, slots: int, head_dim: int, layers: int, bias_dtype: str,
                 pdl: bool):
  """``(ptx, kernel name, shared bytes)`` of the Pallas kernel of :func:`pallas_ttir`, compiled as XLA compiles it
  (:data:`pallas_kernels.decode_attention.APPEND_WARPS` and ``APPEND_STAGES``); with ``pdl`` it releases the next
  kernel and waits (griddepcontrol) before anything else.

  Raises:
    RuntimeError: as :func:`pallas_ttir`.
  """
  from pallas_kernels import w4_gluon

  text = pallas_ttir(batch, heads, heads_kv, slots, head_dim, layers, bias_dtype)
  if pdl:  # the release-and-wait as the function body's first line
    head = text.index("\n", text.index(") {", text.index("tt.func public"))) + 1
    text = text[:head] + _GDC_ASM + "\n" + text[head:]
  return w4_gluon._load(compile_ttir(text, da.APPEND_WARPS, da.APPEND_STAGES))


def grid(batch: int, heads_kv: int, geo: Geometry) -> tuple[int, int, int]:
  """Programs: one per (row, KV head, split)."""
  return (batch, heads_kv, geo.nsplit)


def partial_shapes(batch: int, heads_kv: int, head_dim: int, geo: Geometry) -> tuple:
  """Element counts of the float32 partials ``(o, m, l)``: ``[parts, B, Hkv, GP, hd]`` and ``[parts, B, Hkv, GP]``
  twice."""
  rows = geo.parts * batch * heads_kv * geo.group_pad
  return rows * head_dim, rows, rows


class Buffers(NamedTuple):
  """The chain buffers (indices into :func:`pallas_kernels.w4_gluon.chain_call`'s operands then results) the kernel
  reads and writes, in its parameter order; ``qkv_offset``: the q/k/v product's first element in its buffer,
  ``layer_offset``: the byte offset of the layer index in its buffer."""
  qkv: int
  bias: int
  cos: int
  sin: int
  k: int
  v: int
  mask: int
  layer: int
  length: int
  o_part: int
  m_part: int
  l_part: int
  out: int
  sync: int
  qkv_offset: int = 0
  layer_offset: int = 0


def launch(bufs: Buffers, *, batch: int, heads: int, heads_kv: int, slots: int, head_dim: int, layers: int,
           bias_dtype=None, bias_stacked: bool = False, skip_past_last: bool = False, pdl: bool = False,
           splits: int | None = None):
  """The kernel as a :class:`pallas_kernels.w4_gluon.ChainLaunch` over the buffers ``bufs``.

  Args:
    bufs: :class:`Buffers`.
    batch, heads, heads_kv, slots, head_dim, layers: the cache ``[layers, batch, slots, heads_kv, head_dim]`` and
      the query heads.
    bias_dtype: the bias's dtype (bf16 or float32), or None for no bias (``bufs.bias`` then any buffer).
    bias_stacked: the bias is a stack ``[L, (H + 2 Hkv) hd]`` read at the layer.
    skip_past_last: the layer index may be ``layers`` (one past the last): that launch writes nothing.
    pdl: launched under programmatic dependent launch (its ``GDC`` build; sm_90 and later).
    splits: splits of the slots (None: as :func:`geometry`).

  Raises:
    ValueError: as :func:`geometry`; a bias dtype other than bf16 or float32.
  """
  import jax.numpy as jnp

  from pallas_kernels import w4_gluon

  geo = geometry(batch, heads, heads_kv, slots, splits=splits)
  if bias_dtype is not None and jnp.dtype(bias_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
    raise ValueError(f"append_attention: the bias must be bf16 or float32, got {jnp.dtype(bias_dtype)}")
  if FORM == "pallas":
    if skip_past_last or splits is not None or not bias_stacked:
      raise ValueError("append_attention: FORM = 'pallas' takes no skip_past_last or splits, and a bias stack "
                       "(zeros where the model has none)")
    ptx, name, shared = pallas_build(batch, heads, heads_kv, slots, head_dim, layers, jnp.dtype(bias_dtype).name, pdl)
    q = (bufs.qkv, 4 * bufs.qkv_offset)
    params = (q,) + tuple((b, 0) for b in (bufs.bias, bufs.cos, bufs.sin, bufs.k, bufs.v, bufs.mask)) + (
        (bufs.layer, bufs.layer_offset), (bufs.length, 0), (bufs.sync, 0), (bufs.o_part, 0), (bufs.m_part, 0), (bufs.l_part, 0),
        (bufs.k, 0), (bufs.v, 0), (bufs.out, 0), (bufs.sync, 0))
    warps = da.APPEND_WARPS
  else:
    mt = meta(batch, heads, heads_kv, slots, head_dim, layers, has_bias=bias_dtype is not None,
              bias_stacked=bias_stacked, skip_past_last=skip_past_last, gdc=GDC if pdl else 0, geo=geo)
    bias_type = "*bf16" if bias_dtype is not None and jnp.dtype(bias_dtype) == jnp.bfloat16 else "*fp32"
    warps = WARPS
    ptx, name, shared = compiled(tuple(mt.items()), bias_type, warps, STAGES)
    offsets = {0: 4 * bufs.qkv_offset, 7: bufs.layer_offset}  # (q/k/v, layer)
    params = tuple((buf, offsets.get(i, 0)) for i, buf in enumerate(bufs[:14]))
  return w4_gluon.ChainLaunch(ptx, name, shared, grid(batch, heads_kv, geo), 32 * warps, params,
                              pdl=pdl)


def attend_append(qkv, bias, k_cache, v_cache, layer, slot_mask, length, cos, sin, *, num_heads: int, sync,
                  splits: int | None = None):
  """:func:`pallas_kernels.decode_attention.decode_attention_append` (with ``sync``, bf16) by this module's kernel,
  launched alone by the FFI launcher (GPU only; the decode chain launches it with other kernels).

  Args:
    qkv: float32 ``[B, (H + 2 Hkv) hd]``, or a 1-D float32 buffer whose head holds it.
    bias: None, ``[(H + 2 Hkv) hd]`` or a stack ``[L, (H + 2 Hkv) hd]``, bf16 or float32.
    k_cache, v_cache: bf16 ``[L, B, S, Hkv, hd]``.
    layer, length: int32 scalars (may be traced); ``layer`` clamped to ``[0, L)``, ``1 <= length <= S``.
    slot_mask: ``[B, S]``, nonzero at real tokens (this step's slot included).
    cos, sin: float32 ``[B, hd / 2]`` (:func:`pallas_kernels.decode_attention.rope_cos_sin`).
    num_heads: ``H``.
    sync: int32 ``[B Hkv]`` zeros (:func:`pallas_kernels.decode_attention.new_sync`), left zero.
    splits: as :func:`geometry`.

  Returns:
    ``(out bf16 [B, H, hd], k cache, v cache, sync)``, the caches with slot ``length - 1`` of the layer written.

  Raises:
    ValueError: caches not bf16 ``[L, B, S, Hkv, hd]``, a ``qkv``, ``bias``, ``cos``/``sin`` or ``sync`` of the
      wrong shape, as :func:`launch`.
  """
  import jax
  import jax.numpy as jnp

  from pallas_kernels import w4_gluon

  if k_cache.ndim != 5 or v_cache.shape != k_cache.shape or k_cache.dtype != jnp.bfloat16 or (
      v_cache.dtype != jnp.bfloat16):
    raise ValueError(f"append_attention: caches must be bf16 [L, B, S, Hkv, hd], got {k_cache.dtype}"
                     f"{list(k_cache.shape)} and {v_cache.dtype}{list(v_cache.shape)}")
  n_layers, b, s, kh, hd = k_cache.shape
  n = (num_heads + 2 * kh) * hd
  if not ((qkv.ndim == 2 and qkv.shape == (b, n)) or (qkv.ndim == 1 and qkv.shape[0] >= b * n)) or (
      qkv.dtype != jnp.float32):
    raise ValueError(f"append_attention: qkv must be float32 [B={b}, {n}] or a 1-D buffer of at least {b * n}, got "
                     f"{qkv.dtype}{list(qkv.shape)}")
  if bias is not None and bias.shape not in ((n,), (n_layers, n)):
    raise ValueError(f"append_attention: bias must be [{n}] or [L={n_layers}, {n}], got {list(bias.shape)}")
  if cos.shape != (b, hd // 2) or sin.shape != (b, hd // 2) or slot_mask.shape != (b, s):
    raise ValueError(f"append_attention: cos and sin must be [B={b}, {hd // 2}] and slot_mask [B, S={s}]")
  if sync.shape != (b * kh,) or sync.dtype != jnp.int32:
    raise ValueError(f"append_attention: sync must be int32 [B * Hkv = {b * kh}], got {sync.dtype}{list(sync.shape)}")
  geo = geometry(b, num_heads, kh, s, splits=splits)
  po, pm, pl_ = partial_shapes(b, kh, hd, geo)
  ops = [qkv.reshape(-1), jnp.zeros((1,), jnp.float32) if bias is None else bias,
         cos.astype(jnp.float32), sin.astype(jnp.float32), k_cache, v_cache, slot_mask.astype(jnp.int8),
         jnp.asarray(layer, jnp.int32).reshape(1), jnp.asarray(length, jnp.int32).reshape(1), sync]
  f32 = jnp.float32
  out_shapes = [jax.ShapeDtypeStruct(k_cache.shape, jnp.bfloat16), jax.ShapeDtypeStruct(v_cache.shape, jnp.bfloat16),
                jax.ShapeDtypeStruct((po,), f32), jax.ShapeDtypeStruct((pm,), f32), jax.ShapeDtypeStruct((pl_,), f32),
                jax.ShapeDtypeStruct((b * num_heads, hd), jnp.bfloat16), jax.ShapeDtypeStruct(sync.shape, jnp.int32)]
  r = len(ops)
  bufs = Buffers(0, 1, 2, 3, r, r + 1, 6, 7, 8, r + 2, r + 3, r + 4, r + 5, r + 6)
  kernel = launch(bufs, batch=b, heads=num_heads, heads_kv=kh, slots=s, head_dim=hd, layers=n_layers,
                  bias_dtype=None if bias is None else bias.dtype, bias_stacked=bias is not None and bias.ndim == 2,
                  splits=splits)
  kc, vc, _, _, _, out, sync = w4_gluon.chain_call([kernel], ops, out_shapes, aliases={4: 0, 5: 1, 9: 6})
  return out.reshape(b, num_heads, hd), kc, vc, sync


def interpret(qkv, bias, cos, sin, k_cache, v_cache, slot_mask, layer: int, length: int, *, num_heads: int,
              splits: int | None = None, block_s: int | None = None, skip_past_last: bool = False):
  """Runs the kernel in Triton's interpreter on torch CPU tensors (tests).

  Args:
    qkv: float32 ``[B, (H + 2 Hkv) hd]``. bias: None, ``[(H + 2 Hkv) hd]`` or a stack ``[L, (H + 2 Hkv) hd]``.
    cos, sin: float32 ``[B, hd / 2]``. k_cache, v_cache: bf16 ``[L, B, S, Hkv, hd]`` (written in place).
    slot_mask: ``[B, S]`` (nonzero: a real token). layer, length: ints (``layer`` unclamped: with
    ``skip_past_last`` one past the last layer does nothing).
    num_heads: ``H``.

  Returns:
    ``(out bf16 [B, H, hd], sync int32 [B Hkv])``; the caches are updated in place.

  Raises:
    ValueError: as :func:`geometry`.
  """
  import os

  import torch
  from triton.runtime import interpreter as triton_interpreter

  if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("append_attention.interpret: Triton's interpreter needs TRITON_INTERPRET=1 set before triton "
                       "is first imported (its library functions are made interpretable at import)")
  n_layers, b, s, kh, hd = k_cache.shape
  geo = geometry(b, num_heads, kh, s, block_s=block_s, splits=splits)
  mt = meta(b, num_heads, kh, s, hd, n_layers, has_bias=bias is not None,
            bias_stacked=bias is not None and bias.ndim == 2, skip_past_last=skip_past_last, geo=geo)
  po, pm, pl_ = partial_shapes(b, kh, hd, geo)
  parts = [torch.full((n,), float("nan"), dtype=torch.float32) for n in (po, pm, pl_)]
  out = torch.zeros((b * num_heads, hd), dtype=torch.bfloat16)
  sync = torch.zeros((b * kh,), dtype=torch.int32)
  bias_t = torch.zeros((1,), dtype=torch.float32) if bias is None else bias.reshape(-1)
  # The interpreter holds a loaded scalar as a 1-element array, which its int() conversion (a loop bound) refuses
  # under numpy 2: converted here by its one element.
  patch = triton_interpreter._patch_lang_tensor

  def patch_lang_tensor(tensor, scope):
    patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

  triton_interpreter._patch_lang_tensor = patch_lang_tensor
  try:
    _kernel(True)[grid(b, kh, geo)](
        qkv.reshape(-1).contiguous(), bias_t, cos.contiguous(), sin.contiguous(), k_cache, v_cache,
        slot_mask.to(torch.int8).contiguous(), torch.tensor([layer], dtype=torch.int32),
        torch.tensor([length], dtype=torch.int32), *parts, out, sync, **mt, INTERPRET=1)
  finally:
    triton_interpreter._patch_lang_tensor = patch
  return out.reshape(b, num_heads, hd), sync


__all__ = ["Buffers", "Geometry", "attend_append", "geometry", "launch", "meta", "arg_dtypes", "compiled", "grid",
           "partial_shapes", "interpret", "pallas_build", "pallas_ttir", "compile_ttir"]
