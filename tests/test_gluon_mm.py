"""Tests of the large-M Gluon forward kernel (pallas_kernels/w4_gluon_mm.py).

Gluon has no interpreter, so the kernel's numerics are tested on the GPU against a float64 numpy product.
On the CPU: its inline-PTX decode (through the small PTX interpreter of test_gluon.py) for every code and a
range of E4M3 block scales, its shape rules and settings.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import w4_gluon, w4_gluon_mm
from qerl_jax import nvfp4
from tests.test_gluon import _dense64, _rel, _run_ptx, _weight


def _check_registers(regs, code_bytes, scale):
  """The four output registers of a decode PTX against ``E2M1[code] * scale * 2**-8`` (low nibble in the low
  half) for bytes (n, r), (n + 1, r), (n, r + 4), (n + 1, r + 4) and the E4M3 scales of columns n, n + 1; returns
  the expected values ``[4, 2]``."""
  codebook = np.asarray(nvfp4.E2M1_CODEBOOK, np.float64)
  wants = []
  for reg, (byte, col) in enumerate(((0, 0), (2, 0), (1, 1), (3, 1))):
    v = regs[f"${reg}"]
    got = np.array([v & 0xFFFF, v >> 16], np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
    b = int(code_bytes[byte])
    want = codebook[[b & 15, b >> 4]] * float(scale[col].astype(np.float64)) * 2.0 ** -8
    np.testing.assert_array_equal(got, want, err_msg=f"bytes {code_bytes} register {reg}")
    wants.append(want)
  return np.array(wants)


@pytest.mark.parametrize("version", [1, 2, 3])
def test_mm_decode_ptx_by_codebook(version):
  """The decode's PTX gives ``E2M1[code] * scale * 2**-8`` exactly for both nibbles of the four bytes
  ((n, r), (n + 1, r), (n, r + 4), (n + 1, r + 4)): the low nibble (K row 2 r) in the low half, each column
  with its own E4M3 scale, in and out of E4M3's subnormal range; ``decode_reference`` says the same. All
  versions of the PTX (``DECODE`` 1, 2 and 3) take and give the same registers."""
  rng = np.random.default_rng(3)
  asm = w4_gluon_mm._asm() if version == 1 else w4_gluon_mm._asm2(shift_on_fma=version == 3)
  for trial in range(512):
    code_bytes = (np.array([(trial * 17 + 16 * i + i) % 256 for i in range(4)]) if trial < 256
                  else rng.integers(0, 256, size=4))
    scale = rng.choice([2.0 ** -9, 2.0 ** -7, 0.0625, 0.75, 1.0, 13.0, 448.0], size=2).astype(ml_dtypes.float8_e4m3fn)
    sbytes = scale.view(np.uint8)
    regs = _run_ptx(asm, {"$4": int(sum(int(b) << (8 * i) for i, b in enumerate(code_bytes))),
                          "$5": int(sbytes[0]) | (int(sbytes[1]) << 8) | (0xAB << 16)})  # bytes 2, 3 unused
    want = _check_registers(regs, code_bytes, scale)
    np.testing.assert_array_equal(w4_gluon_mm.decode_reference(code_bytes.astype(np.uint8), sbytes), want)


def _decode_order_cases(seed):
  """512 inputs of the decode-order PTXs: ``(code bytes (n, r), (n + 1, r), (n, r + 4), (n + 1, r + 4), their two
  E4M3 scales, the registers {"$4": code rows r | r + 4 as nvfp4.to_decode_order stores each 16-bit column pair,
  "$5": the scales})``; the first 256 walk every byte value, the rest are random."""
  rng = np.random.default_rng(seed)
  bits = nvfp4.DECODE_ORDER_BITS
  assert all(bits[b] // 16 == b // 16 for b in range(32))  # the order stays inside each 16-bit half

  def to_decode(pair16):  # one code row's 2 bytes (columns n, n + 1), standard -> decode order
    word = jnp.asarray(np.array([pair16 | (pair16 << 16)], np.uint32))
    return int(np.asarray(nvfp4.permute_word_bits(word, bits))[0]) & 0xFFFF

  for trial in range(512):
    code_bytes = (np.array([(trial * 17 + 16 * i + i) % 256 for i in range(4)]) if trial < 256
                  else rng.integers(0, 256, size=4))
    scale = rng.choice([2.0 ** -9, 0.0625, 0.75, 13.0, 448.0], size=2).astype(ml_dtypes.float8_e4m3fn)
    sbytes = scale.view(np.uint8)
    lo = to_decode(int(code_bytes[0]) | (int(code_bytes[1]) << 8))  # code row r: columns n, n + 1
    hi = to_decode(int(code_bytes[2]) | (int(code_bytes[3]) << 8))  # code row r + 4
    yield code_bytes, scale, {"$4": lo | (hi << 16), "$5": int(sbytes[0]) | (int(sbytes[1]) << 8)}


def test_mm_decode_order_ptx_by_codebook():
  """The decode-order PTX, fed each code row's 16-bit column pair as ``nvfp4.to_decode_order`` stores it (bits moved
  only inside that pair), gives the standard PTX's registers for every code: the same four bf16 pairs."""
  asm = w4_gluon_mm._asm_decode_order()
  for code_bytes, scale, inputs in _decode_order_cases(4):
    _check_registers(_run_ptx(asm, inputs), code_bytes, scale)


def test_mm_paired_decode_ptx_takes_one_nibble_of_two_code_rows():
  """The paired decode's PTX without its repair (DECODE 4), fed the same decode-order registers as
  ``_asm_decode_order``, gives the same bf16 values with the pairing moved: its ``$0`` is the low halves of that PTX's
  ``$0`` and ``$1`` (column n's low nibble of code rows r and r + 4), ``$1`` their high halves, and ``$2, $3`` the
  same of ``$2, $3`` (column n + 1); both PTXs checked against the E2M1 codebook on every byte value and E4M3 scales
  in and out of the subnormal range."""
  old, new = w4_gluon_mm._asm_decode_order(), w4_gluon_mm._asm_decode_order_paired(repair=False)
  for trial, (code_bytes, scale, inputs) in enumerate(_decode_order_cases(5)):
    was = _run_ptx(old, dict(inputs))
    _check_registers(was, code_bytes, scale)
    got = _run_ptx(new, dict(inputs))
    lo, hi = (lambda v: v & 0xFFFF), (lambda v: v >> 16)
    for out, (a, b) in enumerate(((0, 1), (0, 1), (2, 3), (2, 3))):
      half = lo if out in (0, 2) else hi
      want = half(was[f"${a}"]) | (half(was[f"${b}"]) << 16)
      assert got[f"${out}"] == want, (trial, out, hex(got[f"${out}"]), hex(want))


def test_mm_repaired_decode_ptx_gives_the_decode_order_registers():
  """The paired decode with its repair (DECODE 5, the wide tiles' default), fed the decode-order registers, gives exactly the
  E2M1 codebook's values in ``_asm_decode_order``'s registers (K rows 2 r, 2 r + 1 of column n in ``$0``, and so on),
  so x needs no permute; 512 inputs, every byte value and E4M3 scales in and out of the subnormal range."""
  asm = w4_gluon_mm._asm_decode_order_paired()
  assert asm.count("prmt.b32 t, ") == 4
  for code_bytes, scale, inputs in _decode_order_cases(6):
    _check_registers(_run_ptx(asm, inputs), code_bytes, scale)


def test_x_in_nibble_pair_order_swaps_rows_1_and_8_of_each_block():
  """The paired decode's operand order: in each 16-row block of K, rows 2 t + 1 and 2 t + 8 trade places (t = 0..3);
  applied twice it is the identity."""
  x = jnp.arange(2 * 48, dtype=jnp.float32).reshape(2, 48).astype(jnp.bfloat16)
  got = np.asarray(w4_gluon_mm.x_in_nibble_pair_order(x), np.float32)
  block = [0, 8, 2, 10, 4, 12, 6, 14, 1, 9, 3, 11, 5, 13, 7, 15]
  want = np.asarray(x, np.float32)[:, [16 * c + j for c in range(3) for j in block]]
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(np.asarray(w4_gluon_mm.x_in_nibble_pair_order(jnp.asarray(got, jnp.bfloat16))),
                                np.asarray(x))


