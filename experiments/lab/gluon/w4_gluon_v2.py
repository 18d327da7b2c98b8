"""Lab (GPU through torch, or offline): session 7's second Gluon kernel, the variant timed in
docs/bench_runs/session7_lab_output.txt ("call 4": AHEAD = 1 or 2 steps of loads in flight).
pallas_kernels/w4_gluon.py is its library form (one step ahead, layer stacks, jax-triton). The
first variant (a ``range`` loop, scattered stores; "call 3") is in git history at acb918a.

  python3 experiments/lab/gluon/w4_gluon_v2.py        # no GPU: offline SASS of three configs
"""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as ttgl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
try:
    from sasstool import sass
except ImportError:
    sass = None

from pallas_kernels.w4_gluon import _asm  # noqa: E402
ASM = ttgl.constexpr(_asm())
# codes [KP=32, BN=256]: registers n0 n1 n2 kp0 kp1 kp4; lanes kp2 kp3 n3 n4 n5; warps n6 n7
_CL = ttgl.constexpr(ttgl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [1, 0], [2, 0], [16, 0]],
    lane_bases=[[4, 0], [8, 0], [0, 8], [0, 16], [0, 32]],
    warp_bases=[[0, 64], [0, 128]], block_bases=[], shape=[32, 256]))
# the even rows of the codes viewed as [groups=4, 4, BN] (row pairs j = 4 g + jj)
_CA4 = ttgl.constexpr(ttgl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 1, 0], [2, 0, 0]],
    lane_bases=[[0, 2, 0], [1, 0, 0], [0, 0, 8], [0, 0, 16], [0, 0, 32]],
    warp_bases=[[0, 0, 64], [0, 0, 128]], block_bases=[], shape=[4, 4, 256]))

