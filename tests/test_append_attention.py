"""The Triton decode-attention kernel that a PDL chain launches (pallas_kernels.append_attention): Triton's CPU
interpreter against float64 numpy and XLA's reference, and on a GPU against the reference at Qwen2.5-7B's heads."""

import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import append_attention as aa
from pallas_kernels import decode_attention as da
from tests.test_decode_attention import _append_case, _np_append, _rel

# Cases of the interpreter run: (length, layer, splits, stacked bias, bf16 bias); 200 slots in blocks of 16.
CASES = [(41, 1, None, False, True), (1, 2, 3, False, False), (190, 0, None, True, True), (100, 2, 13, True, False),
         (200, 1, 5, False, True), (17, 0, 1, True, True)]


def _interpreted(tmp_path):
  """Runs the kernel in Triton's interpreter in a subprocess (TRITON_INTERPRET must be set before triton is first
  imported) on _append_case's inputs; returns each case's (out, k cache, v cache, sync) as numpy arrays."""
  pytest.importorskip("torch")
  pytest.importorskip("triton")
  script = textwrap.dedent(f"""
      import json, sys
      import numpy as np, torch, jax.numpy as jnp
      from pallas_kernels import append_attention as aa
      from tests.test_decode_attention import _append_case
      out = {{}}
      for i, (length, layer, splits, stacked, bf16) in enumerate({CASES!r}):
        aa.PREFETCH = i % 3  # every loop form
        c, heads, _, _ = _append_case(length + 100, slots=200)
        c["slot_mask_BxS"] = c["slot_mask_BxS"].at[:, length - 1].set(True)
        bias = c["bias_N"] if bf16 else c["bias_N"].astype(jnp.float32) * 0.5
        if stacked:
          bias = jnp.stack([bias * (j + 1) for j in range(3)])
        t = lambda a: torch.from_numpy(np.asarray(jnp.asarray(a, jnp.float32)))
        kc, vc = t(c["k_LxBxSxKxD"]).to(torch.bfloat16), t(c["v_LxBxSxKxD"]).to(torch.bfloat16)
        o, sync = aa.interpret(t(c["qkv_BxN"]), t(bias).to(torch.bfloat16 if bf16 else torch.float32),
                               t(c["cos_BxR"]), t(c["sin_BxR"]), kc, vc, t(c["slot_mask_BxS"]), layer, length,
                               num_heads=heads, splits=splits, block_s=16)
        for name, a in (("out", o), ("k", kc), ("v", vc), ("sync", sync)):
          np.save("{tmp_path}/%d_%s.npy" % (i, name), a.float().numpy() if a.dtype != torch.int32 else a.numpy())
      """)
  env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  run = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                       timeout=600)
  assert run.returncode == 0, run.stderr[-4000:]
  return [{n: np.load(f"{tmp_path}/{i}_{n}.npy") for n in ("out", "k", "v", "sync")} for i in range(len(CASES))]


def test_interpreted_kernel_matches_float64_and_writes_the_cache_as_xla(tmp_path):
  """Bias (bf16 or float32, one or a stack), bf16 rounding, RoPE, the cache write at slot length - 1, attention over
  1 to 13 splits and their merge by the last program, with every loop form (PREFETCH 0, 1, 2): the output against
  float64 numpy (and XLA's reference), the caches equal to XLA's dynamic-update-slice bit for bit, the counters left
  zero."""
  got = _interpreted(tmp_path)
  for (length, layer, splits, stacked, bf16), g in zip(CASES, got):
    c, heads, pos, inv_freq = _append_case(length + 100, slots=200)
    c["slot_mask_BxS"] = c["slot_mask_BxS"].at[:, length - 1].set(True)
    bias = c["bias_N"] if bf16 else c["bias_N"].astype(jnp.float32) * 0.5
    if stacked:
      bias = jnp.stack([bias * (j + 1) for j in range(3)])
    ref_out, ref_k, ref_v = da.decode_attention_append(**dict(c, bias_N=bias), layer=layer, length=length,
                                                       num_heads=heads, backend="reference")
    np64 = dict(c, bias_N=bias[layer] if stacked else bias)
    want, _, _ = _np_append(np64, heads, pos, inv_freq, layer, length)
    case = (length, layer, splits, stacked, bf16)
    assert np.isfinite(g["out"]).all(), case
    assert _rel(g["out"], want) < 2e-2, case
    assert _rel(g["out"], np.asarray(ref_out, np.float64)) < 1e-2, case
    np.testing.assert_array_equal(g["k"], np.asarray(ref_k, np.float32), err_msg=str(case))
    np.testing.assert_array_equal(g["v"], np.asarray(ref_v, np.float32), err_msg=str(case))
    np.testing.assert_array_equal(g["sync"], np.zeros(6, np.int32))