@pytest.mark.parametrize("order", ["standard", "decode"])
def test_dx_decode_ptx_by_codebook(order):
  """The dx build's PTX: for code bytes (n, r), (n + 1, r), (n + 8, r), (n + 9, r) and their four E4M3 scales, register
  ``$0`` holds K row 2 r (low nibbles) of columns (n, n + 1), ``$1`` of (n + 8, n + 9), ``$2, $3`` K row 2 r + 1
  (high nibbles), each half ``E2M1[code] * its column's scale * 2**-8`` exactly, for every code; the decode-order
  PTX gives the same registers from ``nvfp4.to_decode_order``'s bytes."""
  rng = np.random.default_rng(5)
  asm = w4_gluon_mm._asm_dx(decode_order=order == "decode")
  codebook = np.asarray(nvfp4.E2M1_CODEBOOK, np.float64)

  def to_decode(pair16):
    word = jnp.asarray(np.array([pair16 | (pair16 << 16)], np.uint32))
    return int(np.asarray(nvfp4.permute_word_bits(word, nvfp4.DECODE_ORDER_BITS))[0]) & 0xFFFF

  for trial in range(512):
    code_bytes = (np.array([(trial * 17 + 16 * i + i) % 256 for i in range(4)]) if trial < 256
                  else rng.integers(0, 256, size=4))
    scale = rng.choice([2.0 ** -9, 0.0625, 0.75, 13.0, 448.0], size=4).astype(ml_dtypes.float8_e4m3fn)
    sb = scale.view(np.uint8).astype(int)
    pairs = [int(code_bytes[0]) | (int(code_bytes[1]) << 8), int(code_bytes[2]) | (int(code_bytes[3]) << 8)]
    if order == "decode":
      pairs = [to_decode(p) for p in pairs]
    regs = _run_ptx(asm, {"$4": pairs[0] | (pairs[1] << 16),
                          "$5": int(sb[0] | (sb[1] << 8) | (sb[2] << 16) | (sb[3] << 24))})
    for reg, (cols, nib) in enumerate((((0, 1), 0), ((2, 3), 0), ((0, 1), 1), ((2, 3), 1))):
      v = regs[f"${reg}"]
      got = np.array([v & 0xFFFF, v >> 16], np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
      codes = [(int(code_bytes[c]) >> (4 * nib)) & 15 for c in cols]
      want = codebook[codes] * scale[list(cols)].astype(np.float64) * 2.0 ** -8
      np.testing.assert_array_equal(got, want, err_msg=f"{order} bytes {code_bytes} register {reg}")


def test_mm_kernel_not_applied_off_gpu():
  """Without an sm_90 GPU the kernel never applies (the library keeps dequantize + cuBLAS)."""
  if w4_gluon._wgmma_gpus() and w4_gluon._gpu_devices():
    pytest.skip("an sm_90 GPU is present")
  assert not w4_gluon_mm.applies(2048, _weight(128, 128, 0), jnp.bfloat16)
  with pytest.raises(ValueError, match="no kernel"):
    w4_gluon_mm.forward(jnp.zeros((4, 128), jnp.bfloat16), _weight(128, 128, 0))


def test_mm_shape_rules(monkeypatch):
  """K a multiple of 64, N of 128, bf16 x, NVFP4 weights only (with the GPU checks faked true)."""
  monkeypatch.setattr(w4_gluon, "_gpu_devices", lambda: [object()])
  monkeypatch.setattr(w4_gluon, "_wgmma_gpus", lambda: True)
  monkeypatch.setattr(w4_gluon, "available", lambda: True)
  monkeypatch.setattr(w4_gluon, "launcher", lambda: "ffi")
  assert w4_gluon_mm.applies(3000, _weight(192, 384, 0), jnp.bfloat16)
  assert not w4_gluon_mm.applies(3000, _weight(192, 384, 0), jnp.float32)
  assert not w4_gluon_mm.applies(3000, _weight(160, 384, 0), jnp.bfloat16)  # K % 64
  assert not w4_gluon_mm.applies(3000, _weight(192, 320, 0), jnp.bfloat16)  # N % 128
  assert not w4_gluon_mm.applies(0, _weight(192, 384, 0), jnp.bfloat16)


def test_mm_grouped_raster_covers_every_tile_once():
  """The grouped walk (RASTER_GROUP) visits every (row tile, column tile) once, by hand for 5 row tiles x 2 column
  tiles in groups of 2: rows 0-1 over both columns, then rows 2-3, then the last group of one row."""
  walk = [w4_gluon_mm.whole_tile(t, 5, 2, 2) for t in range(10)]
  assert walk == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1), (4, 0), (4, 1)]
  assert [w4_gluon_mm.whole_tile(t, 5, 2, 0) for t in range(3)] == [(0, 0), (1, 0), (2, 0)]
  for rows, cols, group in ((32, 36, 12), (8, 28, 3), (7, 5, 7)):
    seen = {w4_gluon_mm.whole_tile(t, rows, cols, group) for t in range(rows * cols)}
    assert seen == {(r, c) for r in range(rows) for c in range(cols)}


def test_mm_settings_are_checked(monkeypatch):
  """Ring, in-flight and raster settings the kernel cannot take are refused by name before a launch is built."""
  assert w4_gluon_mm.meta_for(2048, 3584, 4608, 1)["S"] == w4_gluon_mm.STAGES
  for name, bad in (("STAGES", 1), ("SMALL_STAGES", 1), ("IN_FLIGHT", 2), ("RASTER_GROUP", -1),
                    ("NARROW_PER_SM", 3), ("WAIT_SYNC", 2), ("WARPGROUP_RELEASE", 2), ("PREFETCH_CODES", 2),
                    ("TAIL_MEMSET", 2), ("SMALL_WEIGHT_ROWS", 96)):
    with monkeypatch.context() as mp:
      mp.setattr(w4_gluon_mm, name, bad)
      with pytest.raises(ValueError, match=name):
        w4_gluon_mm.meta_for(2048, 3584, 4608, 1)


