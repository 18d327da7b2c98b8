"""Lab (GPU): is the Gluon decode GEMV limited by how it reads the weight?

Device time of a kernel that only loads the NVFP4 codes and block scales (no decode, no MMA; the
bytes are summed so that no load is dropped) on the production kernel's grid, register layouts and
per-thread loads (8 bytes a code row), with two address patterns:

* ``strided``: the production addresses. A program step reads 32 code rows of 256 bytes, N bytes
  apart, and 4 scale rows of 256 bytes.
* ``tiled``: the same bytes a thread and the same instructions, but each program step's 8 KB of
  codes (and 1 KB of scales) is one contiguous block, as a weight repacked by tiles would be.

Session 20 adds 8-byte loads of the same addresses as int64 (``LOADS_VARIANTS``; the production addresses),
to ask whether L2 fetch-size hints raise the ceiling of 3.2 TB/s that session 12 measured:

* ``i64``: a plain load (should match ``strided``);
* ``l2_256`` / ``l2_128``: inline PTX ``ld.global.L2::256B`` / ``L2::128B`` (the L2 fetches 256 / 128 bytes
  a miss instead of the sectors asked for);
* ``nc_256``: ``ld.global.nc.L1::no_allocate.L2::256B`` (the read-only path, no L1 line).

and other code layouts (``LOADS_LAYOUTS``, names of ``LAYOUTS``): 16 bytes a thread and row (``w16``: LDG.128,
a warp's instruction reading 4 rows x 128 bytes; ``w16r``: 2 rows x 256 bytes) and 8 bytes with a warp reading
2 rows x 128 bytes (``w8r``), to ask whether the access width is what holds the loads below a bf16 GEMV's
4.2 TB/s.

Next to them, the production kernel (``w4_gluon.forward``) on the same weights, at M = 8 and the
four Qwen2.5-7B shapes, weights rotated beyond the L2 (``labcommon.us_per_call``). Reading the
result: if ``strided`` loads alone take about as long as the production kernel, the address
pattern (or the grid) is the limit, and ``tiled`` says what a repacked layout would gain; if they
take much less, the limit is in how the loads overlap the decode and the MMA.

  PYTHONPATH=$PWD python3 experiments/lab/gluon/loads_only.py          # GPU (FFI launcher)
  LOADS_OFFLINE=1 PYTHONPATH=$PWD python3 experiments/lab/gluon/loads_only.py   # no GPU: compile, SASS mix
"""
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels import w4_gluon, w4_triton  # noqa: E402

M = int(os.environ.get("LOADS_M", 8))
VARIANTS_RUN = [v for v in os.environ.get("LOADS_VARIANTS", "").split(",") if v]  # names of VARIANTS


