"""Lab (no GPU needed): SASS of a swap-AB small-M forward (decoded weight = the MMA's A operand).

Timed on the H200 in session 4 (``time_swapab.py``; docs/benchmarks.md, "Session 4"): with
K-contiguous codes and bm = 8 it is 24-26% faster than the library kernel at M <= 8, but the same
layout makes M = 32-64 slower, so the library keeps its ``[K/2, N]`` layout. ``swap=False`` is
the plain orientation on K-contiguous codes (``acc [bm, bn] += x @ decode(codes).T``).

The tuned M <= 32 kernel computes ``acc[bm, bn] += x_even @ w_lo + x_odd @ w_hi`` with bm = 16;
Triton then uses mma.sync (MMAv2) and the decoded weight, the B operand, is converted to the
MMA layout through shared memory. This lab kernel computes the transposed accumulator instead,
``acc_t[bn, bm] += w_lo_t[bn, bk/2] @ x_even_t[bk/2, bm]`` (+ odd), so that bn (64-128) is the
MMA's M and the tiny batch is its N (8 or 16). The hypothesis: Triton 3.6 on sm_90 then
uses Hopper wgmma (MMAv3) with the A operand in registers (the "RS" form), the decoded
weights never touch shared memory, and the main loop needs fewer instructions per weight.

Codes are read either in the library layout ``[K/2, N]`` (``layout="kn"``: the codes and scales
are transposed in registers, ``p.T``, before the decode) or K-contiguous ``[N, K/2]``
(``layout="nk"``, the checkpoint layout, as in ``offline_sass_kcontig.py``). The decode is the
tuned kernel's (``w4_triton``'s inline-PTX E2M1 decode with the 2**118 scale fold,
``_asm_scales``, and ``_ASM_GAIN`` on the accumulator); ``decode="bits"`` (plain jnp ops) is
used in interpret mode. No masks on K/N (shapes must divide the tiles); M is masked. The output
is float32 partial sums ``[splits, M, N]`` (``acc_t.T`` is stored), summed by ``forward``.

For each variant this prints registers, shared memory, the main loop's instructions per
warp and K step divided by the weight values per thread (``offline_sass.py``'s method, pip
triton 3.6 compiling the Pallas-lowered TTIR for sm_90), the top ops, the MMA version (``v3``:
the TTGIR has ``ttng.warp_group_dot`` with a ``#ttg.nvidia_mma<{versionMajor = 3`` layout),
whether the SASS has ``HGMMA``, and (v3 only) whether the dot's A operand is a register tensor
(``#ttg.dot_op``) rather than a shared-memory descriptor (``!ttg.memdesc``). Variant names are
``{layout}_bn{bn}_bm{bm}_bk{bk}_w{num_warps}`` (splits 4, num_stages 3), ``_perm``: ``permute``
(below), ``_nov3``: compiled with ``DISABLE_MMA_V3=1`` (Triton's switch; mma.sync). Extra
``,field=value`` items override (``m=``, ``num_stages=``, ``prefetch=``, ``permute=``, ...).
It first checks the kernel in Pallas interpret mode (M=3 and 11, K=256, N=128, decode "bits")
against ``pallas_kernels.matmul.reference_matmul`` and a float64 product, both layouts (the
asm decode, inline PTX, only runs on a GPU: check it there against the same reference).

  python3 experiments/lab/offline_sass_swapab.py            # check + all variants
  python3 experiments/lab/offline_sass_swapab.py check nk_bn128_bm8_bk128_w4,num_stages=2

Findings (pip triton 3.6, sm_90, M=8 K=3584 N=18944; instructions per weight value in the main
loop; baselines: ``offline_sass.py tuned`` 6.48 (16x128x64, mma.sync, B through shared memory),
``offline_sass_kcontig.py`` kt 4.53 / kt_bn64 5.16 / kt_bk64 5.17 (no 2**118 scale fold, so
about 0.1 low)):

* wgmma with the decoded weight in registers does happen, for bm = 16 and 4 or 8 warps: the
  TTGIR has ``ttng.warp_group_dot %asm_out, %memdesc`` with A ``tensor<..., #ttg.dot_op<{opIdx
  = 0, parent = #mma (v3), kWidth = 2}>>`` and B (x) from shared memory; SASS ``HGMMA.64x16x16``
  with register A. It is not cheaper by itself: 6.25-8.1/value (nk), 8.5-10.4 (kn). kWidth = 2
  gives each thread 2 consecutive K bytes, so the codes are gathered with LDS.U16 + ~2 PRMT per
  byte pair, and every thread converts one block scale per 4 values (4x the need; mma.sync: 2x).
* bm = 8 never gets wgmma: the remark (``MLIR_ENABLE_DIAGNOSTICS=remarks``) is "MMA version 3
  acceleration not applied due to unsupported shapes"; Triton 3.6's ``supportMMA`` needs the
  dot's N (here bm) % 16 == 0. It uses mma.sync m16n8k16 with the weight as A (kWidth = 4: 4
  consecutive K bytes per thread; codes read by LDS.128, 16 HMMA per step for bn128 bk128 vs 32
  at bm 16) and that is the cheapest form found:
  nk bn128 bk128 w4 4.18/value (71 regs, 22.5 KB smem), 4.06 with num_stages=2 (96 regs, 11 KB),
  3.98 with bk=256 (80 regs, 45 KB); bn64 bk128 4.70; bk64 4.61; 8 warps 4.64-5.44.
* ``permute=True`` (reorder K inside 16-column chunks, weight and x alike, so a thread's four
  wgmma K columns are four consecutive bytes) removes the gather for wgmma: nk bn128 bm16 bk128
  w4 6.25 -> 4.52 (4.37 with num_stages=2), w8 6.80 -> 5.00, bn64 6.89 -> 5.08; kn 8.45 -> 5.27.
  mma.sync with bm = 16 (``_nov3``) is 4.62 for the same tile: at M 9..16 wgmma+permute and
  mma.sync are even. For mma.sync (bm 8) the permutation hurts (4.18 -> 5.30): Triton's own
  kWidth-4 order already does it.
* the library layout [K/2, N] costs 8.5-11/value without ``permute`` (~2.7 PRMT per value to
  transpose bytes) and 5.3-7.2 with wgmma + ``permute``, always 0.75+ above [N, K/2]: swap-AB
  wants the K-contiguous (checkpoint) layout.
* the decode's floor is ~2.9/value (asm: ~3 PRMT per 4 bytes, then per bf16 pair and nibble
  SHL, LOP3, SHL, LOP3, HMUL2); the scale conversion (F2FP, HADD2.F32, FMUL 2**118,
  F2FP) ~0.4; the split accumulator (Pallas emits dot(a, b, 0) + acc: FADD, and for wgmma a
  ``warp_group_dot_wait {pendings = 0}`` after every dot) 0.125-0.25.
* prefetch (the next step's tiles carried in registers) is worse here (4.18 -> 5.31: 128 regs,
  PRMT shuffles), as in the kcontig lab.
"""
import sys, os, re, functools, subprocess, warnings
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np
import jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import offline_sass as variant  # installs the TTIR capture hook; OUT, NV, loop_hist
from pallas_kernels import w4_triton as W