def test_geometry_matches_the_pallas_kernel_and_rejects_bad_shapes():
  """The splits and chunks are decode_attention_append's (batch 8, 7B heads, 2304 slots: 12 splits of 192 slots,
  query groups of 7 padded to 16 rows); bad head counts and blocks raise."""
  g = aa.geometry(8, 28, 4, 2304)
  assert (g.group, g.group_pad, g.group_rows, g.block_s, g.nsplit, g.chunk, g.parts) == (7, 16, 8, 64, 12, 192, 16)
  assert da._geometry(8, 28, 4, 2304, da.APPEND_BLOCK_S, None, da.APPEND_TARGET_PROGRAMS)[3:] == (12, 192)
  with pytest.raises(ValueError, match="multiple of 4 KV heads"):
    aa.geometry(8, 30, 4, 2304)
  with pytest.raises(ValueError, match="power of 2"):
    aa.geometry(8, 28, 4, 2304, block_s=48)


def test_kernel_compiles_for_sm90_with_and_without_pdl(monkeypatch):
  """The kernel compiles offline for sm_90 (Triton's CPU wheel), and only its PDL build has griddepcontrol."""
  pytest.importorskip("triton")
  from pallas_kernels import w4_gluon
  monkeypatch.setattr(w4_gluon, "_target_cc", lambda: 90)
  monkeypatch.setattr(w4_gluon, "_ffi_library", lambda: None)
  ptxs = []
  for gdc in (0, aa.GDC):
    mt = aa.meta(8, 28, 4, 2304, 128, 28, has_bias=True, bias_stacked=True, skip_past_last=True, gdc=gdc)
    ptx, name, _ = aa.compiled(tuple(mt.items()), "*bf16")
    assert name == "attend_append"
    ptxs.append(ptx)
  assert "griddepcontrol.wait" not in ptxs[0] and "griddepcontrol.wait" in ptxs[1]
  assert "griddepcontrol.launch_dependents" in ptxs[1]


@pytest.mark.gpu
@pytest.mark.parametrize("bias_kind", ["stack_bf16", "none"])
def test_gpu_kernel_matches_reference_at_7b_shape(bias_kind):
  """Qwen2.5-7B's heads (28 q, 4 kv, hd 128), batch 8, 2304 slots, lengths filling 1 to 12 splits, counters carried
  from call to call: the output within bf16 rounding of XLA's reference, the caches equal to it bit for bit."""
  from pallas_kernels import residual_norm
  if not residual_norm.available():
    pytest.skip("needs the Gluon FFI launcher")
  c, heads, _, _ = _append_case(0, layers=3, batch=8, slots=2304, kv_heads=4, group=7, dim=128)
  bias = None if bias_kind == "none" else jnp.stack([c["bias_N"], -c["bias_N"], c["bias_N"] * 0.5])
  sync = da.new_sync(8, 4)
  for length in (1, 65, 257, 1304, 2304):
    args = dict(c, slot_mask_BxS=c["slot_mask_BxS"].at[:, length - 1].set(True), bias_N=bias)
    out, kc, vc, sync = aa.attend_append(args["qkv_BxN"], bias, args["k_LxBxSxKxD"], args["v_LxBxSxKxD"], 2,
                                         args["slot_mask_BxS"], length, args["cos_BxR"], args["sin_BxR"],
                                         num_heads=heads, sync=sync)
    ref, rk, rv = da.decode_attention_append(**args, layer=2, length=length, num_heads=heads, backend="reference")
    assert np.isfinite(np.asarray(out, np.float32)).all(), length
    assert _rel(out, np.asarray(ref, np.float64)) < 1e-2, length
    np.testing.assert_array_equal(np.asarray(sync), np.zeros(32, np.int32))
    for got, want, old, name in ((kc, rk, args["k_LxBxSxKxD"], "k"), (vc, rv, args["v_LxBxSxKxD"], "v")):
      got, want, old = (np.asarray(a, np.float32) for a in (got, want, old))
      # only this step's slot of layer 2 changes, to the reference's values
      other = np.ones(got.shape[:3], bool)
      other[2, :, length - 1] = False
      assert (got[other] == old[other]).all(), (name, length, "slots other than the new one changed")
      np.testing.assert_array_equal(got[2, :, length - 1], want[2, :, length - 1], err_msg=f"{name} {length}")