def test_mm_two_narrow_programs_an_sm(monkeypatch):
  """NARROW_PER_SM = 2 (lab) doubles the persistent grid of the 64-row tiles only, halves their ring, and caps the
  registers so that two programs of 384 threads share an SM's 65536: 7B gate/up at M = 64 has 296 tiles, so 264
  programs on 132 SMs; M = 100 (128-row tiles) and M = 2048 keep one program an SM."""
  monkeypatch.setattr(w4_gluon_mm, "_sm_count", lambda: 132)
  monkeypatch.setattr(w4_gluon_mm, "MAX_SPLITS", 1)
  monkeypatch.setattr(w4_gluon_mm, "SMALL_M_MAX", 128)
  monkeypatch.setattr(w4_gluon_mm, "NARROW_PER_SM", 2)
  meta = w4_gluon_mm.meta_for(64, 3584, 37888, 1)
  assert (meta["NP"], meta["S"], meta["PP"]) == (264, w4_gluon_mm.SMALL_STAGES // 2, 2)
  assert w4_gluon_mm._regs(meta["PP"]) == 80 and w4_gluon_mm._regs() == 168  # 65536 / 768, / 384, to 8
  for m in (100, 2048):
    meta = w4_gluon_mm.meta_for(m, 3584, 37888, 1)
    assert (meta["NP"], meta["PP"]) == (132, 1)


def test_mm_paired_decode_by_tile_for_decode_order_codes(monkeypatch):
  """Decode-order codes in the forward take the paired decode where sessions 53-55 measured it faster: the wide tiles (M
  > 128; with the lab's NARROW_SMALL_WIDE_MAX_M small weights M > 256) repaired in registers (DV 5, WIDE_DECODE), the
  narrow ones repaired too for weights of at most NARROW_REPAIR_MAX_N columns (the 7B q/k/v, 4608) and with x permuted
  (DV 4, NARROW_DECODE) for wider ones (the 7B gate/up, 37888). Standard-order codes and the dx build keep DECODE (2);
  the settings switch each tile's form, DECODE = 4 or 5 (lab) forces one at every M, and values outside the forms are
  refused by name."""
  monkeypatch.setattr(w4_gluon_mm, "_sm_count", lambda: 132)
  dv = lambda m, order=True, dx=False, n=4608: w4_gluon_mm.meta_for(m, 3584, n, 1, decode_order=order, dx=dx)["DV"]
  assert w4_gluon_mm.NARROW_REPAIR_MAX_N == 8192
  assert [dv(m) for m in (1, 64, 100, 128, 129, 2048)] == [5, 5, 5, 5, 5, 5]
  assert [dv(m, n=37888) for m in (1, 64, 128, 129, 2048)] == [4, 4, 4, 5, 5]
  assert [dv(64, n=n) for n in (8192, 8448)] == [5, 4]  # at most NARROW_REPAIR_MAX_N columns
  assert (dv(64, order=False), dv(2048, order=False), dv(64, dx=True), dv(2048, dx=True)) == (2, 2, 2, 2)
  with monkeypatch.context() as mp:  # 0: every narrow tile takes NARROW_DECODE
    mp.setattr(w4_gluon_mm, "NARROW_REPAIR_MAX_N", 0)
    assert [dv(m) for m in (64, 128, 129, 2048)] == [4, 4, 5, 5]
    mp.setattr(w4_gluon_mm, "NARROW_SMALL_WIDE_MAX_M", 256)  # lab: q/k/v's narrow tile to 256 rows
    assert [dv(m) for m in (129, 256, 257)] == [4, 4, 5]
    assert w4_gluon_mm.meta_for(64, 3584, 4608, 1, decode_order=False)["DV"] == 2  # standard order: unpaired
  monkeypatch.setattr(w4_gluon_mm, "NARROW_REPAIR_MAX_N", 0)
  monkeypatch.setattr(w4_gluon_mm, "NARROW_DECODE", 5)
  monkeypatch.setattr(w4_gluon_mm, "WIDE_DECODE", 2)
  assert [dv(m) for m in (64, 2048)] == [5, 2]
  monkeypatch.setattr(w4_gluon_mm, "DECODE", 4)
  assert [dv(m) for m in (64, 2048)] == [4, 4]
  for name, bad in (("NARROW_DECODE", 1), ("WIDE_DECODE", 6), ("DECODE", 0), ("NARROW_REPAIR_MAX_N", -1)):
    with monkeypatch.context() as mp:
      mp.setattr(w4_gluon_mm, name, bad)
      with pytest.raises(ValueError, match=name):
        dv(64)


@pytest.mark.parametrize("narrow,repair_max_n", [(4, 0), (5, 0), (4, 8192)])
def test_mm_paired_decode_lowers_with_x_permuted_only_in_its_form_4(narrow, repair_max_n, monkeypatch):
  """A decode-order layer lowers with the paired decode's PTX (its one-mask register, 0x81C081C0) at M = 64 and
  2048; the repair's re-pairing prmts where the form is 5 (the wide tiles', and the narrow ones' under
  NARROW_DECODE = 5 or for a weight of at most NARROW_REPAIR_MAX_N columns, 4608 here), x's K permutation ahead of
  the launch (shifts of x as uint32 in the HLO) where it is 4."""
  _fake_sm90(monkeypatch)
  monkeypatch.setattr(w4_gluon_mm, "MAX_SPLITS", 1)
  monkeypatch.setattr(w4_gluon_mm, "NARROW_DECODE", narrow)
  monkeypatch.setattr(w4_gluon_mm, "NARROW_REPAIR_MAX_N", repair_max_n)
  k, n, stack = _abstract_stack("decode")
  assert n == 4608
  for m, form in ((64, 5 if repair_max_n else narrow), (2048, 5)):
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    text = jax.jit(lambda x, w, i: w4_gluon_mm.forward(x, w, index=i)).trace(
        x, stack, jax.ShapeDtypeStruct((), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "0x81C081C0" in text, m
    assert ("prmt.b32 t, a, b, 0x7632" in text) == (form == 5), m
    assert ("stablehlo.shift_left" in text and "xui32" in text) == (form == 4), m


_PTX_STEP = """\
\tbar.sync \t0, 256;
\t// begin inline asm
\t{
\t.reg .pred complete;
\twaitLoop:
\tmbarrier.try_wait.parity.shared.b64 complete, [%r172], %r173;
\t@!complete bra.uni waitLoop;
\t}
\tldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r1, %r2, %r3, %r4}, [%r9];
\tbar.sync \t0, 256;
\t.loc\t1 507 22
\t@%p19 mbarrier.arrive.shared::cta.b64 _, [%r171];
\tbar.sync \t0, 256;
$L__BB0_20:
\t.loc\t1 464 33
\tmbarrier.try_wait.parity.shared.b64 complete, [%r180], %r181;
\tbar.sync \t0, 128;
\tmbarrier.try_wait.parity.shared.b64 complete, [%r190], %r191;
\tbar.sync \t0, 256;
\tst.shared.b32 [%r5], %r6;
"""


def test_mm_wait_sync_drops_only_the_barriers_before_waits():
  """WAIT_SYNC = 0 rewrites the PTX by hand-checked rules: of the five barriers above, the 8-warp ones whose next
  instruction (past comments, braces, .reg, .loc and labels) is an mbarrier wait go (two); the one before the release
  (mbarrier.arrive), the 4-warp one and the one before a shared store stay; every other line is kept in order."""
  got, dropped = w4_gluon_mm.without_wait_barriers(_PTX_STEP)
  assert dropped == 2
  lines = _PTX_STEP.split("\n")
  expected = [l for i, l in enumerate(lines) if i not in (0, 12)]
  assert got.split("\n") == expected
  assert got.count("bar.sync") == 3 and "bar.sync \t0, 128;" in got
  assert w4_gluon_mm.without_wait_barriers(got) == (got, 0)


_PTX_RELEASES = """\
\tand.b32 \t%r9, %r1, 255;
\tsetp.eq.b32 \t%p17, %r9, 0;
\tbar.sync \t0, 256;
\tand.pred \t%p19, %p17, %p20;
\t// begin inline asm
\t@%p19 mbarrier.arrive.shared::cta.b64 _, [%r171];
\t// end inline asm
\tbar.sync \t0, 256;
\tmbarrier.try_wait.parity.shared.b64 complete, [%r172], %r173;
\tbar.sync \t0, 256;
\t@%p17 mbarrier.arrive.shared::cta.b64 _, [%r198];
\tbar.sync \t0, 256;
\tmov.b32 \t%r327, global_smem;
\tadd.s32 \t%r262, %r327, 149688;
\t@%p17 mbarrier.arrive.shared::cta.b64 _, [%r262];
\tbar.sync \t0, 256;
\tmov.pred \t%p10, 0;
\t@%p10 mbarrier.arrive.shared::cta.b64 _, [%r170];
\t@%p4 mbarrier.arrive.expect_tx.shared.b64 _, [%r34], 12800;"""


def _wg_arrive(bar, caller=None):
  return ("\t{\n\t.reg .pred wg_lead;\n\t.reg .b32 wg_tid;\n\tmov.u32 \twg_tid, %tid.x;\n\tand.b32 \twg_tid, wg_tid, 127;\n"
          "\tsetp.eq.b32 \twg_lead, wg_tid, 0;" + (f"\n\tand.pred \twg_lead, wg_lead, {caller};" if caller else "") +
          f"\n\t@wg_lead mbarrier.arrive.shared::cta.b64 _, [{bar}];\n\t}}")


def test_mm_warpgroup_release_rewrites_each_release_by_hand():
  """WARPGROUP_RELEASE = 1 rewrites the PTX by hand-checked rules: the three releases (a barrier across the 8
  MMA warps, then an arrive by thread 0: once under the caller's predicate %p20, once after address arithmetic) become
  arrives by each warpgroup's first thread ((tid & 127) == 0) under the same caller's predicate, their barriers gone;
  a release whose predicate is a constant false (a one-step split unit's) only loses its barrier; the barrier before
  the wait and the producer's expect_tx arrive stay. An arrive with no barrier before it, or a thread-0 predicate of
  another form, is refused rather than rewritten wrong."""
  got, n = w4_gluon_mm.warpgroup_releases(_PTX_RELEASES)
  lines = _PTX_RELEASES.split("\n")
  expected = list(lines)
  expected[2] = expected[9] = expected[11] = expected[15] = ""
  expected[5] = _wg_arrive("%r171", "%p20")
  expected[10] = _wg_arrive("%r198")
  expected[14] = _wg_arrive("%r262")
  assert n == 4 and got.split("\n") == "\n".join(expected).split("\n")
  with pytest.raises(RuntimeError, match="without the barrier"):
    w4_gluon_mm.warpgroup_releases(_PTX_RELEASES.replace("\tbar.sync \t0, 256;\n\t@%p17", "\t@%p17"))
  with pytest.raises(RuntimeError, match="unknown form"):
    w4_gluon_mm.warpgroup_releases(_PTX_RELEASES.replace("%r1, 255;", "%r1, 127;"))


def test_mm_wait_sync_rewrites_the_narrow_build_offline():
  """The 64-row build of the 7B gate/up (no GPU: triton.compile for sm_90) under WAIT_SYNC = 0 loses the MMA warps'
  barrier before each of its two ready waits in the whole-tile loop and the two in the tail loop (4), keeps one before
  every mbarrier.arrive, and still assembles (ptxas, where the triton wheel ships it); with WARPGROUP_RELEASE 1 as
  well it keeps none in its loops."""
  pytest.importorskip("triton")
  import os
  import re
  import subprocess
  import tempfile
  import triton
  meta = {**w4_gluon_mm.meta_for(64, 3584, 37888, 2), "WS": 1, "WR": 0}  # Triton's PTX as it comes
  assert meta["BM"] == 64
  compiled = w4_gluon_mm.compile_for(meta)
  assert w4_gluon_mm.ptx_for(compiled, meta) == compiled.asm["ptx"]
  ptx = w4_gluon_mm.ptx_for(compiled, {**meta, "WS": 0})
  before = compiled.asm["ptx"].count("bar.sync \t0, 256;")
  assert ptx.count("bar.sync \t0, 256;") == before - 4
  code = [l.strip() for l in ptx.split("\n") if l.strip() and not l.strip().startswith(("//", ".loc"))]
  for i, line in enumerate(code):
    if line.startswith("mbarrier.try_wait"):
      assert not code[i - 4].startswith("bar.sync"), code[i - 4:i + 1]  # ({ .reg waitLoop: between)
    if re.search(r"mbarrier\.arrive\.shared", line):
      assert code[i - 1].startswith("bar.sync") or code[i - 2].startswith("bar.sync"), code[i - 2:i + 1]
  # WARPGROUP_RELEASE 1 too: the 8 empty barriers count 2, the 6 releases are arrives of each warpgroup, and
  # of the 17 barriers only the 7 before the barriers' init remain
  wr = {**meta, "WS": 0, "WR": 1}
  both = w4_gluon_mm.compile_for(wr)
  assert both.asm["ptx"].count("], 2;") == 8 and compiled.asm["ptx"].count("], 2;") == 0
  ptx_wr = w4_gluon_mm.ptx_for(both, wr)
  assert ptx_wr.count("@wg_lead mbarrier.arrive") == 6 and ptx_wr.count("bar.sync \t0, 256;") == before - 10
  # a 256-row build with split units (20 steps in 5 of 4), one of whose releases follows
  # address arithmetic: its 4 stages leave the 3 barriers before their inits (the first init needs none)
  wide = {**w4_gluon_mm.meta_for(2000, 1280, 3840, 1, plan=w4_gluon_mm.Plan(128, 5)), "WS": 0, "WR": 1}
  ptx_wide = w4_gluon_mm.ptx_for(w4_gluon_mm.compile_for(wide), wide)
  assert ptx_wide.count("bar.sync \t0, 256;") == 3 and ptx_wide.count("@wg_lead mbarrier.arrive") == 6
  ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
  if os.path.exists(ptxas):
    with tempfile.TemporaryDirectory() as d:
      for text in (ptx, ptx_wr):
        open(os.path.join(d, "k.ptx"), "w").write(text)
        run = subprocess.run([ptxas, "-arch=sm_90a", os.path.join(d, "k.ptx"), "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr


def test_mm_prefetch_codes_only_on_narrow_forward_tiles(monkeypatch):
  """PREFETCH_CODES (lab; the kernel's PF) applies to the narrow tiles' forward with IN_FLIGHT 1 and a 16-bit decode:
  M = 64 and 128, either code order; not the 256-row tile (M = 2048), the dx build, release pairs, IN_FLIGHT 0,
  DECODE 1 or the no-decode probe."""
  monkeypatch.setattr(w4_gluon_mm, "_sm_count", lambda: 132)
  monkeypatch.setattr(w4_gluon_mm, "SMALL_M_MAX", 128)
  meta = w4_gluon_mm.meta_for
  assert meta(64, 3584, 4608, 1)["PF"] == 0
  monkeypatch.setattr(w4_gluon_mm, "PREFETCH_CODES", 1)
  assert meta(64, 3584, 4608, 1)["PF"] == 1 and meta(128, 3584, 4608, 1, decode_order=True)["PF"] == 1
  assert meta(2048, 3584, 4608, 1)["PF"] == 0 and meta(64, 4608, 3584, 1, dx=True)["PF"] == 0
  for name, value in (("IN_FLIGHT", 0), ("DECODE", 1), ("PROBE", 1), ("RELEASE_PAIRS", 1)):
    with monkeypatch.context() as mp:
      mp.setattr(w4_gluon_mm, name, value)
      assert meta(64, 3584, 4608, 1, plan=w4_gluon_mm.Plan(36, 1))["PF"] == 0, name


def test_mm_release_pairs_only_where_every_unit_is_even(monkeypatch):
  """RELEASE_PAIRS (lab) builds the kernel's IF 2 only with IN_FLIGHT 1, an even ring and even steps in every unit:
  7B q/k/v (56 steps) whole or in 4 splits of 14; not in 8 splits of 7, nor at K = 192 (3 steps), nor with
  IN_FLIGHT 0."""
  monkeypatch.setattr(w4_gluon_mm, "_sm_count", lambda: 132)
  monkeypatch.setattr(w4_gluon_mm, "RELEASE_PAIRS", 1)
  meta, Plan = w4_gluon_mm.meta_for, w4_gluon_mm.Plan
  assert meta(2048, 3584, 4608, 1, plan=Plan(288, 1))["IF"] == 2
  assert meta(2048, 3584, 4608, 1, plan=Plan(264, 4))["IF"] == 2
  assert meta(2048, 3584, 4608, 1, plan=Plan(264, 8))["IF"] == 1
  assert meta(300, 192, 384, 1, plan=Plan(6, 1))["IF"] == 1
  monkeypatch.setattr(w4_gluon_mm, "IN_FLIGHT", 0)
  assert meta(2048, 3584, 4608, 1, plan=Plan(288, 1))["IF"] == 0


def test_mm_split_k_rules(monkeypatch):
  """The split plan by the cost model, worked by hand (132 SMs, STEP_US 0.69, HBM_TBPS 3.0).

  7B down at M = 256: 28 tiles of 296 steps, no whole round. Unsplit: 296 steps = 204.2 us. Every tile in 4 splits:
  112 units, one a program, 74 steps = 51.06 us plus 256 x 3584 x (4 x 6 + 2) bytes at 3 TB/s = 7.95: 59.01. In 8:
  224 units, 2 x 37 steps = 51.06 plus 12.85. In 2: 102.1 plus 5.5. So (0 whole tiles, 4 splits).

  7B q/k/v at M = 2048: 8 row tiles x 36 = 288 tiles. Unsplit: 3 tiles on 24 programs, 168 steps = 115.9 us. Two
  whole rounds (264 tiles, whole columns: 33 x 8) and the last 24 tiles in 4 splits: 2 x 56 + 14 = 126 steps = 86.94
  plus the tail's 384 columns, 2048 x 384 x 26 bytes = 6.82: 93.76. In 8 splits: 126 steps plus 11.01; in 2: 140 steps
  plus 4.72; in 7: 128 steps plus 9.96. So (264, 4).

  MAX_SPLITS is 8 by default; 1, or a fixed summation order, keeps every tile whole."""
  import os
  Plan = w4_gluon_mm.Plan
  if "QERL_GLUON_MM_MAX_SPLITS" not in os.environ:
    assert w4_gluon_mm.MAX_SPLITS == 8
  monkeypatch.setattr(w4_gluon_mm, "MAX_SPLITS", 1)
  assert w4_gluon_mm.plan_for(256, 18944, 3584, sms=132) == Plan(28, 1)
  monkeypatch.setattr(w4_gluon_mm, "MAX_SPLITS", 8)
  monkeypatch.delenv("QERL_GLUON_DETERMINISTIC", raising=False)
  monkeypatch.setenv("XLA_FLAGS", "")
  assert w4_gluon_mm.plan_for(256, 18944, 3584, sms=132) == Plan(0, 4)
  assert w4_gluon_mm.predicted_us(256, 18944, 3584, sms=132)[0] == pytest.approx(59.01, abs=0.01)
  assert w4_gluon_mm.plan_for(2048, 3584, 4608, sms=132) == Plan(264, 4)
  assert w4_gluon_mm.predicted_us(2048, 3584, 4608, sms=132)[0] == pytest.approx(93.76, abs=0.01)
  assert w4_gluon_mm._plan_us(2048, 3584, 4608, Plan(288, 1), 132) == pytest.approx(115.92, abs=0.01)
  monkeypatch.setenv("QERL_GLUON_DETERMINISTIC", "1")
  assert w4_gluon_mm.plan_for(256, 18944, 3584, sms=132) == Plan(28, 1)
  monkeypatch.setattr(w4_gluon_mm, "MAX_SPLITS", 0)
  with pytest.raises(ValueError, match="MAX_SPLITS"):
    w4_gluon_mm.plan_for(256, 18944, 3584)
  monkeypatch.setattr(w4_gluon_mm, "MAX_SPLITS", 1)
  with pytest.raises(ValueError, match="plan"):  # 3 does not divide the 56 steps of K = 3584
    w4_gluon_mm.meta_for(256, 3584, 4608, 1, plan=Plan(0, 3))
  with pytest.raises(ValueError, match="plan"):  # whole tiles not whole columns (8 row tiles)
    w4_gluon_mm.meta_for(2048, 3584, 4608, 1, plan=Plan(12, 4))


# ----------------------------------------------------------------------------- GPU


def _skip_without_kernel():
  if not (w4_gluon._gpu_devices() and w4_gluon._wgmma_gpus() and w4_gluon.available()
          and w4_gluon.launcher() == "ffi"):
    pytest.skip("the large-M forward kernel needs an sm_90 GPU and the FFI launcher")


def _check_written(got, want, shape):
  """``got`` (bf16) has ``shape``, is finite and matches float64 ``want`` at bf16 rounding over the whole output and
  in every row and every column (a row of x or a column of W left unwritten or misplaced shows there)."""
  assert got.shape == shape and got.dtype == jnp.bfloat16 and bool(jnp.isfinite(got).all())
  assert _rel(got, want) < 4e-3
  g = np.asarray(got, np.float64)
  for axis in (0, 1):
    err = np.linalg.norm(g - want, axis=1 - axis) / np.linalg.norm(want, axis=1 - axis)
    assert err.max() < 1e-2


def _check_forward_order_addend(m, k, n, order, addend, w_seed, x_seed):
  """``w4_gluon_mm.forward`` of fresh x ``[m, k]`` (seed ``m + x_seed``), an NVFP4 ``[k, n]`` (seed ``m + w_seed``) in
  code ``order`` and, with ``addend``, a bf16 addend (seed ``m + x_seed + 1``), against float64, under the settings
  the caller patched."""
  wq = _weight(k, n, m + w_seed)
  w = nvfp4.to_decode_order(wq) if order == "decode" else wq
  x = jnp.asarray(np.random.default_rng(m + x_seed).standard_normal((m, k)) * 2.0, jnp.bfloat16)
  c = (jnp.asarray(np.random.default_rng(m + x_seed + 1).standard_normal((m, n)), jnp.bfloat16) if addend
       else None)
  got = jax.jit(lambda x, w, c: w4_gluon_mm.forward(x, w, addend=c))(x, w, c)
  ref = np.asarray(x, np.float64) @ _dense64(wq) + (np.asarray(c, np.float64) if addend else 0.0)
  _check_written(got, ref, (m, n))


def _check_forward(m, k, n, seed):
  """``w4_gluon_mm.forward`` of fresh x ``[m, k]`` and an NVFP4 ``[k, n]`` (seeded by ``seed``) against float64,
  under the settings the caller patched."""
  _check_forward_order_addend(m, k, n, "standard", False, seed, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("in_flight", [0, 1])
@pytest.mark.parametrize("m,k,n", [
    (2048, 3584, 4608),   # 7B q/k/v
    (300, 18944, 3584),   # 7B down, ragged M (two M tiles, the second with 44 rows)
    (1000, 3584, 3584),   # 7B o
    (257, 1152, 768),     # one row in the last M tile
    (1, 64, 128),         # one program, one step, one row
    (17, 192, 384),       # three column tiles, three steps
    (100, 320, 640),      # a ring of 4 wrapped once (5 steps)
])
def test_gpu_mm_matches_float64(m, k, n, in_flight, monkeypatch):
  """y = x @ W against float64 (bf16 output: relative error at bf16 rounding), every row and column written
  (the output is never pre-filled: an unwritten element would be garbage) and finite."""
  _skip_without_kernel()
  monkeypatch.setattr(w4_gluon_mm, "IN_FLIGHT", in_flight)
  wq = _weight(k, n, m + k)
  x = jnp.asarray(np.random.default_rng(n).standard_normal((m, k)) * 2.0, jnp.bfloat16)
  got = jax.jit(w4_gluon_mm.forward)(x, wq)
  _check_written(got, np.asarray(x, np.float64) @ _dense64(wq), (m, n))


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(300, 1280, 768), (2048, 3584, 4608)])
def test_gpu_mm_adds_an_addend_before_rounding(m, k, n):
  """With an addend the kernel returns bf16(x @ W + addend), the sum in float32 and rounded once: against float64
  at bf16 rounding; a float32 addend is refused by name."""
  _skip_without_kernel()
  wq = _weight(k, n, 3)
  rng = np.random.default_rng(k)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  c = jnp.asarray(rng.standard_normal((m, n)) * 0.5, jnp.bfloat16)
  got = jax.jit(lambda x, w, c: w4_gluon_mm.forward(x, w, addend=c))(x, wq, c)
  want = np.asarray(x, np.float64) @ _dense64(wq) + np.asarray(c, np.float64)
  assert got.dtype == jnp.bfloat16 and _rel(got, want) < 4e-3
  with pytest.raises(ValueError, match="addend"):
    w4_gluon_mm.forward(x, wq, addend=c.astype(jnp.float32))


@pytest.mark.gpu
def test_gpu_mm_reads_a_stacked_layer():
  """With ``index`` the kernel reads that layer of a stack in place (clamped like the other kernels)."""
  _skip_without_kernel()
  wq = _weight(1280, 768, 5, layers=3)
  x = jnp.asarray(np.random.default_rng(6).standard_normal((512, 1280)), jnp.bfloat16)
  f = jax.jit(lambda x, w, i: w4_gluon_mm.forward(x, w, index=i))
  for index, layer in ((0, 0), (2, 2), (5, 2), (-3, 0)):
    want = np.asarray(x, np.float64) @ _dense64(jax.tree.map(lambda a: a[layer], wq))
    assert _rel(f(x, wq, jnp.int32(index)), want) < 4e-3


@pytest.mark.gpu
def test_gpu_mm_reads_a_decode_order_layer():
  """A decode-order stack (the GPU default of the trainer's ``code_order="auto"``), read in place, gives the same
  product as its standard-order values."""
  _skip_without_kernel()
  wq = _weight(1280, 768, 11, layers=3)
  wd = nvfp4.to_decode_order(wq)
  x = jnp.asarray(np.random.default_rng(12).standard_normal((300, 1280)), jnp.bfloat16)
  got = jax.jit(lambda x, w, i: w4_gluon_mm.forward(x, w, index=i))(x, wd, jnp.int32(1))
  want = np.asarray(x, np.float64) @ _dense64(jax.tree.map(lambda a: a[1], wq))
  assert _rel(got, want) < 4e-3


def _fake_sm90(monkeypatch):
  """The GPU checks faked true, so the kernel compiles for sm_90 and its call lowers for CUDA on any machine;
  skips without triton's Gluon or a C++ compiler for the launcher."""
  pytest.importorskip("triton.experimental.gluon")
  monkeypatch.delenv("QERL_GLUON_LAUNCH", raising=False)
  if w4_gluon.launcher() != "ffi":
    pytest.skip("no C++ compiler for the FFI launcher")
  monkeypatch.setattr(w4_gluon, "_gpu_devices", lambda: [object()])
  monkeypatch.setattr(w4_gluon, "_wgmma_gpus", lambda: True)
  monkeypatch.setattr(w4_gluon, "_load", lambda compiled, ptx=None: (
      compiled.asm["ptx"] if ptx is None else ptx, compiled.metadata.name, int(compiled.metadata.shared)))


def _abstract_stack(order):
  """``(k, n, stack)``: a 3-layer NVFP4 stack at the 7B q/k/v shape as abstract values, in ``order``."""
  k, n = 3584, 4608
  stack = jax.eval_shape(lambda: nvfp4.quantize(jnp.ones((3, k, n), jnp.float32)))
  return k, n, jax.eval_shape(nvfp4.to_decode_order, stack) if order == "decode" else stack


@pytest.mark.parametrize("order", ["standard", "decode"])
def test_mm_lowers_for_cuda_without_a_gpu(order, monkeypatch):
  """The call lowers to the FFI launcher with three TMA descriptors in the launcher's extended form (by hand: x
  [2048, 3584] bf16 in boxes of 256 x 64 with the 128-byte swizzle; codes [3 x 1792, 4608] in 32 x 128, swizzled;
  block scales [3 x 224, 4608] in 4 x 128), one program an SM (132 without a device to ask), 384 threads (8 MMA
  warps and the producer's warpgroup), and the PTX of the weight's code order."""
  _fake_sm90(monkeypatch)
  monkeypatch.setattr(w4_gluon_mm, "MAX_SPLITS", 1)  # every tile whole (split-K: the test below)
  k, n, stack = _abstract_stack(order)
  x = jax.ShapeDtypeStruct((2048, k), jnp.bfloat16)
  text = jax.jit(lambda x, w, i: w4_gluon_mm.forward(x, w, index=i)).trace(
      x, stack, jax.ShapeDtypeStruct((), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
  l2 = w4_gluon.TMA_L2_PROMOTION
  spec = [-3, 0, 2048, k, 256, 64, l2, 2, 3, 1, 3 * k // 2, n, 32, 128, l2, 1, 3, 2, 3 * k // 16, n, 4, 128, l2, 1, 0]
  assert "qerl_gluon_launch" in text and ".entry w4a16_mm" in text
  assert f"tma = dense<[{', '.join(map(str, spec))}]> : tensor<25xi64>" in text
  assert "grid_x = 132" in text and "grid_y = 1" in text and "threads = 384" in text
  assert "output_operand_aliases" not in text  # unsplit: no tail columns to zero
  assert "cp.async.bulk.tensor.2d.shared::cluster.global" in text and "wgmma.mma_async" in text
  # the decode-order PTX: the wide tiles' paired decode, repaired in registers (WIDE_DECODE 5)
  assert ("0x81C081C0" in text and "prmt.b32 t, a, b, 0x5410" in text) == (order == "decode")


@pytest.mark.parametrize("tail_memset", [0, 1])
def test_mm_split_k_lowers_for_cuda_without_a_gpu(tail_memset, monkeypatch):
  """Split-K lowers with the tail's float32 columns as the second result (the kernel adds its parts into them with
  float32 atomics), rounded by XLA: every tile split (the 7B q/k/v at M = 256 on the 256-row tile, 36 tiles, 2
  splits: 72 programs, the whole tail) and two whole rounds with a split tail (M = 2048: 264 whole tiles, the last
  384 columns split, written into the output by a dynamic update slice). The tail is zeroed by XLA, a zero operand
  aliased to it, or with TAIL_MEMSET by the launcher (bit 1 of ``zero_results``, the second result; no alias, a
  one-element operand)."""
  _fake_sm90(monkeypatch)
  monkeypatch.delenv("QERL_GLUON_DETERMINISTIC", raising=False)
  monkeypatch.setenv("XLA_FLAGS", "")
  monkeypatch.setattr(w4_gluon_mm, "TAIL_MEMSET", tail_memset)
  monkeypatch.setattr(w4_gluon_mm, "NARROW_SMALL_WIDE_MAX_M", 0)  # M = 256 on the 256-row tile
  k, n, stack = _abstract_stack("standard")
  i = jax.ShapeDtypeStruct((), jnp.int32)
  f = jax.jit(lambda x, w, i, c: w4_gluon_mm.forward(x, w, index=i, addend=c))
  for m, splits, grid, tail_cols in ((256, 2, 72, n), (2048, 4, 132, 384)):
    monkeypatch.setattr(w4_gluon_mm, "MAX_SPLITS", splits)
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    c = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
    out = jax.eval_shape(f, x, stack, i, c)
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    text = f.trace(x, stack, i, c).lower(lowering_platforms=("cuda",)).as_text()
    assert f"grid_x = {grid}" in text and "atom.global.gpu.relaxed.add.v2.f32" in text
    assert f"zero_results = {2 if tail_memset else 0}" in text
    assert ("output_operand_aliases" in text) == (not tail_memset)
    call = next(line for line in text.split("\n") if "qerl_gluon_launch" in line and "stablehlo.custom_call" in line)
    operands, results = call.split("->")
    assert f"tensor<{m}x{tail_cols}xf32>" in results
    assert (f"tensor<{m}x{tail_cols}xf32>" in operands) == (not tail_memset)
    assert ("dynamic_update_slice" in text) == (tail_cols < n)
  monkeypatch.setattr(w4_gluon_mm, "MAX_SPLITS", 1)  # unsplit: nothing to zero, nothing aliased (a new trace)
  g = jax.jit(lambda x, w, i, c: w4_gluon_mm.forward(x, w, index=i, addend=c))
  text = g.trace(x, stack, i, c).lower(lowering_platforms=("cuda",)).as_text()
  assert "zero_results = 0" in text and "output_operand_aliases" not in text


def test_mm_narrow_tile_lowers_for_cuda_without_a_gpu(monkeypatch):
  """With SMALL_M_MAX = 128, M = 100 takes the 128-row tile (x in TMA boxes of 128 x 64, m64 n128 wgmmas) and M = 64
  the 64-row one (64 x 64, m64 n64); the 7B q/k/v (36 column tiles of one row tile) runs 36 programs. M = 129 keeps
  the 256-row tile."""
  _fake_sm90(monkeypatch)
  monkeypatch.setattr(w4_gluon_mm, "SMALL_M_MAX", 128)
  monkeypatch.setattr(w4_gluon_mm, "MAX_SPLITS", 1)  # every tile whole: one program a column tile
  assert [w4_gluon_mm.block_m(m) for m in (1, 64, 65, 128, 129)] == [64, 64, 128, 128, 256]
  k, n, stack = _abstract_stack("standard")
  i = jax.ShapeDtypeStruct((), jnp.int32)
  f = jax.jit(lambda x, w, i: w4_gluon_mm.forward(x, w, index=i))
  l2 = w4_gluon.TMA_L2_PROMOTION
  for m, bm in ((100, 128), (64, 64)):
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    text = f.trace(x, stack, i).lower(lowering_platforms=("cuda",)).as_text()
    assert f"tma = dense<[-3, 0, {m}, {k}, {bm}, 64, {l2}, 2, 3," in text
    assert "grid_x = 36" in text and f"wgmma.mma_async.sync.aligned.m64n{bm}k16" in text
    assert "m64n256k16" not in text


@pytest.mark.parametrize("order", ["standard", "decode"])
def test_dx_build_lowers_for_cuda_without_a_gpu(order, monkeypatch):
  """The dx build's call lowers with its own three TMA specs (by hand: dy [512, 4608] bf16 in boxes of 256 x 64 with
  the 128-byte swizzle; codes [3 x 1792, 4608] in 64 x 64 with the 64-byte swizzle; block scales [3 x 224, 4608] in
  8 x 64), a [512, 3584] result and the dx PTX of the weight's code order."""
  _fake_sm90(monkeypatch)
  k, n, stack = _abstract_stack(order)
  dy = jax.ShapeDtypeStruct((512, n), jnp.bfloat16)
  f = jax.jit(lambda dy, w, i: w4_gluon_mm.dx(dy, w, index=i))
  i = jax.ShapeDtypeStruct((), jnp.int32)
  assert jax.eval_shape(f, dy, stack, i).shape == (512, k)
  text = f.trace(dy, stack, i).lower(lowering_platforms=("cuda",)).as_text()
  l2 = w4_gluon.TMA_L2_PROMOTION
  spec = [-3, 0, 512, n, 256, 64, l2, 2, 3, 1, 3 * k // 2, n, 64, 64, l2, 1, 2, 2, 3 * k // 16, n, 8, 64, l2, 1, 0]
  assert f"tma = dense<[{', '.join(map(str, spec))}]> : tensor<25xi64>" in text
  assert ".entry w4a16_mm" in text and "threads = 384" in text
  assert ("shl.b32 t, u, 22" in text) == (order == "decode")  # _asm_dx(decode_order=True)


def test_dx_build_is_the_default(monkeypatch):
  """kernel_dx takes the dx build by default (GLUON_MM_DX = "1": on the H200 in session 49 it ran the 7B shapes at
  M = 2048 at 0.924x of bf16, dequantize + cuBLAS at 0.851x); a bad value is refused."""
  import os
  from pallas_kernels import matmul
  if "QERL_GLUON_MM_DX" not in os.environ:
    assert matmul.GLUON_MM_DX == "1"
  monkeypatch.setattr(matmul, "GLUON_MM_DX", "2")
  with pytest.raises(ValueError, match="GLUON_MM_DX"):
    matmul.kernel_dx(jnp.zeros((100, 256), jnp.bfloat16), _weight(128, 256, 0), interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(2048, 3584, 4608), (300, 18944, 3584), (257, 1152, 768), (100, 256, 320)])
@pytest.mark.parametrize("order", ["standard", "decode"])
def test_gpu_dx_build_matches_float64(m, k, n, order):
  """dx = dy @ W^T by the dx build against float64 (bf16 output), every row and column written, either code order."""
  _skip_without_kernel()
  wq = _weight(k, n, m + n)
  dy = jnp.asarray(np.random.default_rng(k).standard_normal((m, n)) * 2.0, jnp.bfloat16)
  got = jax.jit(w4_gluon_mm.dx)(dy, nvfp4.to_decode_order(wq) if order == "decode" else wq)
  _check_written(got, np.asarray(dy, np.float64) @ _dense64(wq).T, (m, k))


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,plan", [
    (256, 18944, 3584, (0, 4)),   # 7B down at M = 256: every tile in 4 splits, 112 units
    (300, 3584, 4608, (0, 7)),    # ragged M (2 row tiles), 7 splits of 8 steps
    (17, 192, 384, (0, 3)),       # one step a split
    (2048, 3584, 4608, (264, 4)),  # 7B q/k/v at M = 2048: two whole rounds, the last 3 column tiles split
    (2000, 1280, 3840, (128, 5)),  # ragged, 16 whole column tiles, 14 split ones in the persistent walk
    (300, 1280, 768, (2, 4)),     # one whole column tile of 2 row tiles
])
@pytest.mark.parametrize("order", ["standard", "decode"])
def test_gpu_mm_split_k_matches_float64(m, k, n, plan, order, monkeypatch):
  """Split-K (float32 atomics into zeroed tail columns, rounded by XLA; whole tiles rounded in the kernel) against
  float64, with and without an addend, every row and column written, either code order."""
  _skip_without_kernel()
  monkeypatch.setattr(w4_gluon_mm, "plan_for", lambda *a, **kw: w4_gluon_mm.Plan(*plan))
  wq = _weight(k, n, m + plan[1])
  rng = np.random.default_rng(k + n)
  x = jnp.asarray(rng.standard_normal((m, k)) * 2.0, jnp.bfloat16)
  c = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
  w = nvfp4.to_decode_order(wq) if order == "decode" else wq
  meta = w4_gluon_mm.meta_for(m, k, n, 1)
  assert (meta["FT"], meta["SK"]) == plan
  want = np.asarray(x, np.float64) @ _dense64(wq)
  for addend in (None, c):
    got = jax.jit(lambda x, w, c: w4_gluon_mm.forward(x, w, addend=c))(x, w, addend)
    _check_written(got, want if addend is None else want + np.asarray(c, np.float64), (m, n))


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,plan", [
    (256, 18944, 3584, (0, 4)),    # every tile split: the tail is the whole output
    (2048, 3584, 4608, (264, 4)),  # whole tiles and a split tail (its columns written by a dynamic update slice)
    (128, 3584, 37888, (148, 7)),  # a narrow tile: the 7B gate/up at M = 128, whole tiles and a split tail
    (64, 3584, 3584, (0, 7)),      # a narrow tile: the 7B o at M = 64, every tile split
])
@pytest.mark.parametrize("tail_memset", [1, 0])
def test_gpu_mm_tail_memset_matches_float64(m, k, n, plan, tail_memset, monkeypatch):
  """TAIL_MEMSET 1 (the default) and 0: the launcher zeroes the split-K tail (a memset of the second result), or XLA
  makes it and aliases it to an operand. Against float64 with and without an addend, in decode order, twice in one
  jit (each call must get its own zeroed tail: the second result is not the first call's)."""
  _skip_without_kernel()
  monkeypatch.setattr(w4_gluon_mm, "TAIL_MEMSET", tail_memset)
  monkeypatch.setattr(w4_gluon_mm, "plan_for", lambda *a, **kw: w4_gluon_mm.Plan(*plan))
  meta = w4_gluon_mm.meta_for(m, k, n, 1)
  assert (meta["FT"], meta["SK"]) == plan
  wq = _weight(k, n, m + 11)
  w = nvfp4.to_decode_order(wq)
  rng = np.random.default_rng(m + n)
  x = jnp.asarray(rng.standard_normal((m, k)) * 2.0, jnp.bfloat16)
  c = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
  want = np.asarray(x, np.float64) @ _dense64(wq)
  twice = jax.jit(lambda x, w, c: (w4_gluon_mm.forward(x, w, addend=c), w4_gluon_mm.forward(-x, w, addend=c)))
  for addend in (None, c):
    got, neg = twice(x, w, addend)
    extra = 0.0 if addend is None else np.asarray(c, np.float64)
    _check_written(got, want + extra, (m, n))
    _check_written(neg, -want + extra, (m, n))


def test_mm_small_weights_take_the_narrow_tile_to_256_rows(monkeypatch):
  """Past SMALL_M_MAX (128), with the lab's NARROW_SMALL_WIDE_MAX_M at 256 (0, off, by default) weights of at most
  NARROW_SMALL_WEIGHTS values keep the 128-row tile up to 256 rows: the 7B q/k/v (3584 x 4608, 16.5M values) at M = 256
  lowers with m64 n128 wgmmas in two row tiles (72 programs, every tile whole), the 7B gate/up (3584 x 37888) keeps m64
  n256, and M = 257 or the setting at 0 gives the 256-row tile back."""
  _fake_sm90(monkeypatch)
  monkeypatch.setattr(w4_gluon_mm, "SMALL_M_MAX", 128)
  monkeypatch.setattr(w4_gluon_mm, "NARROW_SMALL_WEIGHTS", 1 << 24)
  monkeypatch.setattr(w4_gluon_mm, "NARROW_SMALL_WIDE_MAX_M", 256)
  monkeypatch.setattr(w4_gluon_mm, "MAX_SPLITS", 1)
  qkv, gate_up = 3584 * 4608, 3584 * 37888
  assert [w4_gluon_mm.block_m(m, qkv) for m in (100, 129, 256, 257)] == [128, 128, 128, 256]
  assert [w4_gluon_mm.block_m(m, gate_up) for m in (100, 129, 256)] == [128, 256, 256]
  assert w4_gluon_mm.block_m(200) == 256  # no weight size given: a large weight
  assert w4_gluon_mm.meta_for(256, 3584, 4608, 1)["BM"] == 128
  assert w4_gluon_mm.meta_for(256, 3584, 4608, 1, dx=True)["BM"] == 128  # the dx build: the same K x N values
  k, n, stack = _abstract_stack("decode")
  i = jax.ShapeDtypeStruct((), jnp.int32)
  f = jax.jit(lambda x, w, i: w4_gluon_mm.forward(x, w, index=i))
  text = f.trace(jax.ShapeDtypeStruct((256, k), jnp.bfloat16), stack, i).lower(lowering_platforms=("cuda",)).as_text()
  assert "grid_x = 72" in text and "wgmma.mma_async.sync.aligned.m64n128k16" in text and "m64n256k16" not in text
  monkeypatch.setattr(w4_gluon_mm, "SMALL_WEIGHT_ROWS", 64)  # lab: 64-row tiles, NARROW_PER_SM programs an SM
  assert [w4_gluon_mm.block_m(m, qkv) for m in (1, 65, 128, 256, 257)] == [64, 64, 64, 64, 256]
  assert w4_gluon_mm.block_m(128, gate_up) == 128
  meta = w4_gluon_mm.meta_for(256, 3584, 4608, 1)
  assert (meta["BM"], meta["PP"]) == (64, w4_gluon_mm.NARROW_PER_SM)
  f = jax.jit(lambda x, w, i: w4_gluon_mm.forward(x, w, index=i))  # a new trace
  text = f.trace(jax.ShapeDtypeStruct((256, k), jnp.bfloat16), stack, i).lower(lowering_platforms=("cuda",)).as_text()
  assert "wgmma.mma_async.sync.aligned.m64n64k16" in text and "m64n128k16" not in text
  monkeypatch.setattr(w4_gluon_mm, "SMALL_WEIGHT_ROWS", 128)
  monkeypatch.setattr(w4_gluon_mm, "NARROW_SMALL_WIDE_MAX_M", 0)
  assert w4_gluon_mm.block_m(256, qkv) == 256 and w4_gluon_mm.meta_for(256, 3584, 4608, 1)["BM"] == 256
  assert w4_gluon_mm.block_m(100, qkv) == 128  # SMALL_M_MAX's narrow tile


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(256, 3584, 4608), (256, 3584, 3584), (200, 1152, 768), (128, 3584, 4608)])
@pytest.mark.parametrize("order", ["standard", "decode"])
@pytest.mark.parametrize("rows", [128, 64])
def test_gpu_small_weight_at_256_rows_matches_float64(m, k, n, order, rows, monkeypatch):
  """Small weights at 64 < M <= 256 on the narrow tiles (the lab's NARROW_SMALL_WIDE_MAX_M; 128 rows, or 64 with its
  SMALL_WEIGHT_ROWS) against float64, forward and dx, either code order, every element written."""
  _skip_without_kernel()
  monkeypatch.setattr(w4_gluon_mm, "NARROW_SMALL_WIDE_MAX_M", 256)
  monkeypatch.setattr(w4_gluon_mm, "SMALL_WEIGHT_ROWS", rows)
  assert w4_gluon_mm.meta_for(m, k, n, 1)["BM"] == rows
  wq = _weight(k, n, m + k)
  w = nvfp4.to_decode_order(wq) if order == "decode" else wq
  rng = np.random.default_rng(n)
  x = jnp.asarray(rng.standard_normal((m, k)) * 2.0, jnp.bfloat16)
  _check_written(jax.jit(w4_gluon_mm.forward)(x, w), np.asarray(x, np.float64) @ _dense64(wq), (m, n))
  dy = jnp.asarray(rng.standard_normal((m, n)) * 2.0, jnp.bfloat16)
  _check_written(jax.jit(w4_gluon_mm.dx)(dy, w), np.asarray(dy, np.float64) @ _dense64(wq).T, (m, k))


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,plan,bm", [(128, 3584, 4608, (36, 1), 128), (65, 1280, 768, (6, 1), 128),
                                           (100, 18944, 3584, (0, 4), 128), (257, 1152, 768, (18, 1), 128),
                                           (257, 1152, 768, (6, 3), 128), (64, 3584, 4608, (36, 1), 64),
                                           (1, 1280, 768, (6, 1), 64), (33, 18944, 3584, (0, 4), 64),
                                           (8, 3584, 37888, (264, 4), 64)])
