"""Lab (GPU): the first version of the Gluon wgmma kernel (pallas_kernels.w4_gluon's MB = 32
build came from it), kept for what the library build does not take: MB = 64 and 128, row chunks,
and asynchronous MMAs with 3 x buffers, for M = 64-256 (the 7B recipes sample 64 rows a step).
Session 8 measured all of them slower than the Pallas kernel at M = 64 (docs/benchmarks.md).

The weight side is unchanged (same code layout, inline-PTX decode and row permutation; the wgmma A
operand from registers with k_width 8 has the same linear layout as the mma.sync one). x goes
through shared memory: each step's x tile [64 k, MB] (k bits 0/1 swapped as in w4_gluon) is stored
once per program and read by the tensor cores for all 256 rows, where mma.sync needs each warp to
hold all of x in registers. Double-buffered, one barrier a step.

  PYTHONPATH=$PWD python3 experiments/lab/gluon/w4_gluon_wg.py       # offline: compile, registers
"""
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels import w4_gluon, w4_triton  # noqa: E402


@functools.lru_cache(maxsize=None)
def kernel(warps: int = 4):
  """warps = 4: one warpgroup, as w4_gluon. warps = 8: two warpgroups of 128 rows each; the column
  bit n2 moves from registers to warps (4 consecutive columns a thread, 4-byte code loads), which
  halves every thread's accumulator, operand and code registers."""
  from triton.experimental import gluon
  from triton.experimental.gluon import language as ttgl
  from triton.experimental.gluon.language.nvidia import hopper

  asm = ttgl.constexpr(w4_gluon._asm())
  n2_reg, n2_warp = ([[0, 4]], []) if warps == 4 else ([], [[0, 4]])
  code_layout = ttgl.constexpr(ttgl.DistributedLinearLayout(
      reg_bases=[[0, 1], [0, 2]] + n2_reg + [[1, 0], [2, 0], [16, 0]],
      lane_bases=[[4, 0], [8, 0], [0, 8], [0, 16], [0, 32]],
      warp_bases=[[0, 64], [0, 128]] + n2_warp, block_bases=[], shape=[32, 256]))
  group_layout = ttgl.constexpr(ttgl.DistributedLinearLayout(
      reg_bases=[[0, 0, 1], [0, 0, 2]] + [[0] + b for b in n2_reg] + [[0, 1, 0], [2, 0, 0]],
      lane_bases=[[0, 2, 0], [1, 0, 0], [0, 0, 8], [0, 0, 16], [0, 0, 32]],
      warp_bases=[[0, 0, 64], [0, 0, 128]] + [[0] + b for b in n2_warp], block_bases=[], shape=[4, 4, 256]))
  # A rows of the asm output (axes: j 4 bits, label columns 8 bits, p, lo/hi); warps own rows 16, 32
  # (and 64 with 8 warps), so with 8 warps the warp bit n2 (axis 9) takes row 64 and p row 128
  a_perm = ttgl.constexpr([9, 12] if warps == 4 else [12, 9])
  # the inverse, rows -> columns: [n7, n6, n5, n4, n3, n2, n1, n0]
  o_n2 = ttgl.constexpr(0 if warps == 4 else 1)  # [2, 3, 5, 6, 7, o_n2, 1 - o_n2, 4, 8]
  WARPS = ttgl.constexpr(warps)

  @gluon.jit
  def load_step(x_ptr, p_ptr, s_ptr, c_offs, x_offs, x_mask, s_row0, n0, i, N: ttgl.constexpr):
    c = ttgl.load(p_ptr + c_offs + i * (32 * N))
    xb = ttgl.load(x_ptr + x_offs + i * 64, mask=x_mask, other=0.0)
    sg = ttgl.arange(0, 4, layout=ttgl.SliceLayout(1, ttgl.SliceLayout(1, group_layout)))
    sn = ttgl.arange(0, 256, layout=ttgl.SliceLayout(0, ttgl.SliceLayout(1, group_layout)))
    s = ttgl.load(s_ptr + ttgl.expand_dims(sg + (s_row0 + i * 4), 1) * N + ttgl.expand_dims(sn, 0) + n0)
    return c, s, xb

  @gluon.jit
  def decode(c, s, a_layout: ttgl.constexpr, a_perm: ttgl.constexpr):
    s = (s.to(ttgl.float32) * 3.3230699894622896e+35).to(ttgl.bfloat16)
    c_a, c_b = ttgl.split(ttgl.permute(ttgl.reshape(c, [16, 2, 256]), [0, 2, 1]))
    c_a4 = ttgl.reshape(c_a, [4, 4, 256])
    s_a = ttgl.reshape(ttgl.broadcast(ttgl.expand_dims(s, 1), c_a4)[0], [16, 256])
    s_a = ttgl.convert_layout(s_a, c_a.type.layout, assert_trivial=True)
    o1, o2, o3, o4 = ttgl.inline_asm_elementwise(
        asm, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [c_a, c_b, s_a],
        dtype=(ttgl.bfloat16, ttgl.bfloat16, ttgl.bfloat16, ttgl.bfloat16), is_pure=True, pack=4)
    j = ttgl.reshape(ttgl.join(ttgl.join(o1, o2), ttgl.join(o3, o4)), [2] * 14)
    a = ttgl.reshape(ttgl.permute(j, [a_perm[0], a_perm[1], 4, 5, 10, 6, 7, 8, 0, 1, 2, 3, 13, 11]), [256, 64])
    # wgmma wants k_width 2: relabel k (bits 1, 2, 3, 4 -> 3, 4, 1, 2), a register reordering only
    a = ttgl.reshape(ttgl.permute(ttgl.reshape(a, [256, 2, 2, 2, 2, 2, 2]), [0, 1, 4, 5, 2, 3, 6]), [256, 64])
    return ttgl.convert_layout(a, a_layout, assert_trivial=True)

  @gluon.jit
  def w4a16_wg(x_ptr, p_ptr, s_ptr, gs_ptr, idx_ptr, z_ptr, o_ptr, M: ttgl.constexpr, N: ttgl.constexpr,
               K: ttgl.constexpr, L: ttgl.constexpr, STEPS: ttgl.constexpr, MB: ttgl.constexpr,
               CHUNKS: ttgl.constexpr, ASYNC: ttgl.constexpr, ATOMIC: ttgl.constexpr):
    mma: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, MB, 16])
    a_layout: ttgl.constexpr = ttgl.DotOperandLayout(0, mma, 2)
    # x [64 k, MB]: each thread 8 contiguous k of one row (16-byte loads and shared-memory stores)
    xl: ttgl.constexpr = ttgl.BlockedLayout([8, 1], [8, 4], [1, WARPS], [0, 1])
    xs_layout: ttgl.constexpr = ttgl.NVMMASharedLayout.get_default_for([64, MB], ttgl.bfloat16, transposed=True)
    NBUF: ttgl.constexpr = 3 if ASYNC else 2
    x_smem = ttgl.allocate_shared_memory(ttgl.bfloat16, [NBUF, 64, MB], xs_layout)
    pid_m = ttgl.program_id(0)
    pid_n = ttgl.program_id(1)
    pid_s = ttgl.program_id(2)
    layer = ttgl.minimum(ttgl.maximum(ttgl.load(idx_ptr), 0), L - 1)
    gs = ttgl.load(gs_ptr + layer)
    n0 = pid_n * 256
    kp0 = pid_s * (STEPS * 32) + layer * (K // 2)
    s_row0 = pid_s * (STEPS * 4) + layer * (K // 16)
    kp = ttgl.arange(0, 32, layout=ttgl.SliceLayout(1, code_layout))
    nn = ttgl.arange(0, 256, layout=ttgl.SliceLayout(0, code_layout))
    c_offs = ttgl.expand_dims(kp + kp0, 1) * N + ttgl.expand_dims(nn, 0) + n0
    kk = ttgl.arange(0, 64, layout=ttgl.SliceLayout(1, xl))
    mm = ttgl.arange(0, MB, layout=ttgl.SliceLayout(0, xl))
    if CHUNKS > 1:
      mm = mm + pid_m * MB
    x_offs = ttgl.expand_dims(kk + pid_s * (STEPS * 64), 1) + ttgl.expand_dims(mm, 0) * K
    x_mask = ttgl.expand_dims(mm < M, 0) & ttgl.expand_dims(kk >= 0, 1)
    acc = ttgl.zeros([256, MB], ttgl.float32, layout=mma)
    c0, s0, x0 = load_step(x_ptr, p_ptr, s_ptr, c_offs, x_offs, x_mask, s_row0, n0, 0, N)
    for i in ttgl.static_range(STEPS):
      c1, s1, x1 = load_step(x_ptr, p_ptr, s_ptr, c_offs, x_offs, x_mask, s_row0, n0, min(i + 1, STEPS - 1), N)
      # k bits 0/1 swapped (the decode's pairing), then the k_width-2 relabelling of the weight side
      xs = ttgl.reshape(ttgl.permute(ttgl.reshape(x0, [16, 2, 2, MB]), [0, 2, 1, 3]), [64, MB])
      xs = ttgl.reshape(ttgl.permute(ttgl.reshape(xs, [2, 2, 2, 2, 2, 2, MB]), [0, 3, 4, 1, 2, 5, 6]), [64, MB])
      # buffer i % NBUF was last read by the MMA of step i - NBUF, which every warp has waited for
      # before the barrier of step i - 1 (synchronous MMAs: 2 buffers; one MMA in flight: 3)
      buf = x_smem.index(i % NBUF)
      buf.store(xs)
      hopper.fence_async_shared()
      ttgl.thread_barrier()
      a = decode(c0, s0, a_layout, a_perm)
      if ASYNC:
        acc = hopper.warpgroup_mma(a, buf, acc, is_async=True)
        acc = hopper.warpgroup_mma_wait(num_outstanding=1, deps=(acc, a))[0]
      else:
        acc = hopper.warpgroup_mma(a, buf, acc)
      c0, s0, x0 = c1, s1, x1
    if ASYNC:
      acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    acc = acc * (256.0 / gs)
    acc = ttgl.reshape(ttgl.permute(ttgl.reshape(acc, [2] * 8 + [MB]), [2, 3, 5, 6, 7, o_n2, 1 - o_n2, 4, 8]), [256, MB])
    st: ttgl.constexpr = ttgl.BlockedLayout([4, 1], [32, 1], [1, WARPS], [0, 1])
    acc = ttgl.convert_layout(acc, st)
    no = ttgl.arange(0, 256, layout=ttgl.SliceLayout(1, st))
    mo = ttgl.arange(0, MB, layout=ttgl.SliceLayout(0, st))
    if CHUNKS > 1:
      mo = mo + pid_m * MB
    o_mask = ttgl.expand_dims(mo < M, 0) & ttgl.expand_dims(no >= 0, 1)
    if ATOMIC:  # split-K summed in the L2 by float32 atomics into the zeroed output (aliased to z_ptr)
      ttgl.atomic_add(o_ptr + ttgl.expand_dims(mo, 0) * N + ttgl.expand_dims(no + n0, 1), acc, mask=o_mask,
                      sem="relaxed")
    else:
      o_offs = pid_s * (M * N) + ttgl.expand_dims(mo, 0) * N + ttgl.expand_dims(no + n0, 1)
      ttgl.store(o_ptr + o_offs, acc, mask=o_mask)

  return w4a16_wg


def compile_meta(m, k, n, layers=1, mb=None, target=None, is_async=False, atomic=False):
  mb = min(mb or 64, max(8, 1 << (m - 1).bit_length()))
  chunks = -(-m // mb)
  splits = _splits_target(k, n, chunks, w4_gluon.TARGET_PROGRAMS if target is None else target)
  return dict(M=m, N=n, K=k, L=layers, STEPS=k // 64 // splits, MB=mb, CHUNKS=chunks, ASYNC=is_async,
              ATOMIC=atomic), splits, chunks


def _splits_target(k, n, chunks, target):
  """w4_gluon._splits with the row chunks counted in the program target."""
  total, tiles = k // 64, n // 256
  options = [s for s in range(1, total + 1) if total % s == 0 and total // s <= w4_gluon.MAX_STEPS]
  return min(options, key=lambda s: (abs(chunks * tiles * s - target), s))


ARG_DTYPES = w4_gluon._ARG_DTYPES[:5] + ("*fp32", "*fp32")  # ..., zeros (aliased to the output), output


@functools.lru_cache(maxsize=None)
def _compiled(meta, warps=4):
  c = w4_gluon._compile_gluon(kernel(warps), ARG_DTYPES, dict(meta), 90, num_warps=warps)
  ptx, name, shared = c.asm["ptx"], c.metadata.name, int(c.metadata.shared)
  lib = w4_gluon._ffi_library()
  for device in w4_gluon._gpu_devices():
    assert lib.qerl_gluon_preload(ptx.encode(), name.encode(), device.id, shared) == 0
  return ptx, name, shared


def forward(x, w, mb=None, target=None, warps=4, is_async=False, atomic=False):
  m, k = x.shape
  n = w.shape[1]
  meta, splits, chunks = compile_meta(m, k, n, mb=mb, target=target, is_async=is_async, atomic=atomic)
  ptx, name, shared = _compiled(tuple(meta.items()), warps)
  operands = (x, *w4_triton._layer_operands(w, w4_triton._format_of(w), None))
  attrs = w4_gluon._launch_attrs(ptx, name, (chunks, n // 256, splits), shared, threads=32 * warps)
  if atomic:
    out = jax.ffi.ffi_call(w4_gluon._FFI_TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32), input_output_aliases={5: 0})(
        *operands, jnp.zeros((m, n), jnp.float32), **attrs)
    return out.astype(jnp.bfloat16)
  partials = jax.ffi.ffi_call(w4_gluon._FFI_TARGET, jax.ShapeDtypeStruct((splits, m, n), jnp.float32))(
      *operands, jnp.zeros((1,), jnp.float32), **attrs)
  return (partials[0] if splits == 1 else partials.sum(axis=0)).astype(jnp.bfloat16)


if __name__ == "__main__":
  import re
  import subprocess
  import triton
  nv = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
  for m, k, n, warps, is_async in [(8, 3584, 37888, 8, False), (32, 3584, 37888, 8, False), (64, 3584, 37888, 8, True),
                                   (64, 18944, 3584, 8, False)]:
    meta, splits, chunks = compile_meta(m, k, n, mb=min(m, 128), is_async=is_async, atomic=True)
    c = w4_gluon._compile_gluon(kernel(warps), ARG_DTYPES, meta, 90, num_warps=warps)
    open("/tmp/wg.cubin", "wb").write(c.asm["cubin"])
    u = subprocess.check_output([nv + "/cuobjdump", "--dump-resource-usage", "/tmp/wg.cubin"]).decode()
    s = subprocess.check_output([nv + "/cuobjdump", "-sass", "/tmp/wg.cubin"]).decode()
    ops = {op: len(re.findall(op, s)) for op in ("HGMMA", "HMMA", "SHFL", "LDS", "STS", "STL", "LDL", "BAR", "RED", "ATOM")}
    print(m, k, n, warps, meta, "splits", splits, re.search(r"REG:(\d+).*?LOCAL:(\d+)", u).groups(), ops, flush=True)
