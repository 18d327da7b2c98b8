"""The Triton kernel of :mod:`pallas_kernels.append_attention` (imports triton: loaded lazily by that module).

Triton's interpreter patches the ``tl`` of a kernel's module globals, so the kernel lives at module level here.
"""

import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda

MASKED_SCORE = tl.constexpr(-1e30)  # pallas_kernels.decode_attention.MASKED_SCORE


@triton.jit
def _bf16(x, BITS: tl.constexpr):
  """float32 ``x`` rounded to bf16 (to nearest, ties to even), kept in float32; with ``BITS`` by the bits. The bit
  form is what the kernel's q/k/v and RoPE use: Triton's interpreter does not round its float32 -> bf16 conversion to
  nearest, and on an H100 the compiled conversion pairs of RoPE's products gave about a fifth of the keys 1 ulp away
  from XLA's (session 63: the products apparently kept in float32)."""
  if BITS:
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)
  else:
    return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _rope(x1, x2, cos, sin):
  """RoPE's "rotate half" on the halves ``x1, x2`` (Su et al. 2021): ``[x1, x2] cos + [-x2, x1] sin``, each product
  and the sum rounded to bf16 (by the bits) as XLA's bf16 ops (:func:`pallas_kernels.decode_attention._rope_rounded`)."""
  a = _bf16(_bf16(x1 * cos, 1) - _bf16(x2 * sin, 1), 1)
  b = _bf16(_bf16(x2 * cos, 1) + _bf16(x1 * sin, 1), 1)
  return a, b


@triton.jit
def _load_block(mask_ptr, k_ptr, v_ptr, b, offs, s_end, row0, col, S: tl.constexpr, RS: tl.constexpr,
                HD: tl.constexpr):
  """A block of slots ``offs`` (those before ``s_end``): which to keep (inside and a real token), the keys' halves
  ``[BS, HD / 2]`` twice and the values ``[BS, HD]`` (bf16) of this (row, KV head)."""
  HALF: tl.constexpr = HD // 2
  inside = offs < s_end
  keep = (tl.load(mask_ptr + b * S + offs, mask=inside, other=0) != 0) & inside
  at = (row0 + offs)[:, None] * RS + col
  c = tl.arange(0, HALF)
  k1 = tl.load(k_ptr + at + c[None, :], mask=inside[:, None], other=0.0)
  k2 = tl.load(k_ptr + at + HALF + c[None, :], mask=inside[:, None], other=0.0)
  vb = tl.load(v_ptr + at + tl.arange(0, HD)[None, :], mask=inside[:, None], other=0.0)
  return keep, k1, k2, vb


@triton.jit
def _softmax_step(q1b, q2b, k1, k2, vb, keep, m, lsum, acc, SCALE: tl.constexpr, DT: tl.constexpr,
                  INTERPRET: tl.constexpr):
  """One block of the online softmax (Milakov & Gimelshein 2018): scores from the RoPE halves, running max ``m`` and
  sum ``lsum`` ``[GP]`` and output ``acc [GP, HD]`` (float32) updated; slots not kept left out."""
  sc = (tl.dot(q1b, tl.trans(k1.to(DT))) + tl.dot(q2b, tl.trans(k2.to(DT)))) * SCALE  # [GP, BS]
  sc = tl.where(keep[None, :], sc, MASKED_SCORE)
  m_new = tl.maximum(m, tl.max(sc, axis=1))
  alpha = tl.exp(m - m_new)
  p = tl.where(keep[None, :], tl.exp(sc - m_new[:, None]), 0.0)
  lsum = lsum * alpha + tl.sum(p, axis=1)
  acc = acc * alpha[:, None] + tl.dot(_bf16(p, INTERPRET).to(DT), vb.to(DT))
  return m_new, lsum, acc