def test_gpu_mm_narrow_tile_matches_float64(m, k, n, plan, bm, monkeypatch):
  """The narrow tiles (SMALL_M_MAX: 128 rows of x with m64 n128 wgmmas, or 64 with m64 n64 at M <= 64), whole and
  split, against float64; M = 257 takes three row tiles when SMALL_M_MAX covers it (whole, or one whole column tile
  and a split tail)."""
  _skip_without_kernel()
  monkeypatch.setattr(w4_gluon_mm, "SMALL_M_MAX", max(128, m))
  monkeypatch.setattr(w4_gluon_mm, "plan_for", lambda *a, **kw: w4_gluon_mm.Plan(*plan))
  assert w4_gluon_mm.meta_for(m, k, n, 1)["BM"] == bm
  wq = _weight(k, n, m + 7)
  x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)) * 2.0, jnp.bfloat16)
  got = jax.jit(w4_gluon_mm.forward)(x, wq)
  _check_written(got, np.asarray(x, np.float64) @ _dense64(wq), (m, n))


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,plan", [(64, 3584, 4608, (36, 1)), (33, 18944, 3584, (0, 4)),
                                        (8, 3584, 37888, (264, 4))])
def test_gpu_mm_two_narrow_programs_an_sm_match_float64(m, k, n, plan, monkeypatch):
  """Two persistent programs an SM on the 64-row tiles (NARROW_PER_SM, lab), whole and split, against float64."""
  _skip_without_kernel()
  monkeypatch.setattr(w4_gluon_mm, "SMALL_M_MAX", 128)
  monkeypatch.setattr(w4_gluon_mm, "NARROW_PER_SM", 2)
  monkeypatch.setattr(w4_gluon_mm, "plan_for", lambda *a, **kw: w4_gluon_mm.Plan(*plan))
  assert w4_gluon_mm.meta_for(m, k, n, 1)["PP"] == 2
  _check_forward(m, k, n, 11)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,plan", [(2048, 3584, 4608, (264, 4)), (64, 3584, 4608, (36, 1)),
                                        (300, 18944, 3584, (0, 4)), (2000, 1792, 3840, (128, 4))])