_FMT = W._Format(16, True)


def decode_t(p, s, decode):
  """Codes u8 [bn, bkp] (K contiguous) and block scales [bn, bkp/8] -> (lo, hi) bf16 [bn, bkp].

  ``decode="asm"``: ``s`` is already ``W._asm_scales`` (bf16 times 2**118); the values are
  ``1 / W._ASM_GAIN`` of the true ones. ``"bits"``: plain jnp ops, true values (interpret mode).
  """
  bn, bkp = p.shape
  if decode == "asm":
    s = jnp.broadcast_to(s[:, :, None], (bn, bkp // 8, 8)).reshape(bn, bkp)
    return [plgpu.elementwise_inline_asm(asm, args=[p, s], constraints="=r,=r,r,r,r", pack=4,
            result_shape_dtypes=[jax.ShapeDtypeStruct(p.shape, jnp.bfloat16)])[0]
            for asm in (W._E2M1_ASM_LO, W._E2M1_ASM_HI)]
  lo, hi = W._decode_tile(p.T, s.T, _FMT, jnp.bfloat16, decode="bits")
  return lo.T, hi.T


def kperm(a):
  """Reorders the contraction axis of a [rows, bk/2] tile inside each 16-column chunk so that the
  4 consecutive columns 4t..4t+3 go to dot columns 2t, 2t+1, 2t+8, 2t+9: the columns one thread
  holds in the wgmma (and mma.sync) A-operand fragment for 16-bit types. Applied to both the
  decoded weight and x, it leaves the product unchanged."""
  r, c = a.shape
  return a.reshape(r, c // 16, 4, 2, 2).transpose(0, 1, 3, 2, 4).reshape(r, c)


def kernel(x_ref, p_ref, s_ref, igs_ref, o_ref, *, m, bm, bn, bk, steps, layout, decode, prefetch,
           permute=False, swap=True):
  pid_n, pid_s, pid_m = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  n0, m0 = pid_n * bn, pid_m * bm
  m_mask = (m0 + jnp.arange(bm)) < m
  asm = decode == "asm"

  def load(step):
    kb = step * bk
    x = plgpu.load(x_ref.at[pl.ds(m0, bm), pl.ds(kb, bk)], mask=m_mask[:, None], other=0.0)
    xe, xo = lax.unstack(x.reshape(bm, bk // 2, 2), axis=2)
    if layout == "nk":
      p = plgpu.load(p_ref.at[pl.ds(n0, bn), pl.ds(step * (bk // 2), bk // 2)])
      s = plgpu.load(s_ref.at[pl.ds(n0, bn), pl.ds(step * (bk // 16), bk // 16)])
    else:  # library layout [K/2, N], [K/16, N]: transpose in registers
      p = plgpu.load(p_ref.at[pl.ds(step * (bk // 2), bk // 2), pl.ds(n0, bn)]).T
      s = plgpu.load(s_ref.at[pl.ds(step * (bk // 16), bk // 16), pl.ds(n0, bn)]).T
    return xe, xo, p, (W._asm_scales(s) if asm else s)

  def mult(acc_t, xe, xo, p, s):
    lo, hi = decode_t(p, s, decode)  # [bn, bk/2]
    if permute:
      lo, hi, xe, xo = kperm(lo), kperm(hi), kperm(xe), kperm(xo)
    if not swap:  # plain orientation: acc [bm, bn] (the K-contiguous codes as a transposed B operand)
      acc_t += jnp.dot(xe, lo.T, preferred_element_type=jnp.float32)
      return acc_t + jnp.dot(xo, hi.T, preferred_element_type=jnp.float32)
    acc_t += jnp.dot(lo, xe.T, preferred_element_type=jnp.float32)  # [bn, bm]
    return acc_t + jnp.dot(hi, xo.T, preferred_element_type=jnp.float32)

  st0 = pid_s * steps
  zeros = jnp.zeros((bn, bm) if swap else (bm, bn), jnp.float32)
  if prefetch:
    def body(i, c):
      nxt = load(st0 + jnp.minimum(i + 1, steps - 1))
      return (mult(*c), *nxt)
    acc_t = lax.fori_loop(0, steps, body, (zeros, *load(st0)))[0]
  else:
    acc_t = lax.fori_loop(0, steps, lambda i, a: mult(a, *load(st0 + i)), zeros)
  acc_t = acc_t * (igs_ref[0] * (W._ASM_GAIN if asm else 1.0))
  plgpu.store(o_ref.at[pid_s, pl.ds(m0, bm), pl.ds(n0, bn)], acc_t.T if swap else acc_t, mask=m_mask[:, None])


def forward(x, codes, scales, inv_global_scale, *, layout="nk", bm=8, bn=128, bk=128, splits=4,
            num_warps=4, num_stages=3, decode="asm", prefetch=False, permute=False, swap=True,
            interpret=False):
  """Swap-AB fused W4A16 forward: float32 ``[M, N] = x @ W``.

  Args:
    x: bf16 ``[M, K]`` (any M; M > bm runs ceil(M / bm) row tiles, each decoding the weights again).
    codes: uint8 ``[N, K/2]`` (``layout="nk"``, checkpoint layout: ``w.packed.T``) or
      ``[K/2, N]`` (``layout="kn"``, the library's ``w.packed``).
    scales: float8_e4m3fn ``[N, K/16]`` (``"nk"``: ``w.block_scale.T``) or ``[K/16, N]`` (``"kn"``).
    inv_global_scale: float32 ``[1]``, ``1 / w.global_scale``.
    layout, bm, bn, bk, splits, num_warps, num_stages, decode, prefetch, permute: variant knobs
      (defaults: the lowest-count M <= 8 variant, mma.sync); K must divide into ``splits * bk``,
      N by bn; the grid is (N / bn, splits, ceil(M / bm)), so pick ``splits`` per shape for
      enough programs. ``permute=True`` only pays with wgmma (bm = 16). ``decode="asm"`` needs
      a GPU; interpret mode switches to ``"bits"``.

  Returns:
    float32 ``[M, N]`` (the split partials summed by XLA).
  """
  m, k = x.shape
  n = codes.shape[0] if layout == "nk" else codes.shape[1]
  assert n % bn == 0 and k % (bk * splits) == 0, (m, k, n, bm, bn, bk, splits)
  if interpret:
    decode = "bits"
  steps = k // bk // splits
  f = functools.partial(kernel, m=m, bm=bm, bn=bn, bk=bk, steps=steps, layout=layout,
                        decode=decode, prefetch=prefetch, permute=permute, swap=swap)
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    out = pl.pallas_call(f, out_shape=jax.ShapeDtypeStruct((splits, m, n), jnp.float32),
                         grid=(n // bn, splits, -(-m // bm)), interpret=interpret, name="w4a16_swapab",
                         compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
                         )(x, codes, scales, inv_global_scale.reshape(1).astype(jnp.float32))
  return out.sum(axis=0)


def operands(w, layout):
  """(codes, scales, inv_global_scale) of an NVFP4Tensor for ``forward``'s layout."""
  igs = (1.0 / w.global_scale.astype(jnp.float32)).reshape(1)
  if layout == "nk":
    return w.packed.T, w.block_scale.T, igs
  return w.packed, w.block_scale, igs


def check():
  from qerl_jax import nvfp4
  from pallas_kernels.matmul import reference_matmul
  k, n = 256, 128
  kx, kw = jax.random.split(jax.random.PRNGKey(0))
  w = nvfp4.quantize(jax.random.normal(kw, (k, n), jnp.float32))
  w64 = np.asarray(nvfp4.dequantize(w, jnp.float32), np.float64)
  for m in (3, 11):  # 11 with bm=8: two row tiles, the second masked
    x = jax.random.normal(jax.random.fold_in(kx, m), (m, k), jnp.float32).astype(jnp.bfloat16)
    ref = np.asarray(reference_matmul(x, w, out_dtype=jnp.float32), np.float64)  # bf16-rounded weight
    ref64 = np.asarray(x, np.float64) @ w64
    for layout in ("nk", "kn"):
      for bm, bn, bk, splits, permute in ((8, 64, 64, 2, False), (16, 128, 128, 1, False), (16, 64, 64, 2, True)):
        y = np.asarray(forward(x, *operands(w, layout), layout=layout, bm=bm, bn=bn, bk=bk,
                               splits=splits, permute=permute, interpret=True), np.float64)
        err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
        err64 = np.linalg.norm(y - ref64) / np.linalg.norm(ref64)
        print(f"interpret check M={m} {layout} bm{bm} bn{bn} bk{bk} splits{splits} permute={permute}: rel err vs "
              f"reference_matmul {err:.2e}, vs float64 {err64:.2e}")
        assert err < 1e-2 and err64 < 1e-2


def mma_info(ttgir, sass):
  """(MMA version "v3"/"v2", SASS has HGMMA, wgmma A operand in registers (None for v2), dots) from TTGIR/SASS."""
  dots = [l for l in ttgir.splitlines() if "ttng.warp_group_dot " in l or re.search(r"\btt\.dot\b", l)]
  wg = any("ttng.warp_group_dot " in l for l in dots)
  v3 = bool(re.search(r"#ttg\.nvidia_mma<\{versionMajor = 3", ttgir))
  hg = "HGMMA" in sass
  # ttng.warp_group_dot %a, %b, %c : tensor<...#ttg.dot_op<...>> * !ttg.memdesc<...> -> ...
  a_reg = None
  for l in dots:
    if "ttng.warp_group_dot " in l:
      a_ty = re.search(r"\}\s*:\s*(.*?)\s\*\s", l).group(1)  # the A operand's type
      a_reg = "dot_op" in a_ty and "memdesc" not in a_ty
  return ("v3" if wg and v3 else "v2" if dots else "?"), hg, a_reg, len(dots)


def compile_variant(tag, *, m=8, k=3584, n=18944, layout="nk", bm=16, bn=64, bk=128, splits=4,
                    num_warps=4, num_stages=3, prefetch=False, permute=False, nov3=False):
  import triton
  from triton.backends.compiler import GPUTarget
  xs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  if layout == "nk":
    ps, ss = jax.ShapeDtypeStruct((n, k // 2), jnp.uint8), jax.ShapeDtypeStruct((n, k // 16), jnp.float8_e4m3fn)
  else:
    ps, ss = jax.ShapeDtypeStruct((k // 2, n), jnp.uint8), jax.ShapeDtypeStruct((k // 16, n), jnp.float8_e4m3fn)
  gs = jax.ShapeDtypeStruct((1,), jnp.float32)
  fn = functools.partial(forward, layout=layout, bm=bm, bn=bn, bk=bk, splits=splits, num_warps=num_warps,
                         num_stages=num_stages, prefetch=prefetch, permute=permute)
  variant.captured.clear()
  jax.jit(fn).trace(xs, ps, ss, gs).lower(lowering_platforms=("cuda",))
  out = variant.OUT
  path = f"{out}/{tag}.ttir"; open(path, "w").write(variant.captured[-1])
  if nov3:  # Triton's own switch: fall back to mma.sync (MMAv2) even where wgmma applies
    os.environ["DISABLE_MMA_V3"] = "1"
  try:
    kk = triton.compile(path, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
  finally:
    os.environ.pop("DISABLE_MMA_V3", None)
  ttgir = kk.asm["ttgir"]
  open(f"{out}/{tag}.ttgir", "w").write(ttgir); open(f"{out}/{tag}.cubin", "wb").write(kk.asm["cubin"])
  open(f"{out}/{tag}.ptx", "w").write(kk.asm["ptx"])
  sass = subprocess.check_output([variant.NV + "/cuobjdump", "-sass", f"{out}/{tag}.cubin"]).decode()
  open(f"{out}/{tag}.sass", "w").write(sass)
  nl, ops, tot = variant.loop_hist(sass)
  usage = subprocess.check_output([variant.NV + "/cuobjdump", "--dump-resource-usage", f"{out}/{tag}.cubin"]).decode()
  regs = int(re.search(r"REG:(\d+)", usage).group(1))
  vals = bk * bn // (32 * num_warps)  # weight values per thread per K step
  wg, hg, a_reg, ndots = mma_info(ttgir, sass)
  return dict(tag=tag, regs=regs, smem=kk.metadata.shared, loop=nl, per_value=nl / vals, wgmma=wg, hgmma=hg,
              a_reg=a_reg, ndots=ndots, top=ops.most_common(8))


VARIANTS = {}
for _layout in ("nk", "kn"):
  for _bn in (64, 128):
    for _bm in (8, 16):
      for _bk in (64, 128):
        for _w in (4, 8):
          if _w == 8 and _bn == 64:
            continue  # 8 warps = 2 warpgroups need >= 128 MMA rows
          VARIANTS[f"{_layout}_bn{_bn}_bm{_bm}_bk{_bk}_w{_w}"] = dict(layout=_layout, bn=_bn, bm=_bm, bk=_bk, num_warps=_w)
          if _bm == 16:  # wgmma variants: also with the K permutation, and forced to mma.sync
            VARIANTS[f"{_layout}_bn{_bn}_bm{_bm}_bk{_bk}_w{_w}_perm"] = dict(
                layout=_layout, bn=_bn, bm=_bm, bk=_bk, num_warps=_w, permute=True)
            VARIANTS[f"{_layout}_bn{_bn}_bm{_bm}_bk{_bk}_w{_w}_nov3"] = dict(
                layout=_layout, bn=_bn, bm=_bm, bk=_bk, num_warps=_w, nov3=True)


def report(r):
  print(f"{r['tag']:40s} regs {r['regs']:3d} smem {r['smem']:6d} loop {r['loop']:4d} = {r['per_value']:.2f}/value "
        f"mma={r['wgmma']} HGMMA={'Y' if r['hgmma'] else 'n'} A_regs={r['a_reg']} "
        f"top={r['top']}", flush=True)


if __name__ == "__main__":
  args = sys.argv[1:]
  if not args or "check" in args:
    check()
  names = [a for a in args if a != "check"] or ([] if args == ["check"] else list(VARIANTS))
  for name in names:
    tag, *kv = name.split(",")
    kw = dict(VARIANTS.get(tag, {}))
    for item in kv:
      key, v = item.split("=")
      kw[key] = {"True": True, "False": False}.get(v, int(v) if v.isdigit() else v)
    try:
      report(compile_variant(tag, **kw) | {"tag": name})
    except Exception as e:  # a variant Triton rejects: say why and go on
      print(f"{name:40s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
