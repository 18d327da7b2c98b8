"""Lab (GPU, session 63): pallas_kernels.append_attention against the Pallas kernel and XLA's reference at Qwen2.5-7B's
heads (batch 8, 2304 slots): where the written cache slot and the output differ, for both loop forms.

  PYTHONPATH=$PWD python3 experiments/lab/append_diag.py
"""
import numpy as np

from pallas_kernels import append_attention as aa
from pallas_kernels import decode_attention as da
from tests.test_decode_attention import _append_case

c, heads, _, _ = _append_case(0, layers=3, batch=8, slots=2304, kv_heads=4, group=7, dim=128)
for length in (1, 257, 1304):
  args = dict(c, slot_mask_BxS=c["slot_mask_BxS"].at[:, length - 1].set(True))
  ref = da.decode_attention_append(**args, layer=2, length=length, num_heads=heads, backend="reference")
  pal = da.decode_attention_append(**args, layer=2, length=length, num_heads=heads, backend="pallas",
                                   sync=da.new_sync(8, 4))
  runs = {"reference": ref, "pallas": pal}
  for pf in (1, 0):
    aa.PREFETCH, aa.STAGES = pf, 1 if pf else 2
    runs[f"tl prefetch {pf}"] = aa.attend_append(args["qkv_BxN"], args["bias_N"], args["k_LxBxSxKxD"],
                                                 args["v_LxBxSxKxD"], 2, args["slot_mask_BxS"], length,
                                                 args["cos_BxR"], args["sin_BxR"], num_heads=heads,
                                                 sync=da.new_sync(8, 4))
  r_out = np.asarray(ref[0], np.float64)
  r_k, r_v = (np.asarray(a, np.float32)[2, :, length - 1] for a in ref[1:3])
  for name, run in runs.items():
    out = np.asarray(run[0], np.float64)
    k, v = (np.asarray(a, np.float32) for a in run[1:3])
    changed = int((k != np.asarray(args["k_LxBxSxKxD"], np.float32)).any(axis=(3, 4)).sum())
    dk = np.abs(k[2, :, length - 1] - r_k)
    dv = np.abs(v[2, :, length - 1] - r_v)
    print(f"length {length:5d} {name:14s} out rel {np.linalg.norm(out - r_out) / np.linalg.norm(r_out):.2e}  "
          f"k slot: {int((dk > 0).sum())} differ (max {dk.max():.3g}), v slot: {int((dv > 0).sum())} differ  "
          f"(rows x heads changed in k: {changed})", flush=True)
    if name.startswith("tl") and (dk > 0).any():
      i = tuple(np.argwhere(dk > 0)[0])
      print("   first k difference at (b, kvh, d)", i, "got", k[2, :, length - 1][i], "want", r_k[i],
            "pallas", np.asarray(pal[1], np.float32)[2, :, length - 1][i])