def test_gpu_mm_release_pairs_match_float64(m, k, n, plan, monkeypatch):
  """The ring's stages released in pairs (RELEASE_PAIRS, lab; the kernel's IF 2) against float64: whole rounds and a
  split tail, a narrow tile, every tile split, and a plan with odd split units (28 steps in 4 of 7), which keeps
  IF 1."""
  _skip_without_kernel()
  monkeypatch.setattr(w4_gluon_mm, "RELEASE_PAIRS", 1)
  monkeypatch.setattr(w4_gluon_mm, "plan_for", lambda *a, **kw: w4_gluon_mm.Plan(*plan))
  assert w4_gluon_mm.meta_for(m, k, n, 1)["IF"] == (1 if k == 1792 else 2)
  _check_forward(m, k, n, 13)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,plan,pairs,ws,wr", [
    (64, 3584, 4608, (36, 1), 0, 0, 0), (100, 3584, 4608, (36, 1), 1, 0, 0), (2048, 3584, 4608, (264, 4), 0, 0, 0),
    (300, 18944, 3584, (0, 4), 1, 0, 0), (64, 3584, 4608, (36, 1), 0, 1, 1), (64, 3584, 37888, (264, 4), 0, 0, 1),
    (100, 3584, 4608, (36, 1), 1, 0, 1), (2048, 3584, 4608, (264, 4), 0, 0, 1), (2000, 1280, 3840, (128, 5), 0, 0, 1),
    (2000, 1792, 3840, (128, 4), 1, 0, 1), (64, 3584, 4608, (36, 1), 0, 1, 0), (2048, 3584, 4608, (264, 4), 0, 1, 0)])