# Code layouts [32 rows (kp), 256 columns (n)] as (registers, lanes, warps) bases; what one warp's load
# instruction reads in brackets.
LAYOUTS = {
    # the production mma.sync build's: registers n0 n1 n2 kp0 kp1 kp4, lanes kp2 kp3 n3 n4 n5, warps n6 n7
    # (8 bytes a thread; 4 rows x 64 bytes)
    "w8": ([[0, 1], [0, 2], [0, 4], [1, 0], [2, 0], [16, 0]], [[4, 0], [8, 0], [0, 8], [0, 16], [0, 32]],
           [[0, 64], [0, 128]]),
    # 8 bytes a thread, 2 rows x 128 bytes
    "w8r": ([[0, 1], [0, 2], [0, 4], [1, 0], [2, 0], [16, 0]], [[4, 0], [0, 8], [0, 16], [0, 32], [0, 64]],
            [[0, 128], [8, 0]]),
    # 16 bytes a thread (LDG.128): 4 rows x 128 bytes
    "w16": ([[0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [2, 0]], [[4, 0], [8, 0], [0, 16], [0, 32], [0, 64]],
            [[0, 128], [16, 0]]),
    # 16 bytes a thread: 2 rows x 256 bytes
    "w16r": ([[0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [2, 0]], [[4, 0], [0, 16], [0, 32], [0, 64], [0, 128]],
             [[8, 0], [16, 0]]),
}
LAYOUT_IDS = {name: i for i, name in enumerate(LAYOUTS)}
LAYOUTS_RUN = [v for v in os.environ.get("LOADS_LAYOUTS", "").split(",") if v]  # names of LAYOUTS besides w8


@functools.lru_cache(maxsize=None)
def _kernel(lay: str = "w8"):
  from triton.experimental import gluon
  from triton.experimental.gluon import language as ttgl

  # the code layout LAYOUTS[lay] (w8: the mma.sync build's, w4_gluon._kernel with wg=False); scales [4 groups, 256]
  regs, lanes, warps = LAYOUTS[lay]
  code_layout = ttgl.constexpr(ttgl.DistributedLinearLayout(
      reg_bases=regs, lane_bases=lanes, warp_bases=warps, block_bases=[], shape=[32, 256]))
  # the same bytes as int64: [32 rows, 32 chunks of 8 bytes], one chunk a thread a row
  chunk_layout = ttgl.constexpr(ttgl.DistributedLinearLayout(
      reg_bases=[[1, 0], [2, 0], [16, 0]], lane_bases=[[4, 0], [8, 0], [0, 1], [0, 2], [0, 4]],
      warp_bases=[[0, 8], [0, 16]], block_bases=[], shape=[32, 32]))
  asm = ttgl.constexpr(["", "", "ld.global.L2::256B.b64 $0, [$1];", "ld.global.L2::128B.b64 $0, [$1];",
                        "ld.global.nc.L1::no_allocate.L2::256B.b64 $0, [$1];"])
  scale_layout = ttgl.constexpr(ttgl.DistributedLinearLayout(
      reg_bases=[[0, 1], [0, 2], [0, 4]], lane_bases=[[1, 0], [2, 0], [0, 8], [0, 16], [0, 32]],
      warp_bases=[[0, 64], [0, 128]], block_bases=[], shape=[4, 256]))

  @gluon.jit
  def loads(x_ptr, p_ptr, s_ptr, gs_ptr, idx_ptr, z_ptr, o_ptr, M: ttgl.constexpr, N: ttgl.constexpr,
            K: ttgl.constexpr, L: ttgl.constexpr, STEPS: ttgl.constexpr, MB: ttgl.constexpr,
            ATOMIC: ttgl.constexpr, TILED: ttgl.constexpr, XS: ttgl.constexpr, WA: ttgl.constexpr,
            LD: ttgl.constexpr = 0, LAY: ttgl.constexpr = 0):
    pid_n = ttgl.program_id(0)
    pid_s = ttgl.program_id(1)
    splits = ttgl.num_programs(1)
    kp = ttgl.arange(0, 32, layout=ttgl.SliceLayout(1, code_layout))
    nn = ttgl.arange(0, 256, layout=ttgl.SliceLayout(0, code_layout))
    sg = ttgl.arange(0, 4, layout=ttgl.SliceLayout(1, scale_layout))
    sn = ttgl.arange(0, 256, layout=ttgl.SliceLayout(0, scale_layout))
    if TILED:  # program step (pid_n, pid_s, i): bytes [32 * 256] and [4 * 256] at one contiguous offset
      block = (pid_n * splits + pid_s) * STEPS
      c_offs = ttgl.expand_dims(kp, 1) * 256 + ttgl.expand_dims(nn, 0) + block * 8192
      s_offs = ttgl.expand_dims(sg, 1) * 256 + ttgl.expand_dims(sn, 0) + block * 1024
      c_step = 8192
      s_step = 1024
    else:  # the production addresses (w4_gluon: c_offs, load_step)
      c_offs = ttgl.expand_dims(kp + pid_s * (STEPS * 32), 1) * N + ttgl.expand_dims(nn, 0) + pid_n * 256
      s_offs = ttgl.expand_dims(sg + pid_s * (STEPS * 4), 1) * N + ttgl.expand_dims(sn, 0) + pid_n * 256
      c_step = 32 * N
      s_step = 4 * N
    sacc = ttgl.zeros([4, 256], ttgl.float32, layout=scale_layout)
    if LD > 0:  # int64 chunks at the production addresses; the byte sum taken from the chunks' bytes
      kq = ttgl.arange(0, 32, layout=ttgl.SliceLayout(1, chunk_layout))
      nq = ttgl.arange(0, 32, layout=ttgl.SliceLayout(0, chunk_layout))
      q_ptr = p_ptr.to(ttgl.pointer_type(ttgl.int64))
      q_offs = ttgl.expand_dims(kq + pid_s * (STEPS * 32), 1) * (N // 8) + ttgl.expand_dims(nq, 0) + pid_n * 32
      qacc = ttgl.zeros([32, 32], ttgl.int64, layout=chunk_layout)
      for i in ttgl.static_range(STEPS):
        ptrs = q_ptr + q_offs + i * (4 * N)
        if LD == 1:
          v = ttgl.load(ptrs)
        else:
          v = ttgl.inline_asm_elementwise(asm[LD], "=l,l", [ptrs], dtype=ttgl.int64, is_pure=True, pack=1)
        for b in ttgl.static_range(8):
          qacc = qacc + ((v >> (8 * b)) & 255)
        sacc = sacc + ttgl.load(s_ptr + s_offs + i * s_step).to(ttgl.float32)
      total = ttgl.sum(ttgl.sum(qacc, 1), 0).to(ttgl.float32) + ttgl.sum(ttgl.sum(sacc, 1), 0)
    else:
      acc = ttgl.zeros([32, 256], ttgl.int32, layout=code_layout)
      for i in ttgl.static_range(STEPS):
        acc = acc + ttgl.load(p_ptr + c_offs + i * c_step).to(ttgl.int32)
        sacc = sacc + ttgl.load(s_ptr + s_offs + i * s_step).to(ttgl.float32)
      total = ttgl.sum(ttgl.sum(acc, 1), 0).to(ttgl.float32) + ttgl.sum(ttgl.sum(sacc, 1), 0)
    ttgl.store(o_ptr + pid_n * splits + pid_s, total)

  return loads


@functools.lru_cache(maxsize=None)
def _compiled(meta: tuple):
  """The probe compiled for sm_90 (the production mma.sync build's warps and register cap)."""
  lay = list(LAYOUTS)[dict(meta).get("LAY", 0)]
  return w4_gluon._compile_gluon(_kernel(lay), w4_gluon._ARG_DTYPES, dict(meta), 90, num_warps=4, maxnreg=128)


@functools.lru_cache(maxsize=None)
def _loaded(meta: tuple):
  """``(ptx, name, shared bytes)`` of the probe, loaded into the FFI launcher on every GPU."""
  return w4_gluon._load(_compiled(meta))


VARIANTS = {"i64": 1, "l2_256": 2, "l2_128": 3, "nc_256": 4}  # name -> LD


def _meta(m: int, k: int, n: int, tiled: bool, ld: int = 0, lay: int = 0) -> tuple:
  build = w4_gluon._build(m, k, n, 1)
  assert not build.wg, "the probe mirrors the mma.sync build (M <= 16)"
  meta = {key: v for key, v in build.meta.items() if key in ("M", "N", "K", "L", "STEPS", "MB", "ATOMIC", "XS", "WA")}
  return tuple(dict(meta, TILED=tiled, LD=ld, LAY=lay).items()), build.grid


def loads_only(x, w, tiled: bool, ld: int = 0, lay: int = 0):
  """The probe kernel on ``x [M, K]`` and the NVFP4 ``w [K, N]``: float32 ``[programs]`` byte sums."""
  m, k = x.shape
  meta, grid = _meta(m, k, w.shape[1], tiled, ld, lay)
  ptx, name, shared = _loaded(meta)
  operands = (x, *w4_triton._layer_operands(w, w4_triton._format_of(w), None), jnp.zeros((1,), jnp.float32))
  return jax.ffi.ffi_call(w4_gluon._FFI_TARGET, jax.ShapeDtypeStruct((grid[0] * grid[1],), jnp.float32))(
      *operands, **w4_gluon._launch_attrs(ptx, name, grid, shared, threads=128))


def main():
  from labcommon import SHAPES_7B, activations, rotating_weights, us_per_call

  if os.environ.get("LOADS_OFFLINE"):
    from sasstool import sass
    os.makedirs("/tmp/gl", exist_ok=True)
    for tiled in (False, True):
      ck = _compiled(_meta(M, 3584, 18944, tiled)[0])
      sass(ck, f"loads_{'tiled' if tiled else 'strided'}")
    for name in VARIANTS_RUN:
      sass(_compiled(_meta(M, 3584, 18944, False, VARIANTS[name])[0]), f"loads_{name}")
    for name in LAYOUTS_RUN:
      sass(_compiled(_meta(M, 3584, 18944, False, 0, LAYOUT_IDS[name])[0]), f"loads_{name}")
    return
  totals = {}
  for shape, (k, n) in SHAPES_7B.items():
    q0, qs = rotating_weights(k, n)
    x = activations(M, k)
    want = float(jnp.sum(q0.packed.astype(jnp.float32)) + jnp.sum(q0.block_scale.astype(jnp.float32)))
    for tiled, ld, lay in ([(False, 0, 0), (True, 0, 0)] + [(False, VARIANTS[v], 0) for v in VARIANTS_RUN]
                           + [(False, 0, LAYOUT_IDS[v]) for v in LAYOUTS_RUN]):
      got = float(jnp.sum(loads_only(x, q0, tiled, ld, lay)))  # every byte read once: the sums add up
      assert abs(got - want) <= 1e-4 * abs(want), (shape, tiled, ld, lay, got, want)
    row = {"strided": us_per_call(lambda x, w: loads_only(x, w, False), x, qs),
           "tiled": us_per_call(lambda x, w: loads_only(x, w, True), x, qs)}
    for v in VARIANTS_RUN:
      row[v] = us_per_call(lambda x, w, ld=VARIANTS[v]: loads_only(x, w, False, ld), x, qs)
    for v in LAYOUTS_RUN:
      row[v] = us_per_call(lambda x, w, lay=LAYOUT_IDS[v]: loads_only(x, w, False, 0, lay), x, qs)
    row["kernel"] = us_per_call(lambda x, w: w4_gluon.forward(x, w), x, qs)
    for key, v in row.items():
      totals[key] = totals.get(key, 0.0) + v
    gb = k * n * 9 / 16 / 1e3
    print(f"{shape:8s} M={M} " + " | ".join(f"{key} {v:6.1f} us ({gb / v:5.0f} GB/s)" for key, v in row.items()),
          flush=True)
  gb = sum(k * n * 9 / 16 for k, n in SHAPES_7B.values()) / 1e3
  print("summed: " + " | ".join(f"{key} {v:6.1f} us ({gb / v:5.0f} GB/s)" for key, v in totals.items()), flush=True)


if __name__ == "__main__":
  main()
