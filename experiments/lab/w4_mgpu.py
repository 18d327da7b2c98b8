"""Lab: W4A16 GEMV on Mosaic GPU, the decoded weight as the wgmma A operand (a dead end so far).

First GPU run (session 4, H200, jax 0.11.2): correct (rel err 2e-3 against the XLA reference) but
3-4x slower than the Triton kernel: 7B qkv at M = 1 took 37-48 µs (splits 1-4) against 11.3 µs
(Triton) and 10.1 µs (bf16); the next shape then printed nothing before a 200 s timeout, and
``overlap=True`` printed nothing in 110 s (docs/bench_runs/session4_lab_output.txt).

Status (session 3, jax 0.11.2 on the CPU): a ``plgpu.kernel`` (unlike a Mosaic GPU ``pallas_call``)
lowers off-GPU with ``jit(...).trace(...).lower(lowering_platforms=("cuda",))`` once
``jax._src.pallas.mosaic_gpu.pallas_call_registration`` is imported, and jax 0.11.2's Mosaic GPU
interpreter (``InterpretGPUParams``) runs kernels that use explicit copies; so this kernel can be
developed and checked on a CPU before GPU time is spent: this kernel lowers, and matches a
float64 product in the interpreter (rel err < 1e-7) at ragged M, with split-K.

Structure: swap-AB (the program's 64 output columns are wgmma's M, the batch M <= 64 padded to a
multiple of 8 is wgmma's N); a persistent loop over (N tile, K split); an emit_pipeline over K
steps of 128 that TMA-loads the K-contiguous codes [64, 64 bytes], the bf16 block scales
[8, 64] and x's even and odd columns [Mp, 64]; the codes are decoded in registers (widened to 16
bits: Mosaic GPU allows only and/or/xor on 8-bit vectors) into two swizzled shared-memory A tiles
(even and odd K), one per wgmma. What lowering taught: shared-memory writes must cover whole
swizzle tiles (so no 8-column slices), and a swizzled ref must be contiguous (so scales come in
the library's [K/16, N] layout, one contiguous row per group). Known costs to attack once it runs:
the scale broadcast is a chain of 7 selects per element, the decode uses integer compares rather
than bit placement (bit placement makes code 1 a bf16 subnormal, which the CPU interpreter
flushes), each step waits for its wgmmas before the next decode unless ``overlap=True`` (double-
buffered A tiles; the interpreter's race detector, ``InterpretGPUParams(detect_races=True)``, does
not model wgmma's asynchrony, so only the GPU can tell whether that schedule is safe), and the
codes are transposed once from the library's [K/2, N] (`prepare`). Tried and not lowering yet:
16-column chunks (A tiles with 32-byte swizzle, codes as [K/32, N, 16], one select per element
between two scale groups) pass the interpreter but fail Mosaic GPU's layout inference ("Failed to
infer a possible set of layouts", with an empty constraint dump).

  python3 experiments/lab/w4_mgpu.py   # jax 0.11.x: on a CPU, interpreter checks + lowering;
                                              # on a GPU, checks + device times vs the Triton kernel
"""
import functools, math, os, sys
import jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

def _e2m1_x2(c):
  """uint16 codes (0..15) -> bf16 2 * e2m1 (exact integers in [-12, 12]).

  Integer arithmetic, then one conversion: no bf16 subnormals (the bit-placement decode of
  w4_triton makes code 1 a bf16 subnormal, which XLA's CPU flushes to zero, so the interpreter
  could not check it). Mosaic GPU allows only and/or/xor on 8-bit vectors, so codes arrive widened
  to 16 bits.
  """
  m = (c & 7).astype(jnp.int16)
  v = jnp.where(m < 4, m, jnp.where(m < 6, 2 * m - 4, 4 * m - 16))
  v = jnp.where((c & 8) != 0, -v, v)
  return v.astype(jnp.bfloat16)


