#!/usr/bin/env bash
# Lab (GPU): the next session's first device calls, batched. Run from the repository root with the
# wheels installed (see docs/benchmarks.md), in separate calls (the per-step timeouts are upper
# bounds; a device command may run 10 minutes at most):
#   STEPS=1,2 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=3 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=4 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=5,6 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=7 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=8 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=9 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=10 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=11 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=12 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=13 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=14 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=15 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=16 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=17 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=20 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=21 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=22 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=23 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=24 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=25 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=26 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=27 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=28 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=30 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=50 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=51 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=52 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=53 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=54 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=55 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=56 bash experiments/lab/gpu_checkpoint.sh   (first CUTLASS_BUILD=1 bash experiments/lab/cutlass_mixed_ceiling.sh here; carry .cutlass)
#   STEPS=57 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=58 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=59 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=60 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=61 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=62 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=63 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=64 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=65 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=66 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=67 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=68 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=69 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=70 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=71 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=72 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=73 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=74 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=75 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=76 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=77 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=78 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=79 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=80 bash experiments/lab/gpu_checkpoint.sh
#   ... (steps 81-88 below)
#   STEPS=89 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=90 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=91 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=81 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=82 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=83 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=84 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=87 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=88 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=97 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=98 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=99 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=100 bash experiments/lab/gpu_checkpoint.sh   (carry .lab: the cubins built offline)
#   STEPS=101 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=102 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=103 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=104 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=105 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=106 bash experiments/lab/gpu_checkpoint.sh
#   STEPS=107 bash experiments/lab/gpu_checkpoint.sh
# 1. every GPU test (`-m gpu`, 10 processes: serially the 512 tests no longer fit 420 s; session 39: 261 s):
#    kernels, the Gluon decode kernel, decode attention, model;
# 2. the Gluon decode kernel against the Pallas kernel and bf16 (experiments/lab/gluon/time_jax.py,
#    M = 1-128), then M = 32 and 64 with QERL_GLUON_DETERMINISTIC=1 (partials instead of atomics), then
#    M = 1-16 with float32 partials in the mma.sync builds (GL_MMA_ATOMIC=0; atomics are the default);
#    this harness runs without the launchers' XLA flags, so its bf16 column is XLA's Triton GEMM;
# 3. issue 6's benchmark as the issue states it (prompt 256, 2048 new tokens, batch 8 and 64; 256 at 1024),
#    bf16 and NVFP4, under the launchers' XLA flags (decode layers unrolled, the default);
# 4. batch 256 again, and batch 64 with the training adapter (LoRA rank 32 + AQN), 1024 new tokens;
# 5. Pallas small-M variants with more stages, fewer registers or more warps (time_occupancy.py;
#    since session 8 this matters only where the Gluon kernel is off: QERL_GLUON=0, or M > 16 off sm_90);
# 6. Nsight Compute on the Pallas kernel (experiments/lab/ncu_small_m.sh; session 7 ran it);
# 7. where a batch-8 decode step's time goes (session 10: 2.80 ms a step, of which the W4A16 kernels take
#    1.65 ms): per-kernel device time with each small XLA kernel's source line (profile_rollout.py with
#    PROFILE_HLO=1; PROFILE_SCAN=1 for the scanned layer loop), NVFP4 and bf16;
# 8. issue 4's own benchmark script at the 7B decode sizes;
# 9. whether the M <= 8 kernel is limited by its weight reads: loads alone on the kernel's grid and
#    addresses, and on tile-contiguous addresses (experiments/lab/gluon/loads_only.py; about a minute;
#    session 12: no, the loads alone reach 3.2 TB/s on gate and down);
# 10. Nsight Compute on the Gluon kernel at M = 64 and 128 (experiments/lab/gluon/ncu_gluon.sh);
# 11. where a batch-64 decode step's time goes, NVFP4 and bf16, with each W4A16 call's time by its
#     position in the layer (session 13: the fused gate/up kernel is 74.0 µs against cuBLAS's 70.8; the
#     isolated 1.18x was on the gate matrix alone).
# 12. the asynchronous wgmma prepared in session 13 (w4_gluon.WG_ASYNC, with the x ring at MB = 64):
#     correctness (the x-ring GPU test covers it), then the lab harness at M = 40 and 64 against the
#     default and the ring alone, and at M = 32 the narrow build (128 columns) with and without it
#     (offline: 112 registers, pipelined), then a batch-64 rollout A/B.
# 13. the split-K program target per shape at M = 1-16: in a batch-8 rollout q/k/v and o stream
#     their 4-bit weight at only 1.3-1.5 TB/s (6.3 and 5.5 µs), with 2 K steps a program (504 and 392
#     programs at TARGET_PROGRAMS = 512); the harness prints each shape, so one run shows whether a
#     smaller target (longer programs) suits the small matrices. (Session 14 ran 12 and 13: neither
#     helped; docs/benchmarks.md "Session 14".)
# 14. (next) the fused decode-attention kernel of session 14 (decode_attention_append): bf16 and NVFP4
#     A/B at batch 8 and 64 (session 14 measured the final version on NVFP4 only; about 6 minutes);
# 15. (next) issue 6's table at 2048 new tokens, batch 8 and 64, with it (about 7 minutes);
# 16. the compiled HLO of a batch-8 decode step, to find what the one `memcpy32_post` a layer
#     (1.3-1.6 µs) copies: its copy instructions are printed and the HLO is kept gzipped. (Session 15
#     ran 15 and 16 (the copy was the q/k/v bias slice, now read in place); 14 not re-run.)
# 17. the decode step's one-buffer-a-layer (decoder.ACCUMULATE_DECODE, session 15: batch 8
#     2.51 -> 2.41 ms, batch 64 5.39 -> 5.43) at batch 16 and 32, with the row limit raised to 64
#     against it off, two alternations (about 4 minutes; session 15 ran one: 2.88 / 2.93 and
#     3.58 / 3.63 ms, hence the limit of 32).
# 18. (session 16, run once, then removed with its setting) the wgmma builds with all of a program's x
#     copied before the loop (no barrier a step): not faster (docs/benchmarks.md, "Session 16").
# 19. (session 16) ejkernel's NVFP4 quantized_matmul as issue 4's peer column (experiments/lab/ejkernel_peer.py;
#     needs .whl-ejk installed into /tmp/site as well).
# 20. (session 16) NVFP4 codes in the decode kernel's order (nvfp4.to_decode_order, a third fewer decode
#     operations): its GPU tests, the kernel harness (experiments/lab/gluon/decode_probe.py: standard order,
#     an instruction-count probe, decode order) and a batch 8 / 64 rollout A/B (bench_rollout --code_order).
# 21. (session 16) issue 6's table (2048 new tokens, batch 8 and 64) with the codes in decode order, and
#     the kernel harness of step 20 alone (about 9 minutes).
# 22. (next) the decode-order dequantize that reads the codes in place (w4_triton.DEQUANT_DECODE_ORDER_IN_PLACE,
#     prepared in session 16, right in interpret mode): its GPU test, then experiments/lab/time_code_order.py
#     with it off (session 16: an M = 2048 forward 20% slower in decode order) and on. If it closes the gap,
#     turn it on and reconsider model.code_order's default (about 3 minutes).
#     (Session 17 ran it: in place the decode order costs the large-M path nothing; on since, and
#     model.code_order defaults to "auto".)
# 23. (next) the opt-in large-M dx kernel (pallas_kernels/w4_gluon_dx.py, session 17: 0.57x / 0.62x of bf16
#     at M = 2048 / 8192, 7B summed): its GPU tests, then experiments/lab/time_dx.py against bf16 and
#     dequantize + cuBLAS with the variants given in DX_VARIANTS (about 3 minutes).
# 24. (session 19) the tests not marked gpu, on the GPU (8 workers: pytest-xdist and execnet wheels in .whl;
#     about 4.5 minutes; session 19 fixed the 63 that failed there), then the gpu-marked nvfp4 test added then.
# 25. (session 19, prepared) the M <= 16 Gluon builds with fewer registers, so that more programs share an SM
#     (w4_gluon.MMA_MAX_REGISTERS: 128 fits 4 programs of 4 warps, 96 fits 5, 80 fits 6; the kernel waits on
#     dependency chains that 4 warps a scheduler do not hide), each also with a split-K target for the
#     larger resident count; lab harness at M = 1 and 8 (about 4 minutes), then a batch-8 rollout A/B.
#     (Session 20 ran 24 as the whole suite in one call (-n 10: 538 passed, 6 minutes) and 25: slower, rejected.)
# 26. (session 20, prepared) the L2::256B code loads (w4_gluon.LOAD_ASM = 2) on the small matrices only (q/k/v and o:
#     LOAD_ASM_MAX_WEIGHTS = 2**25), where the lab harness measured 8.4 -> 7.8 and 7.5 -> 6.9 µs at M = 8; the
#     large ones lost. Batch 8 and 16 rollout A/B, two alternations (about 4 minutes).
# 27. (session 20, prepared) does the access width hold the weight loads at 3.2 TB/s? The loads-only probe with
#     16 bytes a thread and row (w16: a warp instruction reads 4 rows x 128 bytes; w16r: 2 x 256) and 8 bytes in
#     2 rows x 128 (w8r), against the production layout (w8), M = 8 (about a minute). If w16 reaches about
#     4 TB/s, a decode build whose threads own 16 columns is the next kernel to write.
# 28. (session 20, prepared) how much faster the small matrices run from the L2 (LAB_WEIGHT_MB=0: two copies of each
#     weight, which the L2 holds for q/k/v and o): the bound of prefetching o's weight into the L2 while
#     attention runs (HBM is nearly idle then), M = 1 and 8 (about a minute).
# 29. (session 20; removed in session 21 with its settings) an L2 prefetch of o's weight by the q/k/v kernel: step 28
#     bounded it at about 0.2 µs a layer, and its GPU tests failed, so it was dropped unmeasured.
#     (Session 21 ran 26-28: docs/benchmarks.md, "Session 21".)
# 30. (session 21, prepared) a training rollout's x @ A by one Gluon kernel (w4_gluon.LORA_XA = 1, lab: float32
#     partial products that the LoRA epilogue sums; the decoder then keeps the adapters' A stacks whole): the LoRA
#     GPU tests, then LoRA rank 32 + AQN rollouts at batch 8 and 16, off / on / off / on (about 6 minutes).
#     Session 21's profile put x @ A at 4 GEMMs and 4 sums a layer (about 0.5 ms of a 2.80 ms batch-8 step).
#     Then batch 32 with the up-projection in the wgmma builds too (w4_gluon.LORA_IN_KERNEL_WG = 1, lab), against off.
#     (Session 22 ran it: docs/benchmarks.md "Session 22"; both on since.)
# 31. (session 22) SwiGLU in the down kernel's prologue (w4_gluon.SWIGLU_IN_KERNEL, on): every GPU test, a batch-8
#     A/B at 512 new tokens (off / on, two alternations), then issue 6's batch-8 row at 2048 new tokens (about 8 minutes).
#     (Session 22 ran it at 90e6b86: slower, 2.22 / 2.22 against 2.21 / 2.21 ms; the setting, its kernel path and
#     this step's code are removed.)
# 32. (session 22) the decode step without the post-attention optimization barrier (decoder.POST_ATTENTION_BARRIER, lab):
#     batch 8 and 16 at 512 new tokens, on / off, two alternations (about 3 minutes). (Session 22 ran it: without
#     the barrier 2.26 / 2.26 against 2.20 / 2.22 ms at batch 8, 2.74 / 2.75 against 2.68 / 2.68 at 16; the
#     setting is removed.)
# 33. (session 22) the fused residual add + post-attention RMSNorm (pallas_kernels.residual_norm,
#     decoder.FUSED_RESIDUAL_NORM, on): every GPU test, a batch 8 / 16 A/B at 512 new tokens (off / on, two
#     alternations), a batch-8 profile, and issue 6's batch-8 row at 2048 new tokens (about 9 minutes).
#     (Session 22 ran it: the kernel took 2.5-2.6 µs against XLA's norm fusion 1.4-1.8, and XLA then materialized
#     the previous layer's residual as its own add; a batch-8 step 2.24 / 2.26 against 2.21 / 2.22 ms. Removed.)
# 34. (session 22) issue 6's table at batch 8 and 64, 2048 new tokens, with the session's final code (about 5 minutes).
# 35. (session 22) XLA's command buffers for the decode while-loop (--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL;
#     session 13: NVFP4 2.66 -> 2.62 ms, bf16 4.47 -> 4.34 at batch 8, not adopted untested): every GPU test under
#     it, then batch 8 and 64 at 512 new tokens, NVFP4 and bf16, without and with it (about 6 minutes).
#     (Session 22 ran 35: all 181 GPU tests pass under it, both formats faster; in the launchers' flags since.)
# 36. (session 22) the fused layer end (decoder.FUSED_LAYER_END, lab; pallas_kernels/residual_norm.py): the
#     down-projection's residual add, the next input norm (+ AQN noise; the final norm after the last layer) and the
#     next layer's zeroed accumulator in one kernel, where XLA runs a fusion (2.2 µs at batch 8) and the launcher a
#     memset (1.3 µs); and with it decoder.FUSED_POST_ATTENTION (lab), the same kernel for the o residual and the
#     post-attention norm. Their GPU tests, a batch 8 / 16 A/B at 512 new tokens (off / end / end + post, two
#     alternations), and a batch-8 profile with both (about 8 minutes). Session 22's first version (the post-attention boundary, loads after
#     the reduction) took 2.5-2.6 µs; this one issues every load first (offline PTX: no global load after the barrier).
#     (Session 23 ran 36: all GPU tests pass; batch 8 2.17 / 2.17 ms against 2.18 / 2.20 with both, 2.19 / 2.19 with the
#     layer end alone; 2.27 / 2.28 against 2.30 at 2048 tokens. Both on by default since.)
# 37. (session 23, prepared) the residual-norm kernel's launch shape (pallas_kernels.residual_norm; ab_rollout.py
#     RN_SET): it takes 3.4 µs at the layer end, where it also zeroes the next accumulator (1.6 MB at batch 8, 194
#     programs of ZERO_CHUNK = 2048 floats), and 2.8 µs after attention, where it does not; so the zeroing seems to
#     cost 0.6 µs. Variants: ZERO_CHUNK 8192 (49 zeroing programs) and 512 (776), and 8 warps a program. Batch 8 at
#     2048 new tokens, alternating, then a profile of the best. 70% of issue 6's roofline needs 0.25 µs a layer
#     (about 5 minutes). Offline: every variant compiles for sm_90 without spills, all loads before the barrier.
#     Session 24 ran it: the chunk changed nothing, 8 warps took the step 2.279 -> 2.240 ms; 16 (2.226, now the
#     default) and 32 (2.226) were then measured with RN_SET="WARPS=..." (docs/kernels.md).
# 38. (session 24, prepared) training rollouts (LoRA rank 32 on all linears + trained norms + AQN, as the recipes run):
#     (a) the GPU tests of the fused layer end with trained norms (34b08de turned it on there; before, any adapter
#     norm turned it off) and of lora_xa at XA_MAX_PARTS 32 and 64; (b) the layer end's gain on such a rollout
#     (MODEL_SET="FUSED_LAYER_END=0" is the code before 34b08de), batch 8 and 16 at 512 new tokens, alternating;
#     (c) XA_MAX_PARTS=64 against 32: session 24's profile put x @ A at 16.6 µs a layer (down's 7.8 µs from 30
#     programs of 10 K steps; 64 gives 60 programs of 5; offline: no spills in lora_xa or the epilogue at 64);
#     (d) the profile again (about 8 minutes).
#     Session 25 ran it: 21 GPU tests pass; the layer end 2.714 / 2.719 ms a step against 2.745 / 2.753 without it
#     at batch 8 (3.17 against 3.27 at 16); XA_MAX_PARTS=64 2.600 / 2.603 against 2.721 / 2.705 (3.09 against
#     3.18 at 16), now the default.
# 39. (session 25) (a) whether this jaxlib knows programmatic dependent launch (xla_gpu_enable_pdl, and the FFI
#     custom calls' uses_pdl attribute of later XLA); (b) the lora_xa GPU tests at XA_MAX_PARTS 32 / 64 / 128;
#     (c) XA_MAX_PARTS=128 against 64 on the training rollout; (d) --xla_gpu_enable_pdl true against false on
#     the base rollout, batch 8 (about 8 minutes).
#     Session 25 ran it: the first version's regex scan of the .so files took the whole 600 s (now fixed strings);
#     the A/Bs, run directly: PDL 2.089 / 2.105 ms against 2.099 / 2.100 (nothing: the FFI custom calls have no
#     uses_pdl in this XLA, only mosaic_gpu.uses_pdl); XA_MAX_PARTS=128 2.569 / 2.563 against 2.609 / 2.597 (now
#     the default); 24 lora_xa GPU tests pass.
# 40. (session 25, prepared) with XA_MAX_PARTS = 128 the default: (a) the whole GPU suite (every LoRA decode test now
#     runs 99 down parts); (b) the training-rollout table, NVFP4 against bf16 with the recipes' adapter (LoRA rank 32
#     + trained norms + AQN), batch 8, 16, 32 and 64 at 512 new tokens, to replace README's batch-32 / 64 figures
#     that predate trained norms in the fused layer end (about 8 minutes).
# 41. (session 26) the 8-warp mma.sync builds (w4_gluon.MMA_WARPS = 8, lab; gate/up and down only): (a) their GPU
#     tests against float64 (caps 128 / 80 / 64); (b) the kernel harness at M = 1, 8, 16 (standard order, gate alone)
#     with caps 128, 80, 64 and the 80 cap with 1188 split-K programs; (c) the base rollout, batch 8 and 16, 512 new
#     tokens, 4 warps against 8 at caps 80 and 64, alternating (about 9 minutes).
# 42. (session 26) SCALE_PAIRS = 1 (block scales paired once a block, not by four prmt in each decode block): its GPU
#     tests, the harness at M = 1, 8, 16, 32, 64, and the base rollout at batch 8 and 16, alternating (about 6 minutes).
# 43. (session 26) SCALE_PAIRS = 2 (the wgmma builds only) on the base rollout at batch 32 and 64, alternating.
#     Session 26 ran 41-43 (docs/benchmarks.md "Session 26"): 8 warps slower (off); SCALE_PAIRS=1 slower at batch 16,
#     SCALE_PAIRS=2 5.19 against 5.25 ms at batch 64 (now the default).
# 44. (session 26, prepared) with SCALE_PAIRS = 2 the default: issue 6's table (batch 8, 64 at 2048 new tokens, 256
#     at 1024), then the training rollout at batch 32 and 64 (512 new tokens), the two batches it changes (about 9 min).
# 45. (session 27) TMA_STAGES (lab): the TMA builds with more programs an SM's worth (they take 90 registers, so 5
#     programs of 4 warps share an SM) and with fewer steps a program (buffers never refilled: no barrier a step),
#     against the same split rule without TMA; kernel harness at M = 1 and 8 (about 3 min). Session 27 ran the
#     GPU tests and 1 / 2 / 4 / 8 buffers, step 44 and this step: every TMA variant slower than the default
#     (docs/benchmarks.md "Session 27").
# 46. (session 34, run in session 35, then removed with its setting) WIDE_CODE_LOADS: the narrow wgmma builds'
#     codes by 8-byte loads; right, and slower at every M (docs/benchmarks.md "Session 35").
# 47. (session 34, run in session 35, then removed with its setting) APPEND_PREFETCH: the decode attention touching
#     its first cache slots early; right, and not faster (docs/benchmarks.md "Session 35").
# 48. (session 37, prepared) decode attention merging its splits in the kernel (decoder.FUSED_ATTENTION_COMBINE = 1:
#     the last program of each (row, KV head) merges, counted on carried `sync` counters; off) and dealing the filled
#     slots over its programs at run time (decode_attention.APPEND_DYNAMIC_CHUNKS = 1; off): (a) the GPU tests of
#     tests/test_decode_attention.py (the merge at the 7B shape, lengths 1-2304, counters carried); (b) the kernel
#     alone, 28 layers at 300 / 1300 / 2300 filled slots, batch 8 and 64 (time_append.py); (c) the decode step's
#     kernel sequence with the merge on, with each kernel's HLO origin, whole in $OUT/profile_merge.txt (the step's
#     tail names what the LM head and sampling run: one reduction there took 9.3 µs a step in session 37's
#     profile) (about 7 minutes).
# 49. (session 37, prepared) step 48's settings in batch-8 base rollouts at 1024 new tokens, alternating off / merge /
#     merge in chunks of 4 / merge + run-time chunks / those with 1056 programs (about 8 minutes; a call of its own).
#     Session 39 ran the suite, the kernel alone at 1300 slots and the rollouts (each about 20 s, not 75): the merge
#     faster in every pair, now the default; run-time chunks no faster (docs/benchmarks.md "Session 39").
# 50. (session 39, prepared) with the split merge on by default: (a) the decode step's kernel sequence at a 1304-slot
#     cache (batch 8, each kernel's HLO origin; the layer table of docs/benchmarks.md "Session 37" again, whole in
#     $OUT/profile_b8_merge.txt); (b) issue 6's table at batch 64 and 256 (session 39 re-ran batch 8 only) (about 8 minutes).
# 51. (session 39, prepared) whole training steps on random weights (experiments/bench_train_step.py, the trainer's own
#     loop): the 7B GSM8K recipe (64 completions of 2048 tokens a step), NVFP4 against bf16, 3 steps each; then the
#     32B single-GPU recipe on NVFP4, 2 steps: seconds a step by phase and peak device memory (about 9 minutes;
#     the 32B part may need a call of its own).
#     Session 40 ran 50 and 51 (the 7B part alone takes about 360 s, the 32B part about 140 s: separate calls) and
#     found two memory fixes with them (docs/benchmarks.md "Session 40"). The trainer on the GPU image needs the
#     tensorboardX and protobuf wheels in .whl besides ../shared/tools/gpu-wheels' set. Not re-run since: the 7B
#     step after the code-order fix (its peak, 19.1 GiB, predates it).
# 52. (session 40, prepared) the training forward's attention through cuDNN (model.attn_impl="cudnn", off): its GPU
#     test against float64 and the XLA route's gradients, then the 7B GSM8K step with NVFP4 under "xla" (the default then,
#     also the 7B peak after the code-order fix) and "cudnn", 2 steps each (about 7 minutes; the update took 28.4 s
#     of a 44.4 s step in session 40, its attention materializing float32 scores a 512-query chunk at a time).
# 53. (session 42, prepared) the training-inference mismatch: the 7B GSM8K step with rl.recompute_old_logprobs=True
#     (the ratio's old log-probs from a training forward; the step logs the sampler's distance from them), NVFP4
#     (the Gluon decode kernels and the bf16 KV cache against the training path) and bf16, 2 steps each (about
#     6 minutes): the mean and max |log p| difference per token, and the extra forward's cost in the update time.
#     Session 43 ran 52 and 53 on an H100 (docs/benchmarks.md "Session 43"): cuDNN halved the update, so the config
#     default became model.attn_impl="auto".
# 54. (session 43, prepared) whole steps under the new default (cuDNN attention): the 7B recipe, NVFP4 and bf16, then
#     the 32B single-GPU recipe (about 6 minutes; session 43 measured only the 7B NVFP4 row with cuDNN).
# 55. (session 43, prepared) two 7B NVFP4 steps each with sampling.dequantize_min_rows=64 (the 64-row rollout on a
#     dense bf16 copy of the base: issue 6's batch-64 row reads 0.98x, so this may be the faster rollout, at about
#     13 GB more), then with rl.rollout_correction=sequence_mask (the recompute's cost and the logged
#     sampling/importance_sampling_ratio/*; mask_truncated_completions off, since every benchmark completion is
#     truncated and the ratio counts only the tokens the loss does) (about 5 minutes).
#     Session 44 ran 1 (514 passed in 329 s on an H100), 54 and 55, and issue 6's benchmark at batch 8, 64 and 256
#     (docs/benchmarks.md "Session 44"): the dense rollout copy gained nothing (left off); the 7B NVFP4 step is
#     1.18x bf16's.
# (Session 13 ran 1, 7 and 11 (with PROFILE_POSITIONS / PROFILE_SEQ), plus rollout A/Bs: the memsets'
# cost (ab_rollout.py GL_NO_ZERO=1), a memset-free workspace build (slower, removed), fixed-order
# partials (QERL_GLUON_DETERMINISTIC=1) and XLA's WHILE command buffers; docs/benchmarks.md "Session 13".
# Session 10 ran steps 1, 2, 7 and variants of 3, 4 and 8; session 11 ran 1, 3 (batch 8 and 64),
# 4 (LoRA) and 8 (M <= 128); session 12 ran 1, 2 (with the two variants session 11 prepared, both
# slower and left off), 9, 10 and 8 at M = 64 and 128, plus a batch-128 rollout; A/Bs through
# experiments/lab/gluon/ab_rollout.py; results in docs/benchmarks.md and docs/benchmarks_rollout.md.
# Not re-run since session 10: batch 256 and the 32B shapes. (Session 13's step 7: the zero-fill copies
# are gone; the launcher's memsets remain, 0.145 ms of a 2.61 ms batch-8 step.) Steps 5 and 6 concern the Pallas kernel, off by default at M <= 128.)
set -uo pipefail
OUT=${OUT:-/tmp/gpu_checkpoint}
STEPS=",${STEPS:-1,2,3,4,5,6,7,8,9,10,11},"
step() { [[ "$STEPS" == *",$1,"* ]]; }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
step 1 && XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 420 python3 -m pytest -q -n 10 -m gpu tests -p no:cacheprovider 2>&1 \
  | grep -v "Benchmark\|warner(" | tail -5 | tee "$OUT/gpu_tests.txt"