def test_gpu_mm_ptx_rewrites_match_float64(m, k, n, plan, pairs, ws, wr, monkeypatch):
  """The PTX without the MMA warps' barrier before each ready wait (WAIT_SYNC 0) and/or with each stage released by
  both warpgroups (WARPGROUP_RELEASE 1), or Triton's as it comes (WAIT_SYNC 1, WARPGROUP_RELEASE 0), with the stages
  released one or two at a time, narrow and wide tiles, whole and split (odd split units too), against float64."""
  _skip_without_kernel()
  monkeypatch.setattr(w4_gluon_mm, "SMALL_M_MAX", 128)
  monkeypatch.setattr(w4_gluon_mm, "WAIT_SYNC", ws)
  monkeypatch.setattr(w4_gluon_mm, "WARPGROUP_RELEASE", wr)
  monkeypatch.setattr(w4_gluon_mm, "RELEASE_PAIRS", pairs)
  monkeypatch.setattr(w4_gluon_mm, "plan_for", lambda *a, **kw: w4_gluon_mm.Plan(*plan))
  meta = w4_gluon_mm.meta_for(m, k, n, 1)
  assert (meta["WS"], meta["WR"]) == (ws, wr)
  _check_forward(m, k, n, 17)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,plan,order,addend", [
    (64, 3584, 4608, (36, 1), "decode", False), (100, 3584, 4608, (36, 1), "standard", True),
    (33, 18944, 3584, (0, 4), "decode", False), (17, 192, 384, (0, 3), "standard", False),
    (128, 1344, 768, (0, 3), "decode", True), (1, 256, 128, None, "standard", False)])