def w4_gemv(x_even, x_odd, codes_t, scales, *, tile_n=64, tile_k=128, splits=1, stages=4, num_sms=132,
            overlap=False, interpret=None):
  """Split-K partials of y^T: [splits, N, Mp] float32, summing to W^T x^T.

  x_even, x_odd: bf16 [Mp, K/2], the even and odd columns of x (Mp a multiple of 8).
  codes_t: uint8 [N, K/2] (K-contiguous; byte j: low nibble K=2j, high nibble K=2j+1).
  scales: bf16 [K/16, N] (the library's block-scale layout): block scale / 2 (the decode gives
    2 * e2m1); the caller applies the inverse global scale.
  overlap: double-buffer the shared-memory A tiles so a step decodes into one slot while the
    previous step's wgmmas still read the other (x tiles are released a step late for the same
    reason); False waits for each step's wgmmas before the next decode.
  """
  mp, k2 = x_even.shape
  k = 2 * k2
  n = codes_t.shape[0]
  tk2 = tile_k // 2
  groups = tile_k // 16
  n_tiles = n // tile_n
  k_steps = k // tile_k
  if n % tile_n or k % tile_k or k_steps % splits or mp % 8:
    raise ValueError(f"shapes must tile: N={n} % {tile_n}, K={k} % {tile_k}, steps {k_steps} % splits {splits}, "
                     f"Mp={mp} % 8")
  steps = k_steps // splits
  swz = plgpu.find_swizzle(tk2 * 16, "rhs")
  tr = (plgpu.TilingTransform((8, swz // 2)), plgpu.SwizzleTransform(swz))

  def body(xe_g, xo_g, c_g, s_g, o_g, a_lo, a_hi, o_smem):
    @plgpu.nd_loop((n_tiles * splits,), collective_axes="sm")
    def _tiles(info):
      ni = info.index[0] // splits
      si = info.index[0] % splits

      def acc_scope(acc_ref):
        def step(idx, xe_s, xo_s, c_s, s_s):
          if overlap:  # slot kk % 2 was last read by step kk - 2's wgmmas: let only step kk - 1's pair run on
            plgpu.wgmma_wait(2)
            slot = idx[0] % 2
            lo_ref, hi_ref = a_lo.at[slot], a_hi.at[slot]
          else:
            lo_ref, hi_ref = a_lo, a_hi
          p = c_s[...]                                   # uint8 [tile_n, tk2]
          col = plgpu.broadcasted_iota(jnp.int32, (tile_n, tk2), 1, layout=plgpu.Layout.WGMMA)
          sb = lax.broadcast_in_dim(s_s[0], (tile_n, tk2), [0])
          for g in range(1, groups):                     # scale of group g on columns [8g, 8g+8)
            sb = jnp.where(col >= 8 * g, lax.broadcast_in_dim(s_s[g], (tile_n, tk2), [0]), sb)
          p16 = p.astype(jnp.uint16)
          lo_ref[...] = _e2m1_x2(p16 & 15) * sb
          hi_ref[...] = _e2m1_x2(p16 >> 4) * sb
          plgpu.commit_smem()
          plgpu.wgmma(acc_ref, lo_ref, xe_s.transpose((1, 0)))
          plgpu.wgmma(acc_ref, hi_ref, xo_s.transpose((1, 0)))
          if not overlap:
            plgpu.wgmma_wait(0)

        plgpu.emit_pipeline(
            step,
            grid=(steps,),
            in_specs=[
                plgpu.BlockSpec((mp, tk2), lambda kk: (0, si * steps + kk), transforms=tr, delay_release=int(overlap)),
                plgpu.BlockSpec((mp, tk2), lambda kk: (0, si * steps + kk), transforms=tr, delay_release=int(overlap)),
                plgpu.BlockSpec((tile_n, tk2), lambda kk: (ni, si * steps + kk)),
                plgpu.BlockSpec((groups, tile_n), lambda kk: (si * steps + kk, ni)),
            ],
            max_concurrent_steps=stages,
        )(xe_g, xo_g, c_g, s_g)
        if overlap:
          plgpu.wgmma_wait(0)
        return acc_ref[...]

      acc = pl.run_scoped(acc_scope, plgpu.ACC((tile_n, mp)))
      o_smem[...] = acc
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem, o_g.at[si, pl.ds(ni * tile_n, tile_n)])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((splits, n, mp), jnp.float32),
      grid=(num_sms,),
      grid_names=("sm",),
      scratch_types=dict(a_lo=plgpu.SMEM((2, tile_n, tk2) if overlap else (tile_n, tk2), jnp.bfloat16, transforms=tr),
                         a_hi=plgpu.SMEM((2, tile_n, tk2) if overlap else (tile_n, tk2), jnp.bfloat16, transforms=tr),
                         o_smem=plgpu.SMEM((tile_n, mp), jnp.float32)),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=interpret,
  )
  return kernel(x_even, x_odd, codes_t, scales)


def prepare(w):
  """NVFP4Tensor [K, N] -> (codes [N, K/2] K-contiguous, bf16 scales/2 [K/16, N], 1/global scale).

  A one-time repack (the kernel's layout); a real integration would store weights this way.
  """
  codes_t = jnp.asarray(w.packed).T
  scales = (jnp.asarray(w.block_scale).astype(jnp.float32) / 2).astype(jnp.bfloat16)
  return codes_t, scales, 1.0 / jnp.asarray(w.global_scale, jnp.float32)


def forward(x, prepared, *, splits=1, **kw):
  """x bf16 [M, K] (M <= 64) @ W -> float32 [M, N], with W from :func:`prepare`."""
  codes_t, scales, igs = prepared
  m = x.shape[0]
  mp = max(8, -(-m // 8) * 8)
  xp = jnp.pad(x, ((0, mp - m), (0, 0)))
  parts = w4_gemv(xp[:, 0::2], xp[:, 1::2], codes_t, scales, splits=splits, **kw)
  return (parts.sum(0)[:, :m].T * igs).astype(jnp.float32)


def _check_on_cpu():
  """Mosaic GPU interpreter (jax 0.11.x, CPU) against a float64 product: shapes, M padding, split-K."""
  import numpy as np
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  from qerl_jax import nvfp4
  rng = np.random.default_rng(0)
  for m, k, n, splits, overlap in [(8, 256, 128, 1, False), (1, 512, 64, 2, False), (13, 256, 192, 2, False),
                                   (64, 256, 64, 1, False), (8, 512, 128, 1, True), (13, 768, 64, 2, True)]:
    w = nvfp4.quantize(jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.float32))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    ref = np.asarray(x, np.float64) @ np.asarray(nvfp4.dequantize(w, jnp.float32), np.float64)
    y = forward(x, prepare(w), splits=splits, overlap=overlap, num_sms=3, interpret=InterpretGPUParams())
    err = np.linalg.norm(np.asarray(y, np.float64) - ref) / np.linalg.norm(ref)
    print(f"interpret M={m} K={k} N={n} splits={splits} overlap={overlap}: rel err {err:.1e}", flush=True)
    assert err < 1e-4, err


OVERLAPS = tuple({"0": (False,), "1": (True,)}.get(os.environ.get("W4_OVERLAP", ""), (False, True)))


def _bench_on_gpu():
  """7B shapes, M = 1, 8, 32, 64: check against the XLA reference, then device time (kernels of a
  call summed, including the pad / even-odd split / split-K sum) vs the Triton kernel and bf16."""
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from labcommon import SHAPES_7B, activations, rotating_weights, us_per_call
  from pallas_kernels import w4_triton
  from pallas_kernels.matmul import reference_matmul
  for name, (k, n) in SHAPES_7B.items():
    q0, qs = rotating_weights(k, n)
    preps = [prepare(q) for q in qs]
    ws = [jnp.zeros((k, n), jnp.bfloat16) + i for i in range(max(2, -(-(256 << 20) // (k * n * 2))))]
    for m in (1, 8, 32, 64):
      x = activations(m, k)
      ref = reference_matmul(x, q0, out_dtype=jnp.float32)
      line = [f"triton {us_per_call(w4_triton.forward, x, qs):6.1f}", f"bf16 {us_per_call(jnp.dot, x, ws):6.1f}"]
      for splits in (1, 2, 4):
        for overlap in OVERLAPS:
          if (k // 128) % splits:
            continue
          tag = f"mgpu s{splits}{' ov' if overlap else ''}"
          try:
            y = forward(x, preps[0], splits=splits, overlap=overlap)
            err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
            assert err < 1e-2 and not bool(jnp.isnan(y).any()), err
            us = us_per_call(lambda x, p, s=splits, o=overlap: forward(x, p, splits=s, overlap=o), x, preps)
            line.append(f"{tag} {us:6.1f} (err {err:.0e})")
          except Exception as e:  # a lab: report and go on
            line.append(f"{tag} FAIL {repr(e)[:120]}")
      print(f"{name:8s} M={m:2d} us: " + " | ".join(line), flush=True)


if __name__ == "__main__":
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
  from jax._src.pallas.mosaic_gpu import pallas_call_registration  # noqa: F401
  if jax.default_backend() == "cpu":
    _check_on_cpu()
  else:
    _bench_on_gpu()
  m, k, n = 16, 3584, 4608
  for overlap in (False, True):
    f = jax.jit(functools.partial(w4_gemv, overlap=overlap))
    lo = f.trace(jax.ShapeDtypeStruct((m, k // 2), jnp.bfloat16), jax.ShapeDtypeStruct((m, k // 2), jnp.bfloat16),
                 jax.ShapeDtypeStruct((n, k // 2), jnp.uint8),
                 jax.ShapeDtypeStruct((k // 16, n), jnp.bfloat16)).lower(lowering_platforms=("cuda",))
    print(f"lowered for CUDA (overlap={overlap}): {len(lo.as_text())} characters of IR")