step 2 && { GL_MS=1,8,16,32,64,128 timeout 240 python3 experiments/lab/gluon/time_jax.py 2>&1
  QERL_GLUON_DETERMINISTIC=1 GL_MS=32,64 timeout 120 python3 experiments/lab/gluon/time_jax.py 2>&1
  GL_MMA_ATOMIC=0 GL_MS=1,8,16 timeout 120 python3 experiments/lab/gluon/time_jax.py 2>&1
} | grep -v Warn | tee "$OUT/gluon_time.txt"
export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_dynamic_slice_fusion=true"
step 3 && { timeout 420 python3 experiments/bench_rollout.py --batches=8,64,256 --new_tokens=2048 \
  --new_tokens_by_batch=256:1024 --formats=nvfp4_fused,bf16_fused --time_budget_s=360 --out="$OUT/issue6" > "$OUT/issue6.log" 2>&1; grep "|\|x$" "$OUT/issue6.log"; }
step 4 && { timeout 300 python3 experiments/bench_rollout.py --batches=256 --new_tokens=1024 \
  --formats=nvfp4_fused,bf16_fused --time_budget_s=240 --out="$OUT/b256" > "$OUT/b256.log" 2>&1; grep "|\|x$" "$OUT/b256.log"; }
step 4 && { timeout 240 python3 experiments/bench_rollout.py --batches=64 --new_tokens=1024 --formats=nvfp4_fused,bf16_fused \
  --lora_rank=32 --aqn --time_budget_s=180 --out="$OUT/lora64" > "$OUT/lora64.log" 2>&1; grep "|\|x$" "$OUT/lora64.log"; }
step 5 && OCC_MS=32 timeout 300 python3 experiments/lab/time_occupancy.py 2>&1 | grep --line-buffered "check\|M=" \
  | tee "$OUT/occupancy.txt"
step 6 && OUT="$OUT/ncu" timeout 280 bash experiments/lab/ncu_small_m.sh 2>&1 | tee "$OUT/ncu.txt"
step 7 && PROFILE_POSITIONS=1 PROFILE_SEQ=40 PROFILE_HLO=1 PROFILE_TOP=40 OUT="$OUT" timeout 300 python3 experiments/lab/profile_rollout.py \
  nvfp4_fused:8:64 bf16_fused:8:64 2>&1 | grep -v "^[IW][0-9]" | tee "$OUT/profile_b8.txt"
step 8 && timeout 420 python3 experiments/bench_kernels.py --models=7b --kinds=fwd --ms=1,8,16,32,64,128,256 \
  --json="$OUT/bench_kernels_7b.json" 2>&1 | grep "|" | tee "$OUT/bench_kernels_7b.txt"
step 9 && timeout 200 python3 experiments/lab/gluon/loads_only.py 2>&1 | grep -v "^[IW][0-9]" | tee "$OUT/loads_only.txt"
step 10 && OUT="$OUT/ncu" timeout 400 bash experiments/lab/gluon/ncu_gluon.sh "64 3584 37888" "128 3584 37888" "128 18944 3584" 2>&1 | tee "$OUT/ncu_gluon.txt"
step 11 && PROFILE_POSITIONS=1 PROFILE_HLO=1 PROFILE_TOP=40 OUT="$OUT" timeout 400 python3 experiments/lab/profile_rollout.py \
  nvfp4_fused:64:64 bf16_fused:64:64 2>&1 | grep -v "^[IW][0-9]" | tee "$OUT/profile_b64.txt"
step 12 && { timeout 200 python3 -m pytest -q -m gpu tests/test_gluon.py -k x_ring 2>&1 | tail -2
  GL_MS=32,40,64 GL_VARIANTS="ring@40/64:X_RING_MIN_MB=64;wa4@40/64:X_RING_MIN_MB=64,WG_ASYNC=1;wa3@40/64:X_RING_MIN_MB=64,WG_ASYNC=1,X_STAGES=3;n32@32:NARROW_MIN_MB=32;wa32@32:NARROW_MIN_MB=32,X_RING_MIN_MB=32,WG_ASYNC=1" \
    timeout 200 python3 experiments/lab/gluon/time_jax.py 2>&1 | grep -v Warn
  for s in "" "X_RING_MIN_MB=64,WG_ASYNC=1" "" "X_RING_MIN_MB=64,WG_ASYNC=1"; do
    GL_SET="$s" timeout 100 python3 experiments/lab/gluon/ab_rollout.py --batches=64 --new_tokens=512 \
      --formats=nvfp4_fused --time_budget_s=90 2>&1 | grep "w4_gluon\|nvfp4_fused |"; done; } | tee "$OUT/wg_async.txt"
step 14 && for s in "" "FUSED_DECODE_ATTENTION=0"; do
    MODEL_SET="$s" timeout 200 python3 experiments/lab/gluon/ab_rollout.py --batches=8,64 --new_tokens=1024 \
      --formats=nvfp4_fused,bf16_fused --time_budget_s=180 2>&1 | grep "decoder\.\|_fused |"; done | tee "$OUT/append_ab.txt"
step 15 && timeout 480 python3 experiments/bench_rollout.py --batches=8,64 --new_tokens=2048 \
    --formats=nvfp4_fused,bf16_fused --out="$OUT/issue6_2048" 2>&1 | grep "_fused |\|NVFP4 /" | tee "$OUT/issue6.txt"