def test_gpu_mm_prefetch_codes_match_float64(m, k, n, plan, order, addend, monkeypatch):
  """Codes and block scales loaded a step ahead (PREFETCH_CODES, lab; the kernel's PF) against float64: narrow tiles
  whole and split, units of one step (K = 192 in 3), of 7 (odd: 1344 in 3) and of 74, both code orders, an addend,
  one row."""
  _skip_without_kernel()
  monkeypatch.setattr(w4_gluon_mm, "SMALL_M_MAX", 128)
  monkeypatch.setattr(w4_gluon_mm, "PREFETCH_CODES", 1)
  if plan is not None:
    monkeypatch.setattr(w4_gluon_mm, "plan_for", lambda *a, **kw: w4_gluon_mm.Plan(*plan))
  assert w4_gluon_mm.meta_for(m, k, n, 1)["PF"] == 1
  _check_forward_order_addend(m, k, n, order, addend, 19, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,plan,order,addend", [
    (64, 3584, 4608, (36, 1), "decode", False), (100, 3584, 4608, (36, 1), "decode", True),
    (33, 18944, 3584, (0, 4), "decode", False), (128, 1344, 768, (0, 3), "decode", True),
    (300, 3584, 4608, (0, 7), "decode", False), (2048, 3584, 4608, (264, 4), "decode", True),
    (1, 256, 128, None, "decode", False), (64, 3584, 4608, (36, 1), "standard", False)])