@gluon.jit
def _load_step(x_ptr, p_ptr, s_ptr, c_offs, x_offs, x_mask, kp0, n0, i, N: ttgl.constexpr, KP: ttgl.constexpr,
               BK: ttgl.constexpr, BN: ttgl.constexpr, c_l: ttgl.constexpr):
    c = ttgl.load(p_ptr + c_offs + i * (KP * N))
    xb = ttgl.load(x_ptr + x_offs + i * BK, mask=x_mask, other=0.0)
    # block scales [KP/8, BN], in the layout that broadcasts over the 4 row pairs of a group
    c_a4: ttgl.constexpr = _CA4
    sg = ttgl.arange(0, KP // 8, layout=ttgl.SliceLayout(1, ttgl.SliceLayout(1, c_a4)))
    sn = ttgl.arange(0, BN, layout=ttgl.SliceLayout(0, ttgl.SliceLayout(1, c_a4)))
    s = ttgl.load(s_ptr + ttgl.expand_dims(sg + (kp0 // 8 + i * (KP // 8)), 1) * N + ttgl.expand_dims(sn, 0) + n0)
    return c, s, xb


@gluon.jit
def _mma_step(acc, c, s, xb, KP: ttgl.constexpr, BN: ttgl.constexpr, BK: ttgl.constexpr, a_l: ttgl.constexpr):
    s = (s.to(ttgl.float32) * 3.3230699894622896e+35).to(ttgl.bfloat16)
    c3 = ttgl.permute(ttgl.reshape(c, [KP // 2, 2, BN]), [0, 2, 1])
    c_a, c_b = ttgl.split(c3)
    c_a4 = ttgl.reshape(c_a, [KP // 8, 4, BN])
    s_a = ttgl.reshape(ttgl.broadcast(ttgl.expand_dims(s, 1), c_a4)[0], [KP // 2, BN])
    s_a = ttgl.convert_layout(s_a, c_a.type.layout, assert_trivial=True)
    o1, o2, o3, o4 = ttgl.inline_asm_elementwise(
        ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [c_a, c_b, s_a],
        dtype=(ttgl.bfloat16, ttgl.bfloat16, ttgl.bfloat16, ttgl.bfloat16), is_pure=True, pack=4)
    j = ttgl.join(ttgl.join(o1, o2), ttgl.join(o3, o4))
    j = ttgl.reshape(j, [2] * 14)
    a = ttgl.reshape(ttgl.permute(j, [9, 12, 4, 5, 10, 6, 7, 8, 0, 1, 2, 3, 13, 11]), [BN, BK])
    a = ttgl.convert_layout(a, a_l)
    return mma_v2(a, xb, acc)


@gluon.jit
def kern(x_ptr, p_ptr, s_ptr, o_ptr, gs, M, N: ttgl.constexpr, K: ttgl.constexpr, STEPS: ttgl.constexpr,
         MB: ttgl.constexpr, AHEAD: ttgl.constexpr):
    BN: ttgl.constexpr = 256
    BK: ttgl.constexpr = 64
    KP: ttgl.constexpr = 32
    mma: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    a_l: ttgl.constexpr = ttgl.DotOperandLayout(0, mma, 8)
    b_l: ttgl.constexpr = ttgl.DotOperandLayout(1, mma, 8)
    c_l: ttgl.constexpr = _CL
    pid_n = ttgl.program_id(0)
    pid_s = ttgl.program_id(1)
    n0 = pid_n * BN
    kp0 = pid_s * (STEPS * KP)
    kp = ttgl.arange(0, KP, layout=ttgl.SliceLayout(1, c_l))
    nn = ttgl.arange(0, BN, layout=ttgl.SliceLayout(0, c_l))
    c_offs = ttgl.expand_dims(kp + kp0, 1) * N + ttgl.expand_dims(nn, 0) + n0
    kk = ttgl.arange(0, BK, layout=ttgl.SliceLayout(1, b_l))
    mm = ttgl.arange(0, MB, layout=ttgl.SliceLayout(0, b_l))
    x_offs = ttgl.expand_dims(kk + kp0 * 2, 1) + ttgl.expand_dims(mm, 0) * K
    x_mask = ttgl.expand_dims(mm < M, 0) & ttgl.expand_dims(kk >= 0, 1)
    acc = ttgl.zeros([BN, MB], ttgl.float32, layout=mma)
    # fully unrolled, loads issued AHEAD steps before their use (no loop-carried byte tensors)
    c0, s0, x0 = _load_step(x_ptr, p_ptr, s_ptr, c_offs, x_offs, x_mask, kp0, n0, 0, N, KP, BK, BN, c_l)
    if AHEAD > 1:
        c1, s1, x1 = _load_step(x_ptr, p_ptr, s_ptr, c_offs, x_offs, x_mask, kp0, n0, ttgl.minimum(1, STEPS - 1), N, KP, BK, BN, c_l)
    for i in ttgl.static_range(STEPS):
        if AHEAD > 1:
            c2, s2, x2 = _load_step(x_ptr, p_ptr, s_ptr, c_offs, x_offs, x_mask, kp0, n0, ttgl.minimum(i + 2, STEPS - 1), N, KP, BK, BN, c_l)
            acc = _mma_step(acc, c0, s0, x0, KP, BN, BK, a_l)
            c0, s0, x0 = c1, s1, x1
            c1, s1, x1 = c2, s2, x2
        else:
            c1, s1, x1 = _load_step(x_ptr, p_ptr, s_ptr, c_offs, x_offs, x_mask, kp0, n0, ttgl.minimum(i + 1, STEPS - 1), N, KP, BK, BN, c_l)
            acc = _mma_step(acc, c0, s0, x0, KP, BN, BK, a_l)
            c0, s0, x0 = c1, s1, x1
    acc = acc * (gs * 256.0)
    # rows r -> physical columns n (the inverse of the A-operand relabelling), then coalesced stores
    acc = ttgl.reshape(ttgl.permute(ttgl.reshape(acc, [2] * 8 + [MB]), [2, 3, 5, 6, 7, 0, 1, 4, 8]), [BN, MB])
    st_l: ttgl.constexpr = ttgl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])
    acc = ttgl.convert_layout(acc, st_l)
    no = ttgl.arange(0, BN, layout=ttgl.SliceLayout(1, st_l))
    mo = ttgl.arange(0, MB, layout=ttgl.SliceLayout(0, st_l))
    o_offs = pid_s * (M * N) + ttgl.expand_dims(mo, 0) * N + ttgl.expand_dims(no + n0, 1)
    o_mask = ttgl.expand_dims(mo < M, 0) & ttgl.expand_dims(no >= 0, 1)
    ttgl.store(o_ptr + o_offs, acc, mask=o_mask)


def compile(N, K, STEPS, MB=8, AHEAD=1):
    src = GluonASTSource(kern, signature={"x_ptr": "*bf16", "p_ptr": "*u8", "s_ptr": "*fp8e4nv", "o_ptr": "*fp32",
        "gs": "fp32", "M": "i32", "N": "constexpr", "K": "constexpr", "STEPS": "constexpr", "MB": "constexpr", "AHEAD": "constexpr"},
        constexprs={"N": N, "K": K, "STEPS": STEPS, "MB": MB, "AHEAD": AHEAD}, attrs={(i,): [["tt.divisibility", 16]] for i in range(4)})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))

if __name__ == "__main__":
    for a in (1, 2):
        sass(compile(18944, 3584, 8, AHEAD=a), f"v2a{a}")
    sass(compile(18944, 3584, 8, MB=16, AHEAD=1), "v2m16")