step 16 && { PROFILE_HLO=1 PROFILE_SEQ=48 PROFILE_TOP=30 OUT="$OUT" timeout 200 python3 experiments/lab/profile_rollout.py \
    nvfp4_fused:8:64 2>&1 | grep -v "^[IW][0-9]"
  grep -n " copy(\| copy-start(\|memcpy" "$OUT"/nvfp4_fused_8_0.hlo.txt | head -60; gzip -f "$OUT"/*.hlo.txt; } \
  | tee "$OUT/decode_hlo.txt"
step 17 && for s in "ACCUMULATE_MAX_ROWS=64" "ACCUMULATE_DECODE=0" "ACCUMULATE_MAX_ROWS=64" "ACCUMULATE_DECODE=0"; do
    MODEL_SET="$s" timeout 110 python3 experiments/lab/gluon/ab_rollout.py --batches=16,32 --new_tokens=512 \
      --formats=nvfp4_fused --time_budget_s=90 2>&1 | grep "decoder\.\|_fused |"; done | tee "$OUT/accumulate_ab.txt"
step 20 && { timeout 300 python3 -m pytest -q -m gpu tests/test_gluon.py -k "decode_order or one_buffer" 2>&1 | tail -2
  timeout 200 python3 experiments/lab/gluon/decode_probe.py 2>&1 | grep -v "^[IW][0-9]\|Warn"
  for o in standard decode standard decode; do
    timeout 130 python3 experiments/bench_rollout.py --batches=8,64 --new_tokens=512 --formats=nvfp4_fused \
      --code_order=$o --time_budget_s=110 2>&1 | grep "nvfp4_fused |" | sed "s/^/$o /"; done; } | tee "$OUT/decode_order.txt"
step 21 && { timeout 150 python3 experiments/lab/gluon/decode_probe.py 2>&1 | grep -v "^[IW][0-9]\|Warn"
  timeout 420 python3 experiments/bench_rollout.py --batches=8,64 --new_tokens=2048 --formats=nvfp4_fused,bf16_fused \
    --code_order=decode --out="$OUT/issue6_2048_decode" 2>&1 | grep "_fused |\|NVFP4 /"; } | tee "$OUT/issue6_decode.txt"
step 22 && { timeout 200 python3 -m pytest -q -m gpu tests/test_gluon.py -k "dequantize_reads_decode_order" 2>&1 | tail -2
  export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_dynamic_slice_fusion=true"
  QERL_DEQUANT_IN_PLACE=0 timeout 150 python3 experiments/lab/time_code_order.py 2>&1 | grep -v "^[IW][0-9]\|Warn"
  QERL_DEQUANT_IN_PLACE=1 timeout 150 python3 experiments/lab/time_code_order.py 2>&1 | grep -v "^[IW][0-9]\|Warn"
  unset XLA_FLAGS; } | tee "$OUT/dequant_in_place.txt"
step 23 && { timeout 120 python3 -m pytest -q -m gpu tests/test_gluon_dx.py 2>&1 | tail -2
  DX_VARIANTS=${DX_VARIANTS:-base} timeout 300 python3 experiments/lab/time_dx.py 2>&1 | grep -v "^[IW][0-9]\|Warn"
  } | tee "$OUT/dx_kernel.txt"
step 19 && timeout 300 python3 experiments/lab/ejkernel_peer.py 2>&1 | grep -v "^[IW][0-9]\|Warning" | tee "$OUT/ejkernel_peer.txt"
step 13 && GL_MS=1,8,16 GL_VARIANTS="t128:TARGET_PROGRAMS=128;t256:TARGET_PROGRAMS=256;t1024:TARGET_PROGRAMS=1024" \
  timeout 300 python3 experiments/lab/gluon/time_jax.py 2>&1 | grep -v Warn | tee "$OUT/targets.txt"
step 24 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 400 python3 -m pytest -q -n 8 -m "not gpu" tests \
    -p no:cacheprovider --tb=short -rfE 2>&1 | tail -15
  timeout 100 python3 -m pytest -q -m gpu tests/test_nvfp4.py 2>&1 | tail -2; } | tee "$OUT/notgpu_tests_on_gpu.txt"
step 26 && for s in "" "LOAD_ASM=2,LOAD_ASM_MAX_WEIGHTS=33554432" "" "LOAD_ASM=2,LOAD_ASM_MAX_WEIGHTS=33554432"; do
    GL_SET="$s" timeout 100 python3 experiments/lab/gluon/ab_rollout.py --batches=8,16 --new_tokens=512 \
      --formats=nvfp4_fused --time_budget_s=80 2>&1 | grep "w4_gluon\.\|nvfp4_fused |"; done | tee "$OUT/load_asm.txt"
step 27 && LOADS_LAYOUTS=w8r,w16,w16r LOADS_VARIANTS=nc_256 timeout 200 python3 experiments/lab/gluon/loads_only.py 2>&1 \
  | grep -v "^[IW][0-9]\|Warn" | tee "$OUT/loads_width.txt"
step 28 && LAB_WEIGHT_MB=0 GL_MS=1,8 timeout 200 python3 experiments/lab/gluon/time_jax.py 2>&1 | grep -v Warn \
  | tee "$OUT/l2_hot.txt"
step 30 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -q -n 4 -m gpu tests/test_gluon.py -k "lora or one_buffer" \
    -p no:cacheprovider 2>&1 | tail -3
  for s in "" "LORA_XA=1" "" "LORA_XA=1"; do
    GL_SET="$s" timeout 100 python3 experiments/lab/gluon/ab_rollout.py --batches=8,16 --new_tokens=512 \
      --formats=nvfp4_fused --lora_rank=32 --aqn --time_budget_s=80 2>&1 | grep "w4_gluon\.\|nvfp4_fused+"; done
  for s in "" "LORA_IN_KERNEL_WG=1"; do
    GL_SET="$s" timeout 100 python3 experiments/lab/gluon/ab_rollout.py --batches=32 --new_tokens=512 \
      --formats=nvfp4_fused --lora_rank=32 --aqn --time_budget_s=80 2>&1 | grep "w4_gluon\.\|nvfp4_fused+"; done; } \
  | tee "$OUT/lora_xa.txt"
step 34 && { timeout 330 python3 experiments/bench_rollout.py --batches=8,64 --new_tokens=2048 \
    --formats=nvfp4_fused,bf16_fused --time_budget_s=300 --out="$OUT/issue6" > "$OUT/issue6.log" 2>&1
  grep "|\|x$" "$OUT/issue6.log"; }
step 35 && { CB="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
  XLA_FLAGS="$XLA_FLAGS $CB" XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -q -n 10 -m gpu tests \
    -p no:cacheprovider 2>&1 | tail -3
  for f in "" "$CB"; do echo "extra XLA flags: '$f'"
    XLA_FLAGS="$XLA_FLAGS $f" timeout 150 python3 experiments/bench_rollout.py --batches=8,64 --new_tokens=512 \
      --formats=nvfp4_fused,bf16_fused --time_budget_s=130 --out="$OUT/cb_${#f}" 2>&1 | grep "| nvfp4_fused |\|| bf16_fused |\|x$"; done; } \
  | tee "$OUT/command_buffer.txt"
step 36 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -q -n 6 -m gpu tests/test_residual_norm.py \
    tests/test_gluon.py -k "residual or layer_end or one_buffer or lora" -p no:cacheprovider 2>&1 | tail -3
  for s in "" "FUSED_LAYER_END=1" "FUSED_LAYER_END=1,FUSED_POST_ATTENTION=1" "" "FUSED_LAYER_END=1" \
      "FUSED_LAYER_END=1,FUSED_POST_ATTENTION=1"; do
    MODEL_SET="$s" timeout 100 python3 experiments/lab/gluon/ab_rollout.py --batches=8,16 --new_tokens=512 \
      --formats=nvfp4_fused --time_budget_s=80 2>&1 | grep "decoder\.\|nvfp4_fused |"; done
  PROFILE_SEQ=40 PROFILE_MODEL_SET="FUSED_LAYER_END=1,FUSED_POST_ATTENTION=1" timeout 150 python3 experiments/lab/profile_rollout.py \
    nvfp4_fused:8:256 2>&1 | grep -v Warn | tail -45; } | tee "$OUT/layer_end.txt"
step 37 && { for s in "" "ZERO_CHUNK=8192" "ZERO_CHUNK=512" "WARPS=8" "" "ZERO_CHUNK=8192" "ZERO_CHUNK=512" "WARPS=8"; do
    RN_SET="$s" timeout 50 python3 experiments/lab/gluon/ab_rollout.py --batches=8 --new_tokens=2048 \
      --formats=nvfp4_fused --time_budget_s=40 2>&1 | grep "residual_norm\.\|nvfp4_fused |"; done; } | tee "$OUT/residual_norm_shape.txt"
step 38 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -q -n 6 -m gpu tests/test_residual_norm.py \
    tests/test_gluon.py -k "layer_end or lora_xa" -p no:cacheprovider 2>&1 | tail -3
  for s in "FUSED_LAYER_END=0" "" "FUSED_LAYER_END=0" ""; do
    MODEL_SET="$s" timeout 100 python3 experiments/lab/gluon/ab_rollout.py --batches=8,16 --new_tokens=512 \
      --formats=nvfp4_fused --lora_rank=32 --aqn --time_budget_s=80 2>&1 | grep "decoder\.\|nvfp4_fused+"; done
  for s in "XA_MAX_PARTS=64" "" "XA_MAX_PARTS=64" ""; do
    GL_SET="$s" timeout 100 python3 experiments/lab/gluon/ab_rollout.py --batches=8,16 --new_tokens=512 \
      --formats=nvfp4_fused --lora_rank=32 --aqn --time_budget_s=80 2>&1 | grep "w4_gluon\.\|nvfp4_fused+"; done
  PROFILE_TOP=16 PROFILE_POSITIONS=1 timeout 120 python3 experiments/lab/profile_rollout.py nvfp4_fused:8:256:32:aqn 2>&1 \
    | grep -v Warn | tail -24; } | tee "$OUT/training_rollout.txt"
step 39 && { python3 -c "import jax; print('jax', jax.__version__)"; echo "XLA_FLAGS=${XLA_FLAGS:-}"
  for so in $(python3 -c "import glob, os, jaxlib; r = os.path.dirname(os.path.dirname(jaxlib.__file__)); print(' '.join(glob.glob(r + '/jaxlib/*.so') + glob.glob(r + '/jax_plugins/**/*.so', recursive=True)))"); do
    h=$(grep -aoF -e mosaic_gpu.uses_pdl -e uses_pdl -e xla_gpu_enable_pdl_launch -e xla_gpu_enable_pdl "$so" | sort -u | tr '\n' ' ')
    [[ -n "$h" ]] && echo "$(basename "$so"): $h"; done
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -q -n 6 -m gpu tests/test_gluon.py -k "lora_xa" \
    -p no:cacheprovider 2>&1 | tail -2
  for s in "XA_MAX_PARTS=128" "" "XA_MAX_PARTS=128" ""; do
    GL_SET="$s" timeout 100 python3 experiments/lab/gluon/ab_rollout.py --batches=8,16 --new_tokens=512 \
      --formats=nvfp4_fused --lora_rank=32 --aqn --time_budget_s=80 2>&1 | grep "w4_gluon\.\|nvfp4_fused+"; done
  for f in "--xla_gpu_enable_pdl=true" "--xla_gpu_enable_pdl=false" "--xla_gpu_enable_pdl=true" "--xla_gpu_enable_pdl=false"; do
    echo "extra XLA flags: $f"
    XLA_FLAGS="${XLA_FLAGS:-} $f" timeout 80 python3 experiments/bench_rollout.py --batches=8 --new_tokens=512 \
      --formats=nvfp4_fused --time_budget_s=50 --out="$OUT/pdl" 2>&1 | grep "| nvfp4_fused |"; done; } \
  | tee "$OUT/pdl_xa128.txt"
step 40 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 python3 -m pytest -q -n 10 -m gpu tests -p no:cacheprovider \
    2>&1 | tail -3
  timeout 330 python3 experiments/bench_rollout.py --batches=8,16,32,64 --new_tokens=512 --lora_rank=32 --aqn \
    --formats=nvfp4_fused,bf16_fused --time_budget_s=300 --out="$OUT/training" 2>&1 | grep "|\|x$"; } \
  | tee "$OUT/training_table.txt"
step 41 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 170 python3 -m pytest -q -n 10 -m gpu tests/test_gluon.py \
    -k "eight_warp" -p no:cacheprovider 2>&1 | tail -3
  GL_MS=1,8,16 GL_VARIANTS="w8:MMA_WARPS=8;w8r80:MMA_WARPS=8,MMA8_MAX_REGISTERS=80;w8r64:MMA_WARPS=8,MMA8_MAX_REGISTERS=64;w8r80t:MMA_WARPS=8,MMA8_MAX_REGISTERS=80,MMA8_TARGET_PROGRAMS=1188" \
    timeout 150 python3 experiments/lab/gluon/time_jax.py 2>&1 | grep -v Warn | grep "7b_gate\|7b_down\|M=\|FAIL"
  for s in "" "MMA_WARPS=8,MMA8_MAX_REGISTERS=80" "MMA_WARPS=8,MMA8_MAX_REGISTERS=64" "" "MMA_WARPS=8,MMA8_MAX_REGISTERS=80" \
      "MMA_WARPS=8,MMA8_MAX_REGISTERS=64"; do
    GL_SET="$s" timeout 60 python3 experiments/lab/gluon/ab_rollout.py --batches=8,16 --new_tokens=512 \
      --formats=nvfp4_fused --time_budget_s=45 2>&1 | grep "w4_gluon\.\|nvfp4_fused |"; done; } | tee "$OUT/eight_warps.txt"
step 42 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -q -n 10 -m gpu tests/test_gluon.py \
    -k "scale_pairs" -p no:cacheprovider 2>&1 | tail -3
  GL_MS=1,8,16,32,64 GL_VARIANTS="sp:SCALE_PAIRS=1" timeout 130 python3 experiments/lab/gluon/time_jax.py 2>&1 \
    | grep -v Warn | grep "M=\|FAIL"
  for s in "" "SCALE_PAIRS=1" "" "SCALE_PAIRS=1"; do
    GL_SET="$s" timeout 60 python3 experiments/lab/gluon/ab_rollout.py --batches=8,16 --new_tokens=512 \
      --formats=nvfp4_fused --time_budget_s=45 2>&1 | grep "w4_gluon\.\|nvfp4_fused |"; done; } | tee "$OUT/scale_pairs.txt"
step 43 && { for s in "" "SCALE_PAIRS=2" "" "SCALE_PAIRS=2"; do
    GL_SET="$s" timeout 75 python3 experiments/lab/gluon/ab_rollout.py --batches=32,64 --new_tokens=512 \
      --formats=nvfp4_fused --time_budget_s=55 2>&1 | grep "w4_gluon\.\|nvfp4_fused |"; done; } | tee "$OUT/scale_pairs_wg.txt"
step 44 && { timeout 400 python3 experiments/bench_rollout.py --batches=8,64,256 --new_tokens=2048 \
    --new_tokens_by_batch=256:1024 --formats=nvfp4_fused,bf16_fused --time_budget_s=360 --out="$OUT/issue6" 2>&1 \
    | grep "|\|x$"
  timeout 150 python3 experiments/bench_rollout.py --batches=32,64 --new_tokens=512 --lora_rank=32 --aqn \
    --formats=nvfp4_fused,bf16_fused --time_budget_s=120 --out="$OUT/training" 2>&1 | grep "|\|x$"; } \
  | tee "$OUT/issue6_scale_pairs.txt"
step 45 && { GL_MS=1,8 GL_VARIANTS="tma1:TMA_STAGES=1;tma1t640:TMA_STAGES=1,TARGET_PROGRAMS=640;tma4s4:TMA_STAGES=4,MAX_STEPS=4,TARGET_PROGRAMS=1024;tma2s2:TMA_STAGES=2,MAX_STEPS=2,TARGET_PROGRAMS=2048;s4:MAX_STEPS=4,TARGET_PROGRAMS=1024" \
    timeout 400 python3 experiments/lab/gluon/time_jax.py 2>&1 | grep -v Warn; } | tee "$OUT/tma_grid.txt"