def attend_append(qkv_ptr, bias_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, mask_ptr, layer_ptr, length_ptr,
                  o_part_ptr, m_part_ptr, l_part_ptr, out_ptr, sync_ptr,
                  B: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                  GR: tl.constexpr, S: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr, CHUNK: tl.constexpr,
                  NSPLIT: tl.constexpr, MC: tl.constexpr, L: tl.constexpr, SCALE: tl.constexpr,
                  HAS_BIAS: tl.constexpr, BIAS_STACKED: tl.constexpr, SKIP_PAST_LAST: tl.constexpr,
                  GDC: tl.constexpr = 0, PREFETCH: tl.constexpr = 1, WIDE: tl.constexpr = 1,
                  INTERPRET: tl.constexpr = 0):
  b = tl.program_id(0)
  kvh = tl.program_id(1)
  split = tl.program_id(2)
  f32: tl.constexpr = tl.float32
  bf16: tl.constexpr = tl.bfloat16
  HALF: tl.constexpr = HD // 2
  ROWS: tl.constexpr = H + 2 * HKV
  layer_raw = tl.load(layer_ptr)
  # a chain's attention of the layer after the last (SKIP_PAST_LAST) reads but writes nothing
  live = (layer_raw < L) | (SKIP_PAST_LAST == 0)
  layer = tl.minimum(tl.maximum(layer_raw, 0), L - 1)
  length = tl.load(length_ptr)
  write_at = length - 1  # this step's slot: attended from registers, written by split 0, never read
  gi = tl.arange(0, GP)
  in_group = gi < G
  c = tl.arange(0, HALF)
  d = tl.arange(0, HD)
  # RoPE's cos and sin for this row (float32, made once per step), in bf16
  cos = _bf16(tl.load(cos_ptr + b * HALF + c), 1)
  sin = _bf16(tl.load(sin_ptr + b * HALF + c), 1)
  q_rows = kvh * G + gi
  kr = H + kvh
  vr = H + HKV + kvh
  if HAS_BIAS:
    br = layer * ROWS if BIAS_STACKED else 0
    bq1 = tl.load(bias_ptr + (br + q_rows)[:, None] * HD + c[None, :], mask=in_group[:, None], other=0.0).to(f32)
    bq2 = tl.load(bias_ptr + (br + q_rows)[:, None] * HD + HALF + c[None, :], mask=in_group[:, None],
                  other=0.0).to(f32)
    bk1 = tl.load(bias_ptr + (br + kr) * HD + c).to(f32)
    bk2 = tl.load(bias_ptr + (br + kr) * HD + HALF + c).to(f32)
    bv = tl.load(bias_ptr + (br + vr) * HD + d).to(f32)
  new_kept = (tl.load(mask_ptr + b * S + write_at) != 0) & (split == 0)
  # this split's slots: a fixed chunk, cut at the new slot
  s_begin = split * CHUNK
  s_end = tl.minimum(s_begin + CHUNK, write_at)
  blocks = tl.where(live, tl.maximum(s_end - s_begin + BS - 1, 0) // BS, 0)
  row0 = (layer * B + b) * S
  if WIDE:  # (a cache of 2**31 elements or more: 64-bit offsets)
    row0 = row0.to(tl.int64)
  col = kvh * HD
  RS: tl.constexpr = HKV * HD  # a cache row (one slot of every KV head)
  sb = tl.arange(0, BS)
  if PREFETCH == 1:  # the first block: slots written by earlier steps, read before the wait
    keep, k1, k2, vb = _load_block(mask_ptr, k_ptr, v_ptr, b, s_begin + sb, s_end, row0, col, S, RS, HD)
  if PREFETCH == 2 and not INTERPRET:  # the first block's key and value lines into the L2 (no registers held)
    l_at = (row0 + tl.minimum(s_begin + sb, S - 1))[:, None] * RS + col + tl.arange(0, 2)[None, :] * (HD // 2)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; prefetch.global.L2 [$2]; mov.u32 $0, 0;", "=r,l,l",
                              [k_ptr + l_at, v_ptr + l_at], dtype=tl.int32, is_pure=False, pack=1)
  if GDC:
    if GDC & 4:
      tl_cuda.gdc_launch_dependents()
    tl_cuda.gdc_wait()
  # the q/k/v product (written by the kernel before this one), + bias, rounded to bf16
  base = qkv_ptr + b * ROWS * HD
  q1 = tl.load(base + q_rows[:, None] * HD + c[None, :], mask=in_group[:, None], other=0.0)
  q2 = tl.load(base + q_rows[:, None] * HD + HALF + c[None, :], mask=in_group[:, None], other=0.0)
  nk1 = tl.load(base + kr * HD + c)
  nk2 = tl.load(base + kr * HD + HALF + c)
  nv = tl.load(base + vr * HD + d)
  if HAS_BIAS:
    q1, q2, nk1, nk2, nv = q1 + bq1, q2 + bq2, nk1 + bk1, nk2 + bk2, nv + bv
  q1, q2 = _bf16(q1, 1), _bf16(q2, 1)
  nk1, nk2, nv = _bf16(nk1, 1), _bf16(nk2, 1), _bf16(nv, 1)
  # RoPE, each product and the sum rounded to bf16 (as XLA's bf16 ops)
  q1, q2 = _rope(q1, q2, cos[None, :], sin[None, :])
  nk1, nk2 = _rope(nk1, nk2, cos, sin)
  if (split == 0) & live:
    slot = (row0 + write_at) * RS + col
    tl.store(k_ptr + slot + c, nk1.to(bf16))
    tl.store(k_ptr + slot + HALF + c, nk2.to(bf16))
    tl.store(v_ptr + slot + d, nv.to(bf16))
  # the new token opens split 0's online softmax (when its slot is attended at all)
  sc_new = (tl.sum(q1 * nk1[None, :], axis=1) + tl.sum(q2 * nk2[None, :], axis=1)) * SCALE  # [GP]
  m = tl.where(new_kept, sc_new, MASKED_SCORE)
  lsum = tl.where(new_kept, 1.0, 0.0) + tl.zeros([GP], f32)
  acc = tl.where(new_kept, nv[None, :], 0.0) + tl.zeros([GP, HD], f32)
  # (INTERPRET: the dots' bf16 operands widened to float32, for Triton's interpreter, whose dot multiplies bf16
  # bits as integers; the values are the same)
  DT: tl.constexpr = f32 if INTERPRET else bf16
  q1b, q2b = q1.to(DT), q2.to(DT)
  if PREFETCH == 1:  # each step issues the next block's loads (into registers) before its own softmax step
    for i in range(blocks):
      n_keep, n_k1, n_k2, n_vb = _load_block(mask_ptr, k_ptr, v_ptr, b, s_begin + (i + 1) * BS + sb, s_end, row0,
                                             col, S, RS, HD)
      m, lsum, acc = _softmax_step(q1b, q2b, k1, k2, vb, keep, m, lsum, acc, SCALE, DT, INTERPRET)
      keep, k1, k2, vb = n_keep, n_k1, n_k2, n_vb
  else:  # each step loads its block (Triton's pipeliner stages the loads over num_stages)
    for i in range(blocks):
      keep, k1, k2, vb = _load_block(mask_ptr, k_ptr, v_ptr, b, s_begin + i * BS + sb, s_end, row0, col, S, RS, HD)
      m, lsum, acc = _softmax_step(q1b, q2b, k1, k2, vb, keep, m, lsum, acc, SCALE, DT, INTERPRET)
  # partials of the splits that saw a slot (split 0 holds the new token's)
  active = tl.maximum((write_at + CHUNK - 1) // CHUNK, 1)
  pair = b * HKV + kvh
  if (split < active) & live:
    at_p = (split * B * HKV + pair) * GP
    tl.store(o_part_ptr + (at_p + gi)[:, None] * HD + d[None, :], acc, mask=in_group[:, None])
    tl.store(m_part_ptr + at_p + gi, m)
    tl.store(l_part_ptr + at_p + gi, lsum)
  # the last of this (row, KV head)'s programs to arrive merges the partials (the split-K "last block"
  # pattern: every thread's stores, a barrier, one acquire-release atomic) and resets the counter
  tl.debug_barrier()
  arrived = tl.atomic_add(sync_ptr + pair, 1, mask=live, sem="acq_rel", scope="gpu")
  if live & (arrived == NSPLIT - 1):
    r = tl.arange(0, GR)
    rows = r < G
    # partial by partial, elementwise on [GR, 1] and [GR, HD]: no reduction across threads, which Triton 3.6 lowers
    # through shared memory (session 64: a chunk reduced at once, [MC, GR, HD], took 524.0 against 409.5 us for 28
    # layers on an H100)
    top = tl.full([GR, 1], float("-inf"), f32)
    den = tl.zeros([GR, 1], f32)
    num = tl.zeros([GR, HD], f32)
    for ch in range(0, (active + MC - 1) // MC):
      for j in tl.static_range(MC):  # unrolled: a chunk's loads are issued together
        s_i = ch * MC + j
        have = rows[:, None] & (s_i < active)
        at_c = ((s_i * B * HKV + pair) * GP + r)[:, None]  # [GR, 1]
        mc = tl.load(m_part_ptr + at_c, mask=have, other=float("-inf"), cache_modifier=".cg")
        lc = tl.load(l_part_ptr + at_c, mask=have, other=0.0, cache_modifier=".cg")
        oc = tl.load(o_part_ptr + at_c * HD + d[None, :], mask=have, other=0.0, cache_modifier=".cg")
        new_top = tl.maximum(top, mc)
        rescale = tl.exp(top - new_top)
        w = tl.exp(mc - new_top)
        den = den * rescale + w * lc
        num = num * rescale + w * oc
        top = new_top
    out = num / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + (pair * G + r)[:, None] * HD + d[None, :], out.to(bf16), mask=rows[:, None])
    tl.store(sync_ptr + pair, 0)
