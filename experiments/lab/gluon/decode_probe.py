"""Lab (GPU; LOADS_OFFLINE-style CPU mode for the SASS): what would a decode-friendly code packing gain?

The M <= 16 build spends about three quarters of its instructions on the E2M1 decode (bit placement
from the checkpoint's byte order, about 4.5 integer operations and one bf16 multiply per register of
two weights; docs/benchmarks.md, session 11). A packing made for the decode (as Marlin repacks its
weights) would let most output registers come from one mask, or a shift and a mask, of a code word.
This probe swaps ``w4_gluon._asm`` for such a decode *on the stored bytes as they are*: the same
loads, the same scales, the same MMAs, with the instruction count of that packing, and WRONG values
(timing only; nothing here is checked against a reference). If the probe is not clearly faster than
the library kernel, no repacking of the weights is worth its format change.

Session 16 measured it (docs/benchmarks.md): 12% faster at M = 1 and 8 with 24% fewer instructions.
The column ``decode_order`` times the real thing: the weights converted by ``nvfp4.to_decode_order``
and the library's decode-order build (14% fewer instructions at M = 8; correct values).

  PYTHONPATH=$PWD python3 experiments/lab/gluon/decode_probe.py                  # GPU: time all three
  PROBE_OFFLINE=1 PYTHONPATH=$PWD python3 experiments/lab/gluon/decode_probe.py  # CPU: SASS mix of both
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels import w4_gluon  # noqa: E402
from qerl_jax import nvfp4  # noqa: E402

MS = [int(v) for v in os.environ.get("PROBE_MS", "1,8,16,32,64").split(",")]
LIBRARY_ASM = w4_gluon._asm


def probe_asm(decode_order: bool = False) -> str:
  """The decode of a hypothetical packing: word ``$8`` gives ``$0..$3`` and ``$9`` gives ``$4..$7``; three
  registers of each word by a mask after a shift of 0, 3 or 6 bits (sign to bit 15, magnitude to 6-8
  of each half), the fourth from two shifted pieces; one bf16x2 multiply by the block scale each."""
  lines = ["{", ".reg .b32 m, a, b, nz, s0, s1, s2, s3;", "mov.b32 nz, 0x80008000;"]
  for q in range(4):
    sc = "$10" if q < 2 else "$11"
    lines.append(f"prmt.b32 s{q}, {sc}, {sc}, {'0x1010' if q % 2 == 0 else '0x3232'};")
  for word, first, other in (("$8", 0, "$9"), ("$9", 4, "$8")):
    for q, shift in enumerate((0, 3, 6)):
      lines += [f"shr.b32 m, {word}, {shift};"] if shift else [f"mov.b32 m, {word};"]
      lines += ["and.b32 m, m, 0x81C081C0;", f"fma.rn.bf16x2 ${first + q}, m, s{q}, nz;"]
    lines += [f"shr.b32 a, {word}, 9;", f"shl.b32 b, {other}, 5;", "and.b32 a, a, 0x01C001C0;",
              "and.b32 b, b, 0x80008000;", "or.b32 m, a, b;", f"fma.rn.bf16x2 ${first + 3}, m, s3, nz;"]
  return "\n".join(lines + ["}"])


def use(asm) -> None:
  """Builds from now on use ``asm`` for the decode (the compiled-kernel cache is cleared)."""
  w4_gluon._asm = asm
  w4_gluon._kernel.cache_clear()
  w4_gluon._compiled.cache_clear()


def main():
  shapes = {"7b_qkv": (3584, 4608), "7b_o": (3584, 3584), "7b_gate_up": (3584, 37888), "7b_down": (18944, 3584)}
  if os.environ.get("PROBE_OFFLINE"):
    from offline_compile import compile_for
    from sasstool import sass
    os.makedirs("/tmp/gl", exist_ok=True)
    for tag, asm in (("library", LIBRARY_ASM), ("probe", probe_asm)):
      use(asm)
      for m in MS:
        ck, _, _ = compile_for(m, 3584, 37888, 28)
        sass(ck, f"{tag}_m{m}_gate_up")
    return
  from labcommon import activations, rotating_weights, us_per_call
  totals = {}
  for name, (k, n) in shapes.items():
    _, qs = rotating_weights(k, n)
    for m in MS:
      x = activations(m, k)
      row = {}
      for tag, asm in (("library", LIBRARY_ASM), ("probe", probe_asm), ("decode_order", LIBRARY_ASM)):
        use(asm)
        ws = [nvfp4.to_decode_order(q) for q in qs] if tag == "decode_order" else qs
        row[tag] = us_per_call(lambda x, w: w4_gluon.forward(x, w, out_dtype=jnp.float32), x, ws)
        totals[(m, tag)] = totals.get((m, tag), 0.0) + row[tag]
      gb = k * n * 9 / 16 / 1e3
      print(f"{name:10s} M={m:2d} " + " | ".join(f"{t} {v:6.1f} us ({gb / v:5.0f} GB/s)" for t, v in row.items())
            + f" | probe / library {row['probe'] / row['library']:.3f}"
            + f" | decode_order / library {row['decode_order'] / row['library']:.3f}", flush=True)
  use(LIBRARY_ASM)
  for m in MS:
    lib, pr, do = totals[(m, "library")], totals[(m, "probe")], totals[(m, "decode_order")]
    print(f"summed M={m:2d}: library {lib:6.1f} us, probe {pr:6.1f} us ({pr / lib:.3f}), "
          f"decode_order {do:6.1f} us ({do / lib:.3f})", flush=True)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)


if __name__ == "__main__":
  main()