step 25 && { GL_MS=1,8 GL_VARIANTS="r96:MMA_MAX_REGISTERS=96;r96t640:MMA_MAX_REGISTERS=96,TARGET_PROGRAMS=640;r80:MMA_MAX_REGISTERS=80;r80t768:MMA_MAX_REGISTERS=80,TARGET_PROGRAMS=768" \
    timeout 300 python3 experiments/lab/gluon/time_jax.py 2>&1 | grep -v Warn
  for s in "" "MMA_MAX_REGISTERS=96" "" "MMA_MAX_REGISTERS=96"; do
    GL_SET="$s" timeout 100 python3 experiments/lab/gluon/ab_rollout.py --batches=8 --new_tokens=512 \
      --formats=nvfp4_fused --time_budget_s=90 2>&1 | grep "w4_gluon\|nvfp4_fused |"; done; } | tee "$OUT/register_caps.txt"
step 48 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -q -n 4 -m gpu tests/test_decode_attention.py \
    -p no:cacheprovider 2>&1 | tail -3
  for n in 300 1300 2300; do APPEND_BATCHES=8,64 APPEND_LENGTH=$n APPEND_VARIANTS="append;merge;merge dyn;merge dyn t1056;merge dyn t2112" \
    timeout 100 python3 experiments/lab/time_append.py 2>&1 | grep "^batch" | sed "s/^/length $n: /"; done
  PROFILE_MODEL_SET="FUSED_ATTENTION_COMBINE=1" PROFILE_PROMPT=1280 PROFILE_POSITIONS=1 PROFILE_TOP=40 PROFILE_SEQ=300 \
    PROFILE_HLO=1 timeout 150 python3 experiments/lab/profile_rollout.py nvfp4_fused:8:48 2>&1 \
    | grep -v "Warn\|profiler.py" > "$OUT/profile_merge.txt"
  grep -m1 "one decode step" "$OUT/profile_merge.txt"; grep -A9 -m1 "one decode step" "$OUT/profile_merge.txt" | tail -9
  echo "(the step's last 30 kernels: the LM head and sampling)"; grep -B30 -m1 "^ *[0-9.]* ms " "$OUT/profile_merge.txt" \
    | head -30; } | tee "$OUT/attention_merge.txt"
step 49 && { for s in "FUSED_ATTENTION_COMBINE=0|" "FUSED_ATTENTION_COMBINE=1|" "FUSED_ATTENTION_COMBINE=1|MERGE_CHUNK=4" \
      "FUSED_ATTENTION_COMBINE=1|APPEND_DYNAMIC_CHUNKS=1" \
      "FUSED_ATTENTION_COMBINE=1|APPEND_DYNAMIC_CHUNKS=1,APPEND_TARGET_PROGRAMS=1056" "FUSED_ATTENTION_COMBINE=0|" \
      "FUSED_ATTENTION_COMBINE=1|"; do
    echo "== decoder ${s%%|*}; decode_attention ${s#*|}"
    MODEL_SET="${s%%|*}" DA_SET="${s#*|}" timeout 75 python3 experiments/lab/gluon/ab_rollout.py --batches=8 \
      --new_tokens=1024 --formats=nvfp4_fused --time_budget_s=60 2>&1 | grep "nvfp4_fused |"; done; } \
  | tee "$OUT/attention_merge_rollouts.txt"
step 50 && { PROFILE_PROMPT=1280 PROFILE_POSITIONS=1 PROFILE_TOP=40 PROFILE_SEQ=300 PROFILE_HLO=1 timeout 150 \
    python3 experiments/lab/profile_rollout.py nvfp4_fused:8:48 2>&1 | grep -v "Warn\|profiler.py" > "$OUT/profile_b8_merge.txt"
  grep -A12 -m1 "one decode step" "$OUT/profile_b8_merge.txt"
  timeout 330 python3 experiments/bench_rollout.py --batches=64,256 --new_tokens=2048 --new_tokens_by_batch=256:1024 \
    --formats=nvfp4_fused,bf16_fused --time_budget_s=300 --out="$OUT/issue6_b64_b256" 2>&1 | grep "|\|x$"; } \
  | tee "$OUT/merge_profile_issue6.txt"
step 52 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python3 -m pytest -q -m gpu tests/test_model.py -k "cudnn" \
    -p no:cacheprovider 2>&1 | tail -3
  for impl in xla cudnn; do echo "== model.attn_impl=$impl"
    timeout 220 python3 experiments/bench_train_step.py --config=configs/gsm8k_qwen2_5_7b.py --quants=nvfp4 --steps=2 \
      --config.model.attn_impl=$impl --out="$OUT/train_step_7b_$impl" 2>&1 | grep -v "^[IW][0-9]" | grep "|" | tail -1; done; } \
  | tee "$OUT/attn_impl.txt"
step 53 && { timeout 560 python3 experiments/bench_train_step.py --config=configs/gsm8k_qwen2_5_7b.py --steps=2 \
    --config.rl.recompute_old_logprobs=True --out="$OUT/train_step_7b_recompute" 2>&1 | grep -v "^[IW][0-9]" | tail -6; } \
  | tee "$OUT/recompute_old.txt"
step 54 && { timeout 300 python3 experiments/bench_train_step.py --config=configs/gsm8k_qwen2_5_7b.py --steps=2 \
    --out="$OUT/train_step_7b_auto" 2>&1 | grep -v "^[IW][0-9]" | tail -5
  timeout 200 python3 experiments/bench_train_step.py --config=configs/gsm8k_qwen2_5_32b_single_gpu.py --shape=qwen2.5-32b \
    --quants=nvfp4 --steps=2 --out="$OUT/train_step_32b_auto" 2>&1 | grep -v "^[IW][0-9]" | tail -4; } \
  | tee "$OUT/train_step_auto.txt"
step 55 && { timeout 200 python3 experiments/bench_train_step.py --config=configs/gsm8k_qwen2_5_7b.py --quants=nvfp4 \
    --steps=2 --config.sampling.dequantize_min_rows=64 --out="$OUT/train_step_7b_dense_rollout" 2>&1 \
    | grep -v "^[IW][0-9]" | grep "|" | tail -1
  timeout 200 python3 experiments/bench_train_step.py --config=configs/gsm8k_qwen2_5_7b.py --quants=nvfp4 --steps=2 \
    --config.rl.rollout_correction=sequence_mask --config.rl.mask_truncated_completions=False --out="$OUT/train_step_7b_correction" 2>&1 | grep -v "^[IW][0-9]" \
    | grep "|" | tail -1; } | tee "$OUT/train_step_dense_correction.txt"
step 51 && { timeout 420 python3 experiments/bench_train_step.py --config=configs/gsm8k_qwen2_5_7b.py --steps=3 \
    --out="$OUT/train_step_7b" 2>&1 | grep -v "^[IW][0-9]" | tail -8
  timeout 170 python3 experiments/bench_train_step.py --config=configs/gsm8k_qwen2_5_32b_single_gpu.py --shape=qwen2.5-32b \
    --quants=nvfp4 --steps=2 --out="$OUT/train_step_32b" 2>&1 | grep -v "^[IW][0-9]" | tail -6; } | tee "$OUT/train_step.txt"
# 56 (session 45's follow-ups, about 4 minutes): CUTLASS's mixed-input GEMM and bf16 at the 7B and 32B shapes on
#    whichever card comes (session 45 had them on an H100 only), then decode attention at batch 8 on this card: the
#    in-kernel merge against XLA's combine at 2 and 1300 filled slots (how much of the fixed part the merge is).
step 56 && { for model in 7b 32b; do CUTLASS_MODEL=$model CUTLASS_BINS="ex55_t128x256 ex55_t256x128" \
      CUTLASS_MS="2048 8192" timeout 150 bash experiments/lab/cutlass_mixed_ceiling.sh 2>&1 | grep -v "mode=0"; done
  APPEND_BATCHES=8 APPEND_LENGTH=2,1300 APPEND_VARIANTS="merge;append" timeout 120 python3 experiments/lab/time_append.py \
    2>&1 | grep "^batch"; } | tee "$OUT/cutlass_and_attention.txt"
# (Session 47 ran 57's tests (52 passed) and timings, and part of 61, on an H100 after writing them: split-K and the
#  narrow tiles are now the defaults, so 57-62's "MAX_SPLITS=8" / "SMALL_M_MAX=128" variants are the default; their
#  "base" rows run the whole-tile kernel only where MM_VARIANTS sets MAX_SPLITS=1,SMALL_M_MAX=0. docs/benchmarks.md
#  "Session 47".)
# 57 (session 47, prepared; about 6 minutes): the large-M forward's lab builds, none yet run on a GPU: the GPU tests of
#    tests/test_gluon_mm.py (the dx build, split-K, the narrow 64- and 128-row tiles, the grouped walk), then the
#    forward at M = 8-1024 on the 7B shapes (step 61: 32B): the default against split-K (MAX_SPLITS=8) and the narrow tiles
#    with split-K (with a ring of 4 and of 8 stages), and at M <= 128 the decode GEMV. If split-K is correct and faster, set MAX_SPLITS (and refit STEP_US
#    / SMALL_STEP_US from the rows); where a narrow tile beats the GEMV, give the dispatch a rule for it.
step 57 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -q -m gpu tests/test_gluon_mm.py \
    -p no:cacheprovider 2>&1 | tail -4
  MM_MS=8,64,128,256,512,1024 MM_VARIANTS="base;sk8:MAX_SPLITS=8;narrow:SMALL_M_MAX=128,MAX_SPLITS=8;narrow8:SMALL_M_MAX=128,MAX_SPLITS=8,SMALL_STAGES=8" timeout 330 \
      python3 experiments/lab/time_mm.py 2>&1 | grep -v Warn; } | tee "$OUT/mm_split_narrow.txt"
# 61 (session 47, prepared; about 5 minutes): step 57's timing on the 32B shapes.
step 61 && { MM_MODEL=32b MM_MS=8,64,128,256,512,1024 MM_VARIANTS="base;sk8:MAX_SPLITS=8;narrow:SMALL_M_MAX=128,MAX_SPLITS=8;narrow8:SMALL_M_MAX=128,MAX_SPLITS=8,SMALL_STAGES=8" \
      timeout 400 python3 experiments/lab/time_mm.py 2>&1 | grep -v Warn; } | tee "$OUT/mm_split_narrow_32b.txt"
# 58 (session 47, prepared; about 6 minutes): the dx build's timing against dequantize + cuBLAS (M = 2048, 8192, 7B),
#    then issue 4's table at M = 256-2048 under the cost model's dispatch (bench_kernels.py), split-K on
#    (QERL_GLUON_MM_MAX_SPLITS=8; default settings otherwise).
step 58 && { MM_KIND=dx MM_MS=2048,8192 timeout 150 python3 experiments/lab/time_mm.py 2>&1 | grep -v Warn
  QERL_GLUON_MM_MAX_SPLITS=8 timeout 300 python3 experiments/bench_kernels.py --models=7b,32b --ms=256,1024,2048 \
    --kinds=fwd --ragged=false --json="$OUT/bench_kernels_mm_split.json" 2>&1 | grep "|"; } | tee "$OUT/mm_dx_bench.txt"
# 59 (session 47, prepared; about 5 minutes): a batch-256 rollout (1024 new tokens), NVFP4, with split-K off and on
#    (MM_SET): the decode step's M = 256 products move from dequantize + cuBLAS to the large-M forward where it pays.
step 59 && { for s in "MAX_SPLITS=1" "MAX_SPLITS=8"; do MM_SET="$s" timeout 150 python3 experiments/lab/gluon/ab_rollout.py \
      --batches=256 --new_tokens=1024 --formats=nvfp4_fused --time_budget_s=120 2>&1 | grep "w4_gluon_mm\|nvfp4_fused |"; done
} | tee "$OUT/mm_split_rollout.txt"
# 60 (session 47, prepared; about 5 minutes): the large-M forward at M = 4096 and 8192 (7B shapes), where x outgrows the
#    L2: the default walk against grouped walks of 8, 12 and 16 row tiles (RASTER_GROUP), with split-K on. If a group
#    brings M = 8192 above dequantize + cuBLAS (0.955x of bf16 on an H100), raise MAX_M.
step 60 && { MM_MS=4096,8192 MM_VARIANTS="base;sk8:MAX_SPLITS=8;g8:RASTER_GROUP=8,MAX_SPLITS=8;g12:RASTER_GROUP=12,MAX_SPLITS=8;g16:RASTER_GROUP=16,MAX_SPLITS=8" \
    timeout 280 python3 experiments/lab/time_mm.py 2>&1 | grep -v Warn; } | tee "$OUT/mm_raster.txt"
# 62 (session 47, prepared; about 6 minutes): the new defaults in rollouts, NVFP4, 512 new tokens: batch 64 (its decode
#    products at M = 64 now take the narrow tiles; decode steps of more than the decoder's ACCUMULATE_MAX_ROWS = 32
#    rows go through matmul's dispatch) and batch 256 (M = 256: split-K), against the session-46 routing (MM_SET).
step 62 && { for s in "SMALL_M_MAX=0,MAX_SPLITS=1" ""; do echo "== w4_gluon_mm ${s:-defaults}"
    MM_SET="$s" timeout 170 python3 experiments/lab/gluon/ab_rollout.py --batches=64,256 --new_tokens=512 \
      --formats=nvfp4_fused --time_budget_s=150 2>&1 | grep "nvfp4_fused |"; done; } | tee "$OUT/mm_defaults_rollout.txt"
# 63 (session 48, prepared; no device machine came that session; about 7 minutes): the dx build's timing (step 58's
#    first part), the narrow tiles at M = 64 and 128 (7B gate/up, down,
#    q/k/v): the default against NARROW_PER_SM=2 and the probes without a decode (PROBE=1), without x copies (3),
#    without weight copies (4), and with the ring's stages released in
#    pairs (RELEASE_PAIRS=1: 3 barriers of the MMA warps every two steps instead of 4). Whichever of decode, copies or the
#    step's waits the probes show to be the narrow step's limit is the next target; if NARROW_PER_SM=2 is faster, make
#    it the default and refit SMALL_STEP_US[64]. Session 49 added the PTX without the MMA warps' barrier before each
#    ready wait (WAIT_SYNC=0: 2 barriers a step left of 4), each stage released by both warpgroups with no barrier
#    (WARPGROUP_RELEASE=1; with WAIT_SYNC=0 none a step: "nobar") and their GPU tests (last, so that a timeout costs only
#    them: time_mm.py prints each variant's error against dequantize + cuBLAS anyway), and dropped IN_FLIGHT=0 (measured
#    in session 46) for time; time_mm.py now resets these settings between variants (session 48's list left
#    NARROW_PER_SM=2 on for the variants after pp2).
step 63 && { MM_KIND=dx MM_MS=2048,8192 timeout 140 python3 experiments/lab/time_mm.py 2>&1 | grep -v Warn
  MM_MS=64,128 MM_SHAPES=gate_up,down,qkv MM_VARIANTS="base;pp2:NARROW_PER_SM=2;rp:RELEASE_PAIRS=1;ws0:WAIT_SYNC=0;wr:WARPGROUP_RELEASE=1;nobar:WAIT_SYNC=0,WARPGROUP_RELEASE=1;p1:PROBE=1;p3:PROBE=3;p4:PROBE=4" \
    timeout 270 python3 experiments/lab/time_mm.py 2>&1 | grep -v Warn
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 110 python3 -m pytest -q -m gpu tests/test_gluon_mm.py \
    -k "two_narrow or release_pairs or ptx_rewrites" -p no:cacheprovider 2>&1 | tail -3; } | tee "$OUT/narrow_probe.txt"