@pytest.mark.parametrize("decode", [4, 5])
def test_gpu_mm_paired_decode_matches_float64(m, k, n, plan, order, addend, decode, monkeypatch):
  """The paired decode at every M (lab: DECODE 4, x permuted to match; 5, repaired in registers) against float64:
  narrow and wide tiles, whole and split, an addend, one row; standard-order codes keep the unpaired decode."""
  _skip_without_kernel()
  monkeypatch.setattr(w4_gluon_mm, "SMALL_M_MAX", 128)
  monkeypatch.setattr(w4_gluon_mm, "DECODE", decode)
  if plan is not None:
    monkeypatch.setattr(w4_gluon_mm, "plan_for", lambda *a, **kw: w4_gluon_mm.Plan(*plan))
  _check_forward_order_addend(m, k, n, order, addend, 23, 6)


@pytest.mark.gpu
@pytest.mark.parametrize("decode", [4, 5])
def test_gpu_mm_paired_decode_reads_a_stacked_layer(decode, monkeypatch):
  """The paired decode (DECODE 4 and 5) on a decode-order stack read in place at a traced layer index."""
  _skip_without_kernel()
  monkeypatch.setattr(w4_gluon_mm, "DECODE", decode)
  wq = _weight(1280, 768, 29, layers=3)
  wd = nvfp4.to_decode_order(wq)
  x = jnp.asarray(np.random.default_rng(30).standard_normal((300, 1280)), jnp.bfloat16)
  got = jax.jit(lambda x, w, i: w4_gluon_mm.forward(x, w, index=i))(x, wd, jnp.int32(2))
  assert _rel(got, np.asarray(x, np.float64) @ _dense64(jax.tree.map(lambda a: a[2], wq))) < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("plan", [(0, 4), (264, 7)])
def test_gpu_dx_build_split_k_matches_float64(plan, monkeypatch):
  """The dx build with split-K (every tile split; two whole rounds and a split tail) against float64."""
  _skip_without_kernel()
  monkeypatch.setattr(w4_gluon_mm, "plan_for", lambda *a, **kw: w4_gluon_mm.Plan(*plan))
  m, k, n = 300, 18944, 3584
  wq = _weight(k, n, 9)
  dy = jnp.asarray(np.random.default_rng(10).standard_normal((m, n)), jnp.bfloat16)
  _check_written(jax.jit(w4_gluon_mm.dx)(dy, wq), np.asarray(dy, np.float64) @ _dense64(wq).T, (m, k))


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,group,plan", [(2048, 1280, 768, 3, None), (1900, 1280, 3840, 4, (88, 5)),
                                              (8192, 3584, 4608, 12, None)])
def test_gpu_mm_grouped_raster_matches_float64(m, k, n, group, plan, monkeypatch):
  """The grouped walk of the whole tiles (RASTER_GROUP; 8 row tiles in groups of 3, 3, 2; ragged with a split tail;
  the 7B q/k/v at M = 8192 in groups of 12) against float64, every row and column written."""
  _skip_without_kernel()
  monkeypatch.setattr(w4_gluon_mm, "RASTER_GROUP", group)
  if plan is not None:
    monkeypatch.setattr(w4_gluon_mm, "plan_for", lambda *a, **kw: w4_gluon_mm.Plan(*plan))
  assert w4_gluon_mm.meta_for(m, k, n, 1)["G"] == group
  wq = _weight(k, n, group)
  x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)), jnp.bfloat16)
  got = jax.jit(w4_gluon_mm.forward)(x, wq)
  _check_written(got, np.asarray(x, np.float64) @ _dense64(wq), (m, n))