# 64 (session 49; about 8 minutes): step 63 (session 49, H200) had the narrow tiles' step limited by the decode (no
#    decode: 1.75x of bf16 against 1.08x at M = 64; no copies: within 3%), the barrier-free K loop (WAIT_SYNC=0,
#    WARPGROUP_RELEASE=1) faster at M = 128 (0.988x against 0.935x) and the dx build at 0.924x of bf16 at M = 2048
#    (dequantize + cuBLAS 0.851x). With those now the defaults (GLUON_MM_DX "1"): the barrier-free loop against
#    Triton's ("old") with decode-order codes at M = 64, 128 and 2048, and two programs an SM (pp2); the dx build at
#    M = 256 and 1024 against dequantize + cuBLAS; issue 4's 7B table (M = 8192 left out: dequantize + cuBLAS, as in
#    session 35); the GPU tests of the Gluon GEMM, last.
step 64 && { MM_ORDER=decode MM_MS=64,128,2048 MM_VARIANTS="base;old:WAIT_SYNC=1,WARPGROUP_RELEASE=0;pp2:NARROW_PER_SM=2" \
    timeout 150 python3 experiments/lab/time_mm.py 2>&1 | grep -v Warn
  MM_KIND=dx MM_ORDER=decode MM_MS=256,1024 MM_VARIANTS="base;old:WAIT_SYNC=1,WARPGROUP_RELEASE=0" \
    timeout 90 python3 experiments/lab/time_mm.py 2>&1 | grep -v Warn
  timeout 270 python3 experiments/bench_kernels.py --models=7b --kinds=fwd,dx --ms=1,8,32,64,128,256,2048 \
    --dx_ms=2048 --ragged=false --json="$OUT/bench_kernels_7b.json" 2>&1 | grep "|"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python3 -m pytest -q -n 4 -m gpu tests/test_gluon_mm.py -p no:cacheprovider \
    > "$OUT/gpu_tests.txt" 2>&1; grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests.txt" | tail -8; } | tee "$OUT/step64.txt"
# 65 (session 49; about 6 minutes): step 64 (H100) had the barrier-free loop faster at every M (7B summed, decode
#    order: 1.412x / 1.238x / 0.983x of bf16 at M = 64 / 128 / 2048 against 1.403x / 1.219x / 0.954x), the dx build
#    at 0.959x / 0.919x at M = 256 / 1024 (dequantize + cuBLAS 0.471x / 0.738x), and 6 GPU tests refused by the
#    release rewrite at one-step split units (fixed since). The Gluon GEMM's GPU tests again (with those of the lab
#    setting PREFETCH_CODES: the narrow tiles' codes loaded a step ahead of their decode), its timing at M = 64 and
#    128, the kernels' and the model's GPU tests (the trainer's backward now takes the dx build), then issue 4's 32B
#    table.
step 65 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 python3 -m pytest -q -n 4 -m gpu tests/test_gluon_mm.py \
    -p no:cacheprovider > "$OUT/gpu_tests_mm.txt" 2>&1; grep -E "passed|failed|FAILED" "$OUT/gpu_tests_mm.txt" | tail -8
  MM_ORDER=decode MM_MS=64,128 MM_VARIANTS="base;pf:PREFETCH_CODES=1" timeout 80 python3 experiments/lab/time_mm.py \
    2>&1 | grep -v Warn
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python3 -m pytest -q -n 4 -m gpu tests/test_kernels.py tests/test_model.py \
    -p no:cacheprovider > "$OUT/gpu_tests_model.txt" 2>&1; grep -E "passed|failed|FAILED" "$OUT/gpu_tests_model.txt" | tail -8
  timeout 130 python3 experiments/bench_kernels.py --models=32b --kinds=fwd,dx --ms=1,8,32,64,128,256,2048 \
    --dx_ms=2048 --ragged=false --json="$OUT/bench_kernels_32b.json" 2>&1 | grep "|"; } | tee "$OUT/step65.txt"
# 66 (session 50; about 6 minutes): step 65 (session 50, H100) passed the Gluon GEMM's 77 GPU tests and the kernels' and
#    model's 29, and had PREFETCH_CODES slower (7B summed 1.382x / 1.185x of bf16 against 1.433x / 1.199x at M = 64 / 128;
#    it stays off). Issue 4's whole table under the current defaults (7B and 32B, M = 1 to 8192, dx at 2048 and 8192),
#    then issue 6's (step 3), on whichever card comes.
step 66 && { for model in 7b 32b; do timeout 200 python3 experiments/bench_kernels.py --models=$model --kinds=fwd,dx \
    --ms=1,8,32,64,128,256,2048,8192 --dx_ms=2048,8192 --ragged=false --json="$OUT/bench_kernels_$model.json" 2>&1 | grep "|"; done
  timeout 240 python3 experiments/bench_rollout.py --batches=8,64,256 --new_tokens=2048 --new_tokens_by_batch=256:1024 \
    --formats=nvfp4_fused,bf16_fused --time_budget_s=200 --out="$OUT/issue6" > "$OUT/issue6.log" 2>&1; grep "|\|x$" "$OUT/issue6.log"; } \
  | tee "$OUT/step66.txt"
# 67 (session 50, prepared; about 4 minutes): the GPU tests of session 50's two changes (kernel_dx takes the opt-in
#    GLUON_DX kernel first: test_gpu_gradient_takes_the_dx_kernel failed in the H200 suite before it; at 32 < M <= 64
#    weights of at most NARROW_SMALL_WEIGHTS values stay on the decode GEMV), the 32B shapes at M = 64 by path (is
#    the 32B o, 26.2M values, faster on the GEMV too? then raise NARROW_SMALL_WEIGHTS to 2**25), and issue 4's 7B rows
#    at M = 33, 64 under the new rule.
step 67 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -q -n 8 -m gpu tests/test_gluon_dx.py \
    tests/test_kernels.py -p no:cacheprovider > "$OUT/gpu_tests_67.txt" 2>&1; grep -E "passed|failed|FAILED" "$OUT/gpu_tests_67.txt" | tail -8
  MM_MODEL=32b MM_ORDER=decode MM_MS=40,64 MM_VARIANTS="base;pp2:NARROW_PER_SM=2" timeout 100 python3 experiments/lab/time_mm.py \
    2>&1 | grep -v Warn
  timeout 120 python3 experiments/bench_kernels.py --models=7b --kinds=fwd --ms=33,64 --ragged=false \
    --json="$OUT/bench_kernels_7b_m64.json" 2>&1 | grep "|"; } | tee "$OUT/step67.txt"
# 68 (session 50, prepared; about 8 minutes): the model's linears on the narrow tiles at 32 < M <= 128
#    (matmul.GLUON_MM_NARROW_MODEL, opt-in). Until now a model's product of up to 128 rows took the decode GEMV's
#    float32 route, so the narrow tiles never ran in a rollout; in the harness the 7B gate/up at M = 64 takes 56 us
#    on them against 81-85 on the GEMV (both cards). Its GPU test against float64, then batch-64 and batch-128
#    rollouts (NVFP4, plain and with the training adapter) alternating off / on / off / on. If "on" is faster at both
#    batches and the test passes, make "1" the default (and re-run issue 6's batch 64 row).
step 68 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 python3 -m pytest -q -m gpu tests/test_model.py \
    -k "narrow_route or bf16_route" -p no:cacheprovider 2>&1 | tail -3
  for s in "GLUON_MM_NARROW_MODEL=0" "GLUON_MM_NARROW_MODEL=1" "GLUON_MM_NARROW_MODEL=0" "GLUON_MM_NARROW_MODEL=1"; do
    MATMUL_SET="$s" timeout 110 python3 experiments/lab/gluon/ab_rollout.py --batches=64,128 --new_tokens=512 \
      --formats=nvfp4_fused --time_budget_s=90 2>&1 | grep "GLUON_MM_NARROW_MODEL\|nvfp4_fused |"; done
  for s in "GLUON_MM_NARROW_MODEL=0" "GLUON_MM_NARROW_MODEL=1"; do
    MATMUL_SET="$s" timeout 110 python3 experiments/lab/gluon/ab_rollout.py --batches=64 --new_tokens=512 \
      --formats=nvfp4_fused --lora_rank=32 --aqn --time_budget_s=90 2>&1 | grep "GLUON_MM_NARROW_MODEL\|^| nvfp4"; done
} | tee "$OUT/step68.txt"
# 69 (session 51, prepared; about 7 minutes, for an H200): step 68 (session 51, H100) had the narrow route faster in
#    every rollout (decode step 4.63 against 5.60 ms at batch 64, 6.45 against 8.33 at 128, 5.77 against 6.72 with
#    LoRA rank 32 + AQN); it is now the default, and issue 6's batch 64 went from 1.12x to 1.32x of bf16 on the H100.
#    Issue 6's whole table on the H200 under it (batch 128 added), then the training rollout at batch 64.
#    Session 52 ran it on an H100 (no H200 came): 2.18x / 1.31x / 1.13x / 1.00x at batch 8 / 64 / 128 / 256, training
#    batch 64 1.30x (docs/benchmarks_rollout.md, "session 52").
step 69 && { timeout 330 python3 experiments/bench_rollout.py --batches=8,64,128,256 --new_tokens=2048 \
    --new_tokens_by_batch=256:1024 --formats=nvfp4_fused,bf16_fused --time_budget_s=290 --out="$OUT/issue6" \
    > "$OUT/issue6.log" 2>&1; grep "|\|x$" "$OUT/issue6.log"
  timeout 120 python3 experiments/bench_rollout.py --batches=64 --new_tokens=512 --lora_rank=32 --aqn \
    --formats=nvfp4_fused,bf16_fused --time_budget_s=100 --out="$OUT/train64" > "$OUT/train64.log" 2>&1
  grep "|\|x$" "$OUT/train64.log"; } | tee "$OUT/step69.txt"
# 70 (session 51, prepared; about 5 minutes): decode attention's launch at batch 64 and 128, never swept (its defaults
#    were tuned at batch 8). A batch-64 rollout profile (H100, session 51) had decode_attention_append at 75.9 us a
#    layer against the W4A16 kernels' 104; time_append.py (H100) 65.1 us a layer at 1300 slots (about 2.6 TB/s of the
#    KV cache), dynamic chunks slower (74.9). The rest of that sweep (session 51's ran 3 of its variants: the caches
#    were drawn by numpy, now on the device).
#    Session 52 (H100): the defaults ("merge") fastest at both batches, 1781 and 3419 us for 28 layers; at batch 64
#    about 2.7 TB/s of KV bytes, near the copy rate. Nothing to change.
step 70 && { for b in 64 128; do APPEND_BATCHES=$b APPEND_LENGTH=1300 APPEND_VARIANTS="merge;merge t1056;merge t2112;merge s3;merge t1056 s3;merge dyn t1056 s3;merge b128;merge w8;merge t2112 b32" \
    timeout 140 python3 experiments/lab/time_append.py 2>&1 | grep "^batch"; done; } | tee "$OUT/step70.txt"
# 71 (session 52, prepared; about 6 minutes): DECODE = 4, the large-M forward with the decode GEMV's nibble pairing
#    (w4_gluon_mm._asm_decode_order_paired; offline its main loop 360 -> 256 instructions). Session 52 (H100) measured
#    the kernel alone (x handed over in its K order, p4k) at 1.700x of bf16 against 1.515x at M = 64, 1.429x against
#    1.246x at 128, 1.009x against 0.989x at 2048 (7B gate/up + down + q/k/v), and its 9 GPU tests pass; with x
#    permuted per call by a 5-D transpose it lost (up to 20 us a call). The permute is now an elementwise uint32 op
#    (x_in_nibble_pair_order), which XLA can fold into an XLA producer. This step: the GPU tests, the harness with the
#    permute (p4) and without (p4k) at M = 64, 128, 2048 and 8192, then rollouts at batch 64 and 128 alternating
#    (the decode step's inputs to the narrow tiles come from custom kernels, so there the permute is its own small
#    kernel). If p4 wins in the harness and the rollouts, make DECODE = 4 the default (and write docs/kernels.md).
step 71 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -q -n 10 -m gpu tests/test_gluon_mm.py \
    -k "paired" -p no:cacheprovider 2>&1 | tail -2
  MM_ORDER=decode MM_MS=64,128,2048,8192 MM_VARIANTS="base;p4:DECODE=4;p4k:DECODE=4,PAIRED_X_PERMUTE=0" \
    timeout 200 python3 experiments/lab/time_mm.py 2>&1 | grep -v Warn
  for s in "" "DECODE=4" "" "DECODE=4"; do echo "== w4_gluon_mm ${s:-defaults}"
    MM_SET="$s" timeout 110 python3 experiments/lab/gluon/ab_rollout.py --batches=64,128 --new_tokens=512 \
      --formats=nvfp4_fused --time_budget_s=90 2>&1 | grep "nvfp4_fused |"; done; } | tee "$OUT/step71.txt"
#    Session 53 (H200): the 9 tests pass; the harness had p4 ahead at M = 64 / 128 (7B summed 1.122x / 0.965x of bf16
#    against 1.063x / 0.901x) and behind at 2048 / 8192 (0.945x / 0.877x against 0.985x / 0.915x), the rollouts ahead
#    at batch 64 / 128 (decode step 4.13 / 5.80 against 4.30 / 6.01 ms, twice each). The paired decode is now the
#    narrow tiles' default (then PAIRED_MAX_M = 128; since step 73 w4_gluon_mm.NARROW_DECODE = 4).
# 72 (session 53, prepared; about 7 minutes): the GPU tests of that default (the whole Gluon GEMM file, the kernels'
#    and the model's), issue 4's rows at M = 64, 128, 256 (7B and 32B, forward), issue 6's at batch 64 and 128.
step 72 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -q -n 10 -m gpu tests/test_gluon_mm.py \
    tests/test_kernels.py tests/test_model.py -p no:cacheprovider > "$OUT/gpu_tests_72.txt" 2>&1
  grep -E "passed|failed|FAILED" "$OUT/gpu_tests_72.txt" | tail -8
  for model in 7b 32b; do timeout 100 python3 experiments/bench_kernels.py --models=$model --kinds=fwd --ms=64,128,256 \
    --ragged=false --json="$OUT/bench_kernels_$model.json" 2>&1 | grep "|"; done
  timeout 200 python3 experiments/bench_rollout.py --batches=64,128 --new_tokens=2048 --formats=nvfp4_fused,bf16_fused \
    --time_budget_s=170 --out="$OUT/issue6" > "$OUT/issue6.log" 2>&1; grep "|\|x$" "$OUT/issue6.log"; } | tee "$OUT/step72.txt"
#    Session 53 (H100): 116 passed; bench_kernels 7B 1.99x / 1.65x / 1.12x and 32B 2.02x / 1.63x / 1.10x of bf16 at
#    M = 64 / 128 / 256; issue 6 1.37x / 1.17x at batch 64 / 128.
# 73 (session 53; about 3 minutes): the paired decode repaired in registers (DECODE 5: four prmt pair the halves back
#    by K row, so x needs no permute; offline 288 instructions a main loop against 256 with the permute and 360
#    unpaired). Its GPU tests, the harness against the unpaired and the permuted forms at M = 64, 128 and 2048, then
#    batch-64 rollouts with each form on the narrow tiles. Session 53 (H100; the settings then were PAIRED_MAX_M and
#    PAIRED_REPAIR, renamed below): 18 passed; 7B summed at M = 64 1.566x of bf16 repaired, 1.553x permuted, 1.490x
#    unpaired, at 128 1.300x / 1.279x / 1.211x, at 2048 1.003x / 0.989x / 0.988x, but the fused gate/up faster
#    permuted (51.1 against 52.8 us at M = 64), and batch-64 steps 4.332 / 4.314 ms repaired against 4.252 / 4.285
#    permuted. So the narrow tiles keep the permuted form (NARROW_DECODE 4), the wide ones take the repaired one
#    (WIDE_DECODE 5).
step 73 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 python3 -m pytest -q -n 10 -m gpu tests/test_gluon_mm.py \
    -k "paired" -p no:cacheprovider 2>&1 | tail -2
  MM_ORDER=decode MM_MS=64,128,2048 MM_VARIANTS="base:NARROW_DECODE=2,WIDE_DECODE=2;p4:DECODE=4;p5:DECODE=5" \
    timeout 120 python3 experiments/lab/time_mm.py 2>&1 | grep -v Warn
  for s in "NARROW_DECODE=4" "NARROW_DECODE=5" ; do echo "== w4_gluon_mm $s"
    MM_SET="$s" timeout 80 python3 experiments/lab/gluon/ab_rollout.py --batches=64 --new_tokens=256 \
      --formats=nvfp4_fused --time_budget_s=50 2>&1 | grep "nvfp4_fused |"; done; } | tee "$OUT/step73.txt"
# 74 (session 53, prepared; about 6 minutes, for an H200): the wide tiles' repaired decode on the H200 (M = 256-4096,
#    7B and 32B, against the unpaired form), then issue 6's batch-256 row and issue 4's table at M = 64-2048 under
#    the session's defaults.
step 74 && { for model in 7b 32b; do MM_MODEL=$model MM_ORDER=decode MM_MS=256,2048,4096 \
    MM_VARIANTS="base:WIDE_DECODE=2;p5" timeout 120 python3 experiments/lab/time_mm.py 2>&1 | grep summed; done
  for model in 7b 32b; do timeout 100 python3 experiments/bench_kernels.py --models=$model --kinds=fwd \
    --ms=64,128,256,2048 --ragged=false --json="$OUT/bench_kernels_$model.json" 2>&1 | grep "|"; done
  timeout 120 python3 experiments/bench_rollout.py --batches=256 --new_tokens=1024 --formats=nvfp4_fused,bf16_fused \
    --time_budget_s=100 2>&1 | grep "|\|x$"; } | tee "$OUT/step74.txt"
#    Session 54 (an H100 came; raw docs/bench_runs/session54_step74_h100.txt): the repaired form ahead at every wide
#    row (7B 0.889x -> 0.927x / 0.985x -> 1.001x / 0.956x -> 0.980x of bf16 at M = 256 / 2048 / 4096, 32B 0.996x ->
#    1.029x / 0.970x -> 1.012x / 0.945x -> 0.970x); bench_kernels 7B 1.98x / 1.64x / 1.17x / 1.00x, 32B 2.02x /
#    1.61x / 1.15x / 1.02x at M = 64 / 128 / 256 / 2048; batch 256 1.03x (11.640 against 11.840 ms a step).
# 75 (session 54, prepared; about 7 minutes): issue 4's whole table under the final defaults (forward M = 1-2048, dx
#    at 2048; M = 8192 runs dequantize + cuBLAS, unchanged since session 50), then issue 6's batch-256 row. On an
#    H200 this replaces session 50's table; on an H100 it completes session 54's.
step 75 && { for model in 7b 32b; do timeout 150 python3 experiments/bench_kernels.py --models=$model --kinds=fwd,dx \
    --ms=1,8,32,64,128,256,2048 --dx_ms=2048 --ragged=false --json="$OUT/bench_kernels_$model.json" 2>&1 | grep "|"; done
  timeout 120 python3 experiments/bench_rollout.py --batches=256 --new_tokens=1024 --formats=nvfp4_fused,bf16_fused \
    --time_budget_s=100 --out="$OUT/issue6" > "$OUT/issue6.log" 2>&1; grep "|\|x$" "$OUT/issue6.log"; } \
  | tee "$OUT/step75.txt"
#    Session 54 (an H100 came; raw docs/bench_runs/session54_step75_*): 7B 3.13x / 3.08x / 2.07x / 2.00x / 1.64x /
#    1.15x / 1.00x of bf16 at M = 1-2048 (dx 0.95x), 32B 2.78x / 2.74x / 1.86x / 2.04x / 1.62x / 1.14x / 1.02x (dx
#    0.95x); batch 256 1.01x. Still to run on an H200. Session 55 re-ran it on an H100 under the new defaults (7B
#    3.05x / ... at M = 1) and found those ratios flattered by the shared x (step 79); bench_kernels.py now gives
#    each weight copy its own x, so this step on an H200 gives the corrected table.
# 76 (session 54, prepared; about 6 minutes): the launcher's zero_results as a bitmask and w4_gluon_mm.TAIL_MEMSET
#    (the split-K tail zeroed by a memset node instead of XLA's copy of one zero buffer; a batch-128 step's profile
#    on an H100 had 3 such copies a layer, memcpy128, 3.5 us each), and NARROW_REPAIR_MAX_N (narrow tiles of at most
#    that many columns, o and down, take the repaired form, so x's permute, its own XLA kernel after attention and
#    after SwiGLU, 1.8 and 4.0 us a layer at batch 128, goes). The Gluon GEMV's and GEMM's GPU tests (the GEMV's
#    atomic builds take their memset through the same bitmask, bit 0), then the harness with each at M = 64-2048.
step 76 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 280 python3 -m pytest -q -n 10 -m gpu tests/test_gluon.py \
    tests/test_gluon_mm.py -p no:cacheprovider > "$OUT/gpu_tests_76.txt" 2>&1
  grep -E "passed|failed|FAILED" "$OUT/gpu_tests_76.txt" | tail -8
  MM_ORDER=decode MM_MS=64,128,256,2048 MM_VARIANTS="base;tm:TAIL_MEMSET=1;nr:NARROW_REPAIR_MAX_N=8192;both:TAIL_MEMSET=1,NARROW_REPAIR_MAX_N=8192" \
    timeout 150 python3 experiments/lab/time_mm.py 2>&1 | grep -v Warn; } | tee "$OUT/step76.txt"
#    Session 55 ran it (H100; raw docs/bench_runs/session55_step76.txt): 546 GPU tests passed, 1 failed (the lab
#    WS_STAGES build at M = 16, step 78); 7B summed M = 64 1.493x -> 1.526x (tm) / 1.534x (nr) / 1.564x (both) of
#    bf16, M = 128 1.317x -> 1.356x (both), M = 256 and 2048 unchanged. Both are the defaults since.
# 77 (session 54, prepared; about 7 minutes): the same two settings in rollouts, batch 64 and 128, 512 new tokens,
#    alternating (twice each).
step 77 && for s in "" "TAIL_MEMSET=1" "TAIL_MEMSET=1,NARROW_REPAIR_MAX_N=8192" "" "TAIL_MEMSET=1" \
    "TAIL_MEMSET=1,NARROW_REPAIR_MAX_N=8192"; do echo "== w4_gluon_mm ${s:-defaults}"
  MM_SET="$s" timeout 68 python3 experiments/lab/gluon/ab_rollout.py --batches=64,128 --new_tokens=512 \
    --formats=nvfp4_fused --time_budget_s=45 2>&1 | grep "nvfp4_fused |"; done | tee "$OUT/step77.txt"
#    Session 55 ran it (H100): decode steps 4.472 / 4.477 -> 4.440 / 4.434 ms at batch 64 and 6.348 / 6.339 ->
#    6.250 / 6.236 at 128 with both settings (TAIL_MEMSET alone about half of that).
# 78 (session 55; about 2 minutes): the lab WS_STAGES GEMV builds' test at K = 18944, N = 3584 three times (session 55's
#    step 76 had [18944-3584-16-1], one buffer at M = 16 in a 2-layer stack, at relative error 4.5e-3 against float64
#    on an H100, where session 54's whole suite had passed it): whether it fails every time or now and then.
step 78 && for r in 1 2 3; do XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 python3 -m pytest -q -n 10 -m gpu \
    tests/test_gluon.py -k "warp_specialized_build_matches_float64 and 18944-3584" -p no:cacheprovider 2>&1 \
    | grep -E "passed|failed|FAILED|Error:" | tail -6; done | tee "$OUT/step78.txt"
#    Session 55 ran it with step 1 (618 passed): 15 passed, 15 passed, 2 failed (M = 16, 1 and 2 buffers); _build
#    now refuses WS_STAGES at M 9-16 (w4_gluon.WS_MAX_M).
# 79 (session 55; about 5 minutes): issue 4's whole table again with bench_kernels.py giving each weight copy its own
#    x (step 75 under the new defaults had the o / down / q/k/v rows at M = 64-128 slower than session 54's, where
#    one x shared by the R copies let XLA run form 4's x permute once for all R), then M = 64 and 128 with
#    NARROW_REPAIR_MAX_N = 0 (form 4 for every narrow tile) in the same call.
step 79 && { for model in 7b 32b; do timeout 150 python3 experiments/bench_kernels.py --models=$model --kinds=fwd,dx \
    --ms=1,8,32,64,128,256,2048 --dx_ms=2048 --ragged=false --json="$OUT/bench_kernels_$model.json" 2>&1 | grep "|"; done
  for model in 7b 32b; do echo "== NARROW_REPAIR_MAX_N=0 $model"; timeout 80 python3 -c "
import runpy, sys; sys.path.insert(0, 'experiments')
from pallas_kernels import w4_gluon_mm
w4_gluon_mm.NARROW_REPAIR_MAX_N = 0
sys.argv = ['bench_kernels.py', '--models=$model', '--kinds=fwd', '--ms=64,128', '--ragged=false',
            '--json=$OUT/bench_kernels_nr0_$model.json']
runpy.run_path('experiments/bench_kernels.py', run_name='__main__')" 2>&1 | grep "|"; done; } | tee "$OUT/step79.txt"
#    Session 55 ran it (H100; raw docs/bench_runs/session55_step79_*): 7B 2.39x / 2.35x / 1.58x / 1.47x / 1.17x /
#    0.87x / 1.00x at M = 1-2048 (dx 0.95x), 32B 2.37x / 2.36x / 1.60x / 1.65x / 1.34x / 1.01x / 1.02x (dx 0.96x);
#    NARROW_REPAIR_MAX_N=0 7B 1.46x / 1.11x and 32B 1.64x / 1.32x at M = 64 / 128 (default 1.47x / 1.17x, 1.65x / 1.34x).
# 80 (session 55, prepared; about 4 minutes): the small matrices at M = 64-256, where session 55's corrected table has
#    the 7B q/k/v at 0.77x / 0.58x and the o at 0.82x / 0.64x of bf16 (M = 128 / 256). bench_kernels.py (weights
#    rotated, own x: time_mm.py reads one layer of a stack every call, so a 9 MB matrix sits in the L2) for the 7B
#    shapes with the split-K cap at 2, 4 and 8 (the default), then with the narrow 128-row tiles up to M = 256
#    (SMALL_M_MAX = 256).
step 80 && { for s in 2 4 8; do echo "== MAX_SPLITS=$s"; QERL_GLUON_MM_MAX_SPLITS=$s timeout 80 python3 \
    experiments/bench_kernels.py --models=7b --kinds=fwd --ms=64,128,256 --ragged=false 2>&1 | grep "qkv\|  o "; done
  echo "== SMALL_M_MAX=256"; timeout 80 python3 -c "
import runpy, sys; sys.path.insert(0, 'experiments')
from pallas_kernels import w4_gluon_mm
w4_gluon_mm.SMALL_M_MAX = 256
sys.argv = ['bench_kernels.py', '--models=7b', '--kinds=fwd', '--ms=256', '--ragged=false']
runpy.run_path('experiments/bench_kernels.py', run_name='__main__')" 2>&1 | grep "|"; } | tee "$OUT/step80.txt"
#    Session 56 ran it (H100; raw docs/bench_runs/session56_step80_h100.txt): 7B q/k/v / o at M = 64, 128, 256 with
#    MAX_SPLITS 2 / 4 / 8: 13.6 / 13.6 / 13.6, 19.8 / 19.8 / 19.5, 28.7 / 28.7 / 30.4 and 12.9 / 12.9 / 12.9, 19.1 /
#    15.0 / 15.1, 27.4 / 21.8 / 22.1 us (8 stays); SMALL_M_MAX=256 at M = 256: q/k/v 25.6, o 21.3, gate 61.6, down
#    68.4 (against 55.1 / 58.1 on the wide tile), which step 82 followed up.
# 81 (session 55, prepared; about 5 minutes): SamplingConfig.dequantize_max_weights, a dense copy of only the small
#    linears for rollouts of many rows (the 7B q/k/v and o, 1.6 GB in bf16, where session 55's corrected table has
#    them at 0.77x / 0.58x and 0.82x / 0.64x of bf16 at M = 128 / 256): its GPU tests (a mixed base against the same
#    base made by XLA), then batch 128 and 256 rollouts, 512 new tokens, 4-bit throughout against the small linears
#    copied, alternating (twice each).
step 81 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -q -m gpu tests/test_sampling.py \
    -k dequantize -p no:cacheprovider 2>&1 | grep -E "passed|failed|FAILED|Error"
  for d in "" "--dequantize_min_rows=128 --dequantize_max_weights=20000000" "" \
      "--dequantize_min_rows=128 --dequantize_max_weights=20000000"; do echo "== ${d:-4-bit throughout}"
    timeout 90 python3 experiments/bench_rollout.py --batches=128,256 --new_tokens=512 --formats=nvfp4_fused $d \
      --time_budget_s=70 2>&1 | grep "^| nvfp4_fused"; done; } | tee "$OUT/step81.txt"
#    Session 56 ran it on an H100 (raw docs/bench_runs/session56_step81*.txt): 2 GPU tests passed; decode step at
#    batch 128 6.185 / 6.229 ms 4-bit against 6.201 with the copy (none); batch 256 10.407 / 10.431 / 10.425 against
#    9.835 / 9.833 (5.7% faster, 1.6 GB more). Its grep then missed the copy's rows (labelled "nvfp4_fused (bf16
#    copy)"); fixed since.
# 82 (session 56; about 8 minutes): w4_gluon_mm.NARROW_SMALL_WIDE_MAX_M = 256 (lab; off by default since this
#    step), small weights (the 7B q/k/v and o) on the 128-row narrow tile at 64 < M <= 256 (step 80's SMALL_M_MAX=256
#    run had them 5.4 and 1.1 us faster at M = 256, H100), and SMALL_WEIGHT_ROWS = 64 (64-row tiles there): their GPU
#    tests, the harness at M = 128-256 for 7B (off, on, 64-row, every weight narrow), batch-128 and 256 rollouts (512
#    new tokens) under each, then the 32B harness.
step 82 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -q -n 10 -m gpu tests/test_gluon_mm.py \
    -k "small_weight_at_256 or narrow_tile or dx_build or split_k" -p no:cacheprovider 2>&1 | grep -E "passed|failed|FAILED"
  v="base;on:NARROW_SMALL_WIDE_MAX_M=256;r64:NARROW_SMALL_WIDE_MAX_M=256,SMALL_WEIGHT_ROWS=64;all:SMALL_M_MAX=256"
  MM_ORDER=decode MM_MS=128,192,256 MM_VARIANTS="$v" timeout 110 python3 experiments/lab/time_mm.py 2>&1 | grep -v Warn
  for s in "NARROW_SMALL_WIDE_MAX_M=256" "" "NARROW_SMALL_WIDE_MAX_M=256,SMALL_WEIGHT_ROWS=64"; do
    echo "== w4_gluon_mm ${s:-defaults}"
    MM_SET="$s" timeout 75 python3 experiments/lab/gluon/ab_rollout.py --batches=128,256 --new_tokens=512 \
      --formats=nvfp4_fused --time_budget_s=60 2>&1 | grep "nvfp4_fused"; done
  MM_MODEL=32b MM_ORDER=decode MM_MS=128,256 MM_VARIANTS="$v" timeout 110 python3 experiments/lab/time_mm.py 2>&1 \
    | grep -v Warn; } | tee "$OUT/step82.txt"
#    Session 56 ran it while the setting's default was 256 (its "base" then is "on" now and "off" the default; H100;
#    raw docs/bench_runs/session56_step82*_h100.txt): 47 GPU tests passed; 7B summed at M = 256 211.6 -> 206.8 us
#    (q/k/v 30.1 -> 26.2, o 22.1 -> 21.4), 192 199.4 -> 198.6, 64-row tiles better only at 192; batch-256 steps
#    10.368 both (then 10.393 / 10.385 on against 10.362 / 10.327 off, and 11.170 with every weight narrow); hence
#    off.
# 83 (session 56, prepared; about 4 minutes): why step 82's kernel-level gain (the 7B q/k/v and o on the 128-row
#    tile at M = 256, 4.6 us a layer in time_mm.py) did not reach batch-256 decode steps: per-kernel device time of
#    a batch-256 rollout (64 new tokens) with NARROW_SMALL_WIDE_MAX_M at 0 (the default) and 256, each kernel's
#    median by call position within a layer.
step 83 && for s in "" "NARROW_SMALL_WIDE_MAX_M=256"; do echo "== w4_gluon_mm ${s:-defaults}"
  PROFILE_MM_SET="$s" PROFILE_POSITIONS=1 PROFILE_TOP=25 OUT="$OUT" timeout 110 python3 \
    experiments/lab/profile_rollout.py nvfp4_fused:256:64 2>&1 | grep -v "Warn\|I1206\|profiler.py"; done \
  | tee "$OUT/step83.txt"
#    Session 57 ran it on an H100 (raw docs/bench_runs/session57_step83_h100.txt): the three w4a16_mm calls a layer
#    are o, gate/up and down (18.7 / 96.6 / 56.1 us); q/k/v never reach the Gluon GEMM at 256 rows, because the fused
#    decode attention asks for float32 q/k/v, which it does not write: they run on dequantize (w4_dequantize_decode_order,
#    15.8 us) + cuBLAS (20.6 us) in every layer and step. So NARROW_SMALL_WIDE_MAX_M, which moves q/k/v's tile, could
#    only change o (18.7 -> 18.2 us). Hence decoder.FUSED_ATTENTION_BF16_QKV (step 84).
# 84 (session 57, prepared; about 5 minutes): decoder.FUSED_ATTENTION_BF16_QKV = 1 (lab, off): a fused-attention decode
#    step past the shared buffer takes q/k/v in bf16 from the large-M route (the Gluon GEMM, bias in its epilogue).
#    Its GPU test and the bf16 route's, then batch-128 and 256 rollouts on / off / on / off (512 new tokens), then a
#    batch-256 profile with it on (q/k/v should appear as a fourth w4a16_mm call a layer, the dequantize gone).
step 84 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python3 -m pytest -q -n 4 -m gpu tests/test_sampling.py \
    tests/test_model.py -k "bf16_qkv or bf16_route or narrow_route" -p no:cacheprovider 2>&1 | grep -E "passed|failed|FAILED"
  for s in "FUSED_ATTENTION_BF16_QKV=1" "" "FUSED_ATTENTION_BF16_QKV=1" ""; do echo "== decoder ${s:-defaults}"
    MODEL_SET="$s" timeout 75 python3 experiments/lab/gluon/ab_rollout.py --batches=128,256 --new_tokens=512 \
      --formats=nvfp4_fused --time_budget_s=60 2>&1 | grep "nvfp4_fused"; done
  PROFILE_MODEL_SET="FUSED_ATTENTION_BF16_QKV=1" PROFILE_POSITIONS=1 PROFILE_TOP=12 OUT="$OUT" timeout 110 python3 \
    experiments/lab/profile_rollout.py nvfp4_fused:256:64 2>&1 | grep -v "Warn\|I1206\|profiler.py"; } \
  | tee "$OUT/step84.txt"
#    Session 58 (an H100; raw docs/bench_runs/session58_step84_h100.txt): GPU tests 5 passed; batch 128 on 6.276 /
#    6.288 ms a step, off 6.176 / 6.200 (the GEMV's f32 builds beat the narrow tiles there); batch 256 on 10.232 /
#    10.231, off 10.319 / 10.362; the profile's q/k/v 26.7 us in the Gluon GEMM (was 15.8 + 20.6). Hence on by
#    default from 129 rows (decoder.FUSED_ATTENTION_BF16_QKV_MIN_ROWS).
# 85 (session 58; about 8 minutes): the whole GPU suite under the new defaults (bf16 q/k/v from 129 rows), then
#    w4_gluon_mm.NARROW_SMALL_WIDE_MAX_M = 256 again, now that the 7B q/k/v reach the Gluon GEMM in a rollout
#    (session 56's harness had them 30.1 -> 26.2 us at M = 256): batch-256 rollouts on / off / on / off.
step 85 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 330 python3 -m pytest -q -n 10 -m gpu tests -p no:cacheprovider \
    2>&1 | grep -v "Benchmark\|warner(" | grep -E "passed|failed|FAILED|Error" | tail -8
  for s in "NARROW_SMALL_WIDE_MAX_M=256" "" "NARROW_SMALL_WIDE_MAX_M=256" ""; do echo "== w4_gluon_mm ${s:-defaults}"
    MM_SET="$s" timeout 60 python3 experiments/lab/gluon/ab_rollout.py --batches=256 --new_tokens=512 \
      --formats=nvfp4_fused --time_budget_s=50 2>&1 | grep "^| nvfp4_fused"; done; } | tee "$OUT/step85.txt"
#    Session 58 (an H100; raw docs/bench_runs/session58_step85_h100.txt): 625 passed; batch 256 with 256 10.120 /
#    10.151 ms a step, at 0 10.162 / 10.139: noise, NARROW_SMALL_WIDE_MAX_M stays 0.
# 86 (session 58; removed): meant to time the bf16 q/k/v gate at 129-255 rows with batch-160 rollouts. It failed
#    on an H100 in bench_rollout.py's own check (the padding rows' tokens and mask; fixed since), and it could not
#    have timed the gate: sampling.generate pads a batch to a power of two, so a 160-row batch decodes 256 rows, and
#    decode steps see 129-255 rows only through lower-level calls.
# 87 (session 59; about 2 minutes): what programmatic dependent launch would buy a batch-8 decode step
#    (experiments/lab/pdl_probe.py; w4_gluon's and residual_norm's lab constexpr GDC): the library's M = 8 GEMV
#    builds launched by Triton from PyTorch in CUDA graphs, 28 layers, with and without PDL: the 7B GEMV chain alone,
#    then a decode layer's sequence (q/k/v, attention stand-in, o, post-attention norm, gate/up, SwiGLU stand-in,
#    down, layer-end norm), base and PDL alternating.
step 87 && XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 experiments/lab/pdl_probe.py 2>&1 | grep -v Warn \
  | tee "$OUT/step87.txt"
#    Session 59 ran the GEMV-chain table on an H100 (raw docs/bench_runs/session59_pdl_probe_h100.txt): 57.47 us a
#    layer without PDL, 53.92 with the weights-first wait and an early trigger (-3.5 us, 6.6%), no gain without the
#    trigger; then on a second H100 call (raw session59_pdl_probe_layer_h100.txt) the chain 58.73 -> 54.29 and the
#    decode layer's sequence 152.67 / 152.82 -> 147.87 / 147.89 us a layer (4.8 us, the four Gluon boundaries).
#    Still to run on an H200.
# 88 (session 59, prepared; about 1 minute): w4_gluon.chain_call (lab), several Gluon kernels launched by one FFI call
#    (gluon_launch.cc's qerl_gluon_chain), the first step towards PDL inside a decode step: its GPU test (the M = 8
#    GEMV then the residual-norm kernel, with and without PDL, against the separate calls).
step 88 && XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python3 -m pytest -q -m gpu tests/test_gluon.py -k chain_call \
  -p no:cacheprovider 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -8 | tee "$OUT/step88.txt"
# 89 (session 60, prepared; about 7 minutes): decoder.PDL_CHAIN (lab), a decode layer after attention as one FFI call
#    of six Gluon kernels (pallas_kernels.decode_chain: o, post-attention norm, gate/up, SwiGLU, down, layer-end norm)
#    joined by PDL (3: and the next layer's q/k/v as a seventh): its GPU tests and step 88's, then batch-8 rollouts
#    (512 new tokens): the chain off (0), with PDL (1), with the next q/k/v (3), without PDL (2).
step 89 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 140 python3 -m pytest -q -m gpu tests/test_decode_chain.py \
    tests/test_gluon.py::test_chain_call_runs_the_gemv_then_the_norm_as_the_separate_calls -p no:cacheprovider 2>&1 \
    | grep -E "passed|failed|FAILED|Error|assert" | grep -v cuda_event | tail -12
  for s in ${CHAIN_SETTINGS:-0 1 3 2}; do echo "== PDL_CHAIN=$s"; MODEL_SET="PDL_CHAIN=$s" timeout 90 python3 \
    experiments/lab/gluon/ab_rollout.py --batches=8 --new_tokens=512 --formats=nvfp4_fused --time_budget_s=50 2>&1 \
    | grep -E "nvfp4_fused \||Error"; done; } | tee "$OUT/step89.txt"
# 90 (session 60, prepared; about 6 minutes): step 89's rollouts again, alternating 0 / 1 / 3 twice.
#    Session 60 ran it on an H100 (raw docs/bench_runs/session60_step89_h100.txt): the GPU tests pass (after a fix to
#    the test's own SwiGLU); decode steps 2.425 (0) / 2.348 (1) / 2.315 (3) / 2.446 (2) ms.
step 90 && for s in 0 1 3 0 1 3; do echo "== PDL_CHAIN=$s"; MODEL_SET="PDL_CHAIN=$s" timeout 90 python3 \
    experiments/lab/gluon/ab_rollout.py --batches=8 --new_tokens=512 --formats=nvfp4_fused --time_budget_s=50 2>&1 \
    | grep -E "nvfp4_fused \||Error"; done | tee "$OUT/step90.txt"
# 91 (session 60, prepared; about 4 minutes): issue 6's batch-8 row (2048 new tokens, NVFP4 and bf16 in the same run)
#    with decoder.PDL_CHAIN = 0 and 3, alternating twice.
#    Session 60 (H100): 2.434 / 2.436 (0), 2.353 / 2.344 (1), 2.325 / 2.321 (3) ms.
step 91 && for s in 0 3 0 3; do echo "== PDL_CHAIN=$s"; MODEL_SET="PDL_CHAIN=$s" timeout 120 python3 \
    experiments/lab/gluon/ab_rollout.py --batches=8 --new_tokens=2048 --formats=nvfp4_fused,bf16_fused 2>&1 \
    | grep -E "_fused \||Error"; done | tee "$OUT/step91.txt"
#    Session 60 ran it on an H100: NVFP4 2.594 / 2.594 ms (0) against 2.473 / 2.473 (3), bf16 5.70: 2.19x -> 2.29x;
#    PDL_CHAIN = 3 is the default since. Still to run on an H200 (issue 6's card; last measured 1.95x, session 53).
# 92 (session 63, prepared; about 6 minutes): pallas_kernels.append_attention, decode attention with the cache
#    append written in Triton for the PDL chain: its GPU tests against XLA's reference and the chain's tests
#    (PDL_CHAIN = 4 and 5 among them), then issue 6's batch-8 row (2048 new tokens, NVFP4 and bf16 in the same run)
#    with decoder.PDL_CHAIN = 3, 4 (the next layer's attention in the chain) and 5 (every layer in one call).
step 92 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -q -m gpu tests/test_append_attention.py \
    tests/test_decode_chain.py -p no:cacheprovider 2>&1 | grep -E "passed|failed|FAILED|Error|assert" \
    | grep -v cuda_event | tail -12
  CHAIN_SETTINGS="3 4 5" STEPS=93 bash "$0"; } | tee "$OUT/step92.txt"
# 93 (session 63, prepared; about 6 minutes): issue 6's batch-8 row (2048 new tokens, NVFP4 and bf16 in the same run)
#    with decoder.PDL_CHAIN = 3, 4 and 5, alternating.
step 93 && for c in ${CHAIN_SETTINGS:-3 4 5 3 4 5}; do echo "== PDL_CHAIN=$c"; MODEL_SET="PDL_CHAIN=$c" timeout 120 \
    python3 experiments/lab/gluon/ab_rollout.py --batches=8 --new_tokens=2048 --formats=nvfp4_fused,bf16_fused 2>&1 \
    | grep -E "_fused \||Error"; done | tee "$OUT/step93.txt"
# 94 (session 63, prepared; about 6 minutes): step 92 on an H100 found the Triton attention 9% slower in a batch-8 step
#    (PDL_CHAIN = 4: 2.686 against 2.467 ms; 5: 2.648) and its cache slot not equal to XLA's bit for bit. Where the
#    cache and output differ (append_diag.py), the kernel alone against the Pallas one under the new default
#    PREFETCH = 0 (the loads in the loop: 156 registers against 210, offline) and the old form (28 layers in one jit,
#    batch 8, 7B heads, 1300 filled slots; PREFETCH = 2 adds L2 prefetches of the first block before the PDL wait),
#    then issue 6's batch-8 row with PDL_CHAIN = 3 and 5, and 5 with PREFETCH = 2 (NVFP4 only).
step 94 && { timeout 100 python3 experiments/lab/append_diag.py 2>&1 | grep -E "^length|first|Error"
  APPEND_BATCHES=8 APPEND_LENGTH=1300 APPEND_VARIANTS="merge;tl;tl p2" timeout 90 python3 \
    experiments/lab/time_append.py 2>&1 | grep -E "^batch|Error"
  CHAIN_SETTINGS="3 5" STEPS=93 bash "$0"
  echo "== PDL_CHAIN=5 PREFETCH=2"; MODEL_SET="PDL_CHAIN=5" AA_SET="PREFETCH=2" timeout 100 python3 \
    experiments/lab/gluon/ab_rollout.py --batches=8 --new_tokens=2048 --formats=nvfp4_fused 2>&1 \
    | grep -E "_fused \||Error"; } | tee "$OUT/step94.txt"
# 95 (session 63, prepared; about 2 minutes): step 94 (H100) found the new keys 1 ulp from XLA's in about a fifth of
#    their values (RoPE's rounding) and the kernel alone 532 against the Pallas kernel's 397 us for 28 layers (1300
#    slots); PDL_CHAIN = 5 2.680 ms a batch-8 step against 3's 2.428. Again with RoPE rounded by the bits and int32
#    cache offsets.
step 95 && { timeout 100 python3 experiments/lab/append_diag.py 2>&1 | grep -E "^length|first|Error"
  APPEND_BATCHES=8 APPEND_LENGTH=1300 APPEND_VARIANTS="merge;tl" timeout 90 python3 \
    experiments/lab/time_append.py 2>&1 | grep -E "^batch|Error"; } | tee "$OUT/step95.txt"
# 96 (session 63, prepared; about 6 minutes): the chain's GPU tests (PDL_CHAIN = 5 with append_attention.FORM =
#    "pallas" among them: the Pallas attention's own build, captured from its lowering, in decode_layers' call), then
#    issue 6's batch-8 row with PDL_CHAIN = 3 and with 5 + FORM "pallas", alternating. If the captured build runs as
#    the Pallas kernel does, 5 saves the graph-node boundaries (about 1.4 us a layer on an H100, step 92).
step 96 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -q -m gpu tests/test_decode_chain.py \
    tests/test_append_attention.py -p no:cacheprovider 2>&1 | grep -E "passed|failed|FAILED|Error|assert" \
    | grep -v cuda_event | tail -12
  for c in 3 5 3 5; do echo "== PDL_CHAIN=$c FORM=pallas"; MODEL_SET="PDL_CHAIN=$c" AA_SET="FORM=pallas" timeout 120 \
    python3 experiments/lab/gluon/ab_rollout.py --batches=8 --new_tokens=2048 --formats=nvfp4_fused,bf16_fused 2>&1 \
    | grep -E "_fused \||Error"; done; } | tee "$OUT/step96.txt"
# 97 (session 64, run at commit 35e9895; its QERL_GLUON_CARVEOUT knob is gone since 7a64d0e; raw
#    docs/bench_runs/session64_step97_h100.txt): step 96 (H100) found PDL_CHAIN = 5 with FORM = "pallas" as slow as with
#    the Triton kernel (2.716 against 2.413 ms for 3): the same code is slower launched by the FFI launcher than by
#    XLA. The kernel alone by XLA ("merge"), by the launcher ("tl", "pl": the Pallas build), then the same with the
#    launcher's kernels preferring the largest shared-memory carveout (QERL_GLUON_CARVEOUT=100), then issue 6's
#    batch-8 row (NVFP4 only) with PDL_CHAIN = 3 and 5 + FORM "pallas" under that carveout; first step 95's check
#    of the Triton kernel's bit rounding.
step 97 && { timeout 100 python3 experiments/lab/append_diag.py 2>&1 | grep -E "^length|first|Error"
  for c in "" 100; do echo "== QERL_GLUON_CARVEOUT=$c"; QERL_GLUON_CARVEOUT=$c APPEND_BATCHES=8 APPEND_LENGTH=1300 \
    APPEND_VARIANTS="merge;tl;pl" timeout 100 python3 experiments/lab/time_append.py 2>&1 | grep -E "^batch|Error"; done
  for c in 3 5; do echo "== PDL_CHAIN=$c FORM=pallas QERL_GLUON_CARVEOUT=100"; QERL_GLUON_CARVEOUT=100 \
    MODEL_SET="PDL_CHAIN=$c" AA_SET="FORM=pallas" timeout 100 python3 experiments/lab/gluon/ab_rollout.py --batches=8 \
    --new_tokens=2048 --formats=nvfp4_fused 2>&1 | grep -E "_fused \||Error"; done; } | tee "$OUT/step97.txt"
# 98 (session 64, run at commit 863dade; w4_gluon.IMAGE is gone since 7a64d0e; raw
#    docs/bench_runs/session64_step98_h100.txt): step 97 (H100) found the Pallas attention's own build 546 us for 28
#    layers launched by the FFI launcher against 397 launched by XLA, with or without the largest shared-memory
#    carveout (which slowed the chained GEMVs: 2.681 ms a batch-8 step). The launcher hands the driver PTX, which its
#    JIT compiles; XLA and Triton load a cubin built by ptxas. The kernel alone with the launcher loading Triton's
#    cubins (w4_gluon.IMAGE = "cubin"), then issue 6's batch-8 row with PDL_CHAIN = 3 (PTX, cubins) and 5 + FORM
#    "pallas" (cubins).
step 98 && { nvidia-smi --query-gpu=driver_version --format=csv,noheader
  "$(python3 -c 'import triton, os; print(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas"))')" \
    --version | tail -1
  for image in ptx cubin; do echo "== QERL_GLUON_IMAGE=$image"; QERL_GLUON_IMAGE=$image APPEND_BATCHES=8 \
    APPEND_LENGTH=1300 APPEND_VARIANTS="merge;tl;pl" timeout 100 python3 experiments/lab/time_append.py 2>&1 \
    | grep -E "^batch|Error"; done
  for run in "ptx 3" "cubin 3" "cubin 5"; do set -- $run; echo "== QERL_GLUON_IMAGE=$1 PDL_CHAIN=$2 FORM=pallas"
    QERL_GLUON_IMAGE=$1 MODEL_SET="PDL_CHAIN=$2" AA_SET="FORM=pallas" timeout 110 python3 \
    experiments/lab/gluon/ab_rollout.py --batches=8 --new_tokens=2048 --formats=nvfp4_fused,bf16_fused 2>&1 \
    | grep -E "_fused \||Error"; done; } | tee "$OUT/step98.txt"
# 99 (session 64, run): step 98 (H100) found the launcher's loading of cubins changes nothing (the Pallas build 549
#    us launched by it, 394 by XLA). XLA's launch of it (its thunk sequence): grid 8 x 4 x 12, 128 threads, 38912
#    shared bytes, as ours. Its build could not be taken out of XLA (no PTX in the dump under jax 0.11.2; the
#    serialized executable holds the cubin compressed).
# 100 (session 64, run; raw docs/bench_runs/session64_step100_h100.txt: merge 393.4, pl 549.4, p6 549.1, p9 411.1 us): the Pallas attention's Triton IR (captured here under jax 0.10.2,
#    .lab/pallas_attn.ttir) built offline as cubins by Triton 3.6 (.lab/attn36.cubin, 152 registers, 35 barriers)
#    and Triton 3.9 (.lab/attn39.cubin, 130 registers, 22 barriers), each launched by the FFI launcher, against
#    XLA's launch ("merge") and the launcher's own 3.6 build ("pl"). Carry .lab.
step 100 && APPEND_CUBINS="p6=.lab/attn36.cubin,p9=.lab/attn39.cubin" APPEND_BATCHES=8 APPEND_LENGTH=1300 \
    APPEND_VARIANTS="merge;pl;p6;p9" timeout 150 python3 experiments/lab/time_append.py 2>&1 \
    | grep -E "^batch|Error" | tee "$OUT/step100.txt"
# 101 (session 64, run; raw docs/bench_runs/session64_step101_h100.txt: every setting slower than the default, 520 us): Triton 3.6 builds the chained attention slowly (step 100); do other
#    launch settings of the `tl` kernel build better? Its sweep alone (28 layers, batch 8, 1300 slots: 8 warps, 32-slot
#    blocks, 3 stages, 1056 programs), then, where the best is under 450 us, issue 6's batch-8 row (NVFP4 only) with
#    PDL_CHAIN = 3 and 5 under that setting.
step 101 && { APPEND_BATCHES=8 APPEND_LENGTH=1300 APPEND_VARIANTS="merge;tl;tl w8;tl b32;tl s3;tl t1056" timeout 100 \
    python3 experiments/lab/time_append.py 2>&1 | grep -E "^batch|Error" | tee "$OUT/tl_sweep.txt"
  best=$(grep "^batch.* tl" "$OUT/tl_sweep.txt" | awk '{for (i = 1; i <= NF; i++) if ($i == "kernels") print $(i + 1), $5, $6}' \
    | sort -n | head -1)
  set -- $best; declare -A knob=([w8]=WARPS=8 [b32]=BLOCK_S=32 [s3]=STAGES=3 [t1056]=TARGET_PROGRAMS=1056)
  echo "best tl: $best"
  if [ -n "$1" ] && [ "${1%.*}" -lt 450 ]; then for c in 3 5; do echo "== PDL_CHAIN=$c AA_SET=${knob[$3]:-}"
    MODEL_SET="PDL_CHAIN=$c" AA_SET="${knob[$3]:-}" timeout 100 python3 experiments/lab/gluon/ab_rollout.py --batches=8 \
    --new_tokens=2048 --formats=nvfp4_fused 2>&1 | grep -E "_fused \||Error"; done; fi; } | tee "$OUT/step101.txt"
# 102 (session 64, run at commit 838ac04, whose MERGE switch and "tl m0" are gone since: the kernel keeps MERGE 1; raw docs/bench_runs/session64_step102_h100.txt: tests passed; tl 409.5, tl m0 524.0, merge
#    389.1 us; PDL_CHAIN 3 2.422, 5 2.557 ms, 5 with the attention's GDC = 1 2.566): offline (sm_90, Triton 3.6) the slow part of the tl attention's build
#    is after its main loop: the merge of the splits' partials, reduced over a chunk of them ([8, rows, hd]), lowered
#    through shared memory (92 shared loads, 90 stores, 77 shuffles, 22 barriers; 158 registers). append_attention.MERGE
#    = 1 merges partial by partial, elementwise: 10, 6, 5 and 6 of them, 96 registers. Its GPU tests, the kernel alone
#    (MERGE 1 "tl", MERGE 0 "tl m0", XLA's Pallas "merge"), then issue 6's batch-8 row (NVFP4 only) with PDL_CHAIN 3
#    and 5.
step 102 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 python3 -m pytest -q -m gpu tests/test_append_attention.py \
    -p no:cacheprovider 2>&1 | grep -E "passed|failed|FAILED|Error|assert" | tail -4
  APPEND_BATCHES=8 APPEND_LENGTH=1300 APPEND_VARIANTS="merge;tl;tl m0" timeout 100 python3 \
    experiments/lab/time_append.py 2>&1 | grep -E "^batch|Error"
  for c in 3 5; do echo "== PDL_CHAIN=$c"; MODEL_SET="PDL_CHAIN=$c" timeout 100 python3 \
    experiments/lab/gluon/ab_rollout.py --batches=8 --new_tokens=2048 --formats=nvfp4_fused 2>&1 \
    | grep -E "_fused \||Error"; done; } | tee "$OUT/step102.txt"
# 103 (session 64, prepared; about 5 minutes): step 102 (H100) brought the chained attention alone within 0.7 us a layer
#    of XLA's build, yet PDL_CHAIN = 5 still lost 4.8 us a layer to 3 (2.557 against 2.422 ms), with or without the
#    attention releasing its successor early. Hypothesis: under PDL its 384 programs launch while the q/k/v GEMV
#    still holds SMs, and at 96 registers five fit an SM, so they pile onto the free SMs. append_attention.MIN_SHARED
#    caps the programs an SM (72000 bytes: three, 100000: two); decode_chain.QKV_RELEASES_ATTENTION = 0 launches the
#    attention only as the q/k/v GEMV ends. NVFP4 batch-8 row, alternating.
#    Session 65 (H100): 2.472 / 2.474 ms (3), 2.604 (5), 2.517 (5, no early release), 2.742 / 2.751 (5, 72000 /
#    100000), 2.743; both knobs are gone since (the chain's q/k/v GEMV never releases the attention early), so this
#    step runs only at commit 5023165.
step 103 && for run in "3 0 1" "5 0 1" "5 0 0" "5 72000 1" "5 100000 1" "3 0 1" "5 72000 1"; do set -- $run
    echo "== PDL_CHAIN=$1 MIN_SHARED=$2 QKV_RELEASES_ATTENTION=$3"; MODEL_SET="PDL_CHAIN=$1" AA_SET="MIN_SHARED=$2" \
    DC_SET="QKV_RELEASES_ATTENTION=$3" timeout 100 python3 experiments/lab/gluon/ab_rollout.py --batches=8 \
    --new_tokens=2048 --formats=nvfp4_fused 2>&1 | grep -E "_fused \||Error"; done | tee "$OUT/step103.txt"
# 104 (session 64, prepared; about 3 minutes): where PDL_CHAIN = 5's 4.8 us a layer go, kernel by kernel: a batch-8
#    rollout profile (64 new tokens after a 1300-token prompt, the kernels by device time and by their position in
#    the layer) with PDL_CHAIN = 3 and 5. Under PDL a kernel's time includes its wait for the one before it.
#    Session 65 (H100): under PDL a kernel's profiled time spans its wait, so the figures separate nothing
#    (docs/bench_runs/session65_step104_h100.txt).
step 104 && for c in 3 5; do echo "== PDL_CHAIN=$c"; PROFILE_MODEL_SET="PDL_CHAIN=$c" PROFILE_PROMPT=1300 \
    PROFILE_POSITIONS=1 PROFILE_TOP=16 OUT="$OUT" timeout 150 python3 experiments/lab/profile_rollout.py \
    nvfp4_fused:8:64 2>&1 | grep -v "^[IW][0-9]"; done | tee "$OUT/step104.txt"
# 105 (session 65, prepared; about 7 minutes, for an H200): issue 6's table on its card, in the issue's own script,
#    under the current defaults (PDL_CHAIN = 3): the batch-8 row first (NVFP4 and bf16 in the same run; the last H200
#    figure is 1.95x, session 53, before the chained layer), then batch 64 and 256 (1024 new tokens at 256).
step 105 && { timeout 170 python3 experiments/bench_rollout.py --batches=8 --new_tokens=2048 \
    --formats=nvfp4_fused,bf16_fused --time_budget_s=140 --out="$OUT/issue6_b8" > "$OUT/issue6_b8.log" 2>&1
  grep "|\|x$" "$OUT/issue6_b8.log"
  timeout 250 python3 experiments/bench_rollout.py --batches=64,256 --new_tokens=2048 --new_tokens_by_batch=256:1024 \
    --formats=nvfp4_fused,bf16_fused --time_budget_s=200 --out="$OUT/issue6_b64_256" > "$OUT/issue6_b64_256.log" 2>&1
  grep "|\|x$" "$OUT/issue6_b64_256.log"; } | tee "$OUT/step105.txt"
# 106 (session 66, prepared; about 6 minutes, for an H100 when no H200 comes): the GPU tests of the FFI launcher (its
#    shared-memory opt-in set once, at load, again since session 65), the decode chain (its q/k/v GEMV built without
#    the attention's early release) and the chained attention, which last ran on a GPU before those changes; then
#    issue 6's batch-8 row in the issue's own script (NVFP4 and bf16 in one run), the figure step 105 gives on an H200.
#    Session 66 (H100; raw docs/bench_runs/session66_step106_h100.txt, session66_gpu_tests_h100.txt): the tests, then
#    without the -k selection, ran past their 240 s limit; run alone (75 s), one failed, a stale count of separate
#    calls that the chained layer replaces (pinned to PDL_CHAIN = 0 since, as was a second one the whole suite found:
#    632 GPU tests pass). Batch 8: NVFP4 2.420 ms (74.9% of the roofline), bf16 5.603 ms: 2.30x.
step 106 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_decode_chain.py tests/test_append_attention.py tests/test_residual_norm.py tests/test_gluon.py \
    -k "ffi or chain or launch or pdl or append or norm" 2>&1 | grep -E "passed|failed|FAILED|Error|assert" | tail -8
  timeout 200 python3 experiments/bench_rollout.py --batches=8 --new_tokens=2048 \
    --formats=nvfp4_fused,bf16_fused --time_budget_s=140 --out="$OUT/issue6_b8" > "$OUT/issue6_b8.log" 2>&1
  grep "|\|x$" "$OUT/issue6_b8.log"; } | tee "$OUT/step106.txt"
# 107 (session 68; about 5 minutes, any card): decode_attention.APPEND_EARLY_LOADS (the cached slots
#    attended before the new token, whose cache stores had held back the loop's first cp.async copies, and the slot
#    mask loaded a block ahead): the append kernel's GPU tests at the 7B shape (early loads among them), then issue
#    6's batch-8 row (NVFP4 and bf16 in one run, the issue's own script through ab_rollout) without and with it, its
#    28-layer time alone at batch 8 over fills of 2-2000 slots against the default, and the batch-8 pair again.
#    Session 68 (H100; raw docs/bench_runs/session68_step107_h100.txt): the tests pass; slower, NVFP4 step 2.435 /
#    2.435 ms against 2.419 / 2.423, the kernel alone 400.2 against 389.9 µs (28 layers, 1300 slots). The setting is
#    gone since, so this step runs only at commit d1b8722.
step 107 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_decode_attention.py -k "append and 7b" 2>&1 | grep -E "passed|failed|FAILED|Error|assert" | tail -6
  ab() { for e in "$@"; do echo "== APPEND_EARLY_LOADS=$e"; DA_SET="APPEND_EARLY_LOADS=$e" timeout 100 python3 \
      experiments/lab/gluon/ab_rollout.py --batches=8 --new_tokens=2048 --formats=nvfp4_fused,bf16_fused 2>&1 \
      | grep -E "_fused \||Error"; done; }
  ab 0 1
  APPEND_BATCHES=8 APPEND_LENGTH=2,1300,2000 APPEND_VARIANTS="merge;merge early;merge early s3" timeout 100 \
    python3 experiments/lab/time_append.py 2>&1 | grep -E "^batch|Error"
  ab 0 1; } | tee "$OUT/step107.txt"
exit 0  # (a step not chosen leaves a false test as the last status)
