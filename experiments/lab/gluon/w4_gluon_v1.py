import os, sys
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

def _asm():
    L = ["{", ".reg .b32 u, m, s, t, nz;", "mov.b32 nz, 0x80008000;"]
    outs = {}
    for q in range(4):
        sc = f"$10" if q < 2 else "$11"
        sel = "0x1010" if q % 2 == 0 else "0x3232"
        L += [f"prmt.b32 u, $8, $9, {hex(q | ((4 + q) << 8))};", f"prmt.b32 s, {sc}, {sc}, {sel};"]
        lo_reg = ["$0", "$1", "$2", "$3"][q]
        hi_reg = ["$4", "$5", "$6", "$7"][q]
        for reg, sm, ss in ((lo_reg, 6, 12), (hi_reg, 2, 8)):
            L += [f"shl.b32 m, u, {sm};", "and.b32 m, m, 0x01C001C0;", f"shl.b32 t, u, {ss};",
                  "and.b32 t, t, 0x80008000;", "or.b32 m, m, t;", f"fma.rn.bf16x2 {reg}, m, s, nz;"]
    return "\n".join(L + ["}"])
ASM = ttgl.constexpr(_asm())

@gluon.jit
def kern(x_ptr, p_ptr, s_ptr, o_ptr, gs, M, N: ttgl.constexpr, K: ttgl.constexpr, STEPS: ttgl.constexpr,
         MB: ttgl.constexpr, UNROLL: ttgl.constexpr):
    BN: ttgl.constexpr = 256
    BK: ttgl.constexpr = 64
    KP: ttgl.constexpr = 32
    mma: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    a_l: ttgl.constexpr = ttgl.DotOperandLayout(0, mma, 8)
    b_l: ttgl.constexpr = ttgl.DotOperandLayout(1, mma, 8)
    c_l: ttgl.constexpr = ttgl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [1, 0], [2, 0], [16, 0]],
        lane_bases=[[4, 0], [8, 0], [0, 8], [0, 16], [0, 32]],
        warp_bases=[[0, 64], [0, 128]], block_bases=[], shape=[KP, BN])
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
    for i0 in range(0, STEPS, UNROLL):
      for u in ttgl.static_range(UNROLL):
        i = i0 + u
        c = ttgl.load(p_ptr + c_offs + i * (KP * N))
        xb = ttgl.load(x_ptr + x_offs + i * BK, mask=x_mask, other=0.0)
        c3 = ttgl.permute(ttgl.reshape(c, [KP // 2, 2, BN]), [0, 2, 1])
        c_a, c_b = ttgl.split(c3)
        c_a4 = ttgl.reshape(c_a, [KP // 8, 4, BN])
        sg = ttgl.arange(0, KP // 8, layout=ttgl.SliceLayout(1, ttgl.SliceLayout(1, c_a4.type.layout)))
        sn = ttgl.arange(0, BN, layout=ttgl.SliceLayout(0, ttgl.SliceLayout(1, c_a4.type.layout)))
        s = ttgl.load(s_ptr + ttgl.expand_dims(sg + (kp0 // 8 + i * (KP // 8)), 1) * N + ttgl.expand_dims(sn, 0) + n0)
        s = (s.to(ttgl.float32) * 3.3230699894622896e+35).to(ttgl.bfloat16)
        s_a = ttgl.reshape(ttgl.broadcast(ttgl.expand_dims(s, 1), c_a4)[0], [KP // 2, BN])
        s_a = ttgl.convert_layout(s_a, c_a.type.layout, assert_trivial=True)
        o1, o2, o3, o4 = ttgl.inline_asm_elementwise(
            ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [c_a, c_b, s_a],
            dtype=(ttgl.bfloat16, ttgl.bfloat16, ttgl.bfloat16, ttgl.bfloat16), is_pure=True, pack=4)
        j = ttgl.join(ttgl.join(o1, o2), ttgl.join(o3, o4))
        j = ttgl.reshape(j, [2] * 14)
        a = ttgl.reshape(ttgl.permute(j, [9, 12, 4, 5, 10, 6, 7, 8, 0, 1, 2, 3, 13, 11]), [BN, BK])
        a = ttgl.convert_layout(a, a_l)
        acc = mma_v2(a, xb, acc)
    acc = acc * (gs * 256.0)
    r = ttgl.arange(0, BN, layout=ttgl.SliceLayout(1, mma))
    nphys = ((r >> 3) & 1) | (((r >> 6) & 3) << 1) | ((r & 7) << 3) | (((r >> 4) & 3) << 6)
    mo = ttgl.arange(0, MB, layout=ttgl.SliceLayout(0, mma))
    o_offs = pid_s * (M * N) + ttgl.expand_dims(mo, 0) * N + ttgl.expand_dims(nphys + n0, 1)
    o_mask = ttgl.expand_dims(mo < M, 0) & ttgl.expand_dims(r >= 0, 1)
    ttgl.store(o_ptr + o_offs, acc, mask=o_mask)

def compile(N, K, STEPS, MB=8, UNROLL=2):
    src = GluonASTSource(kern, signature={"x_ptr": "*bf16", "p_ptr": "*u8", "s_ptr": "*fp8e4nv", "o_ptr": "*fp32",
        "gs": "fp32", "M": "i32", "N": "constexpr", "K": "constexpr", "STEPS": "constexpr", "MB": "constexpr", "UNROLL": "constexpr"},
        constexprs={"N": N, "K": K, "STEPS": STEPS, "MB": MB, "UNROLL": UNROLL}, attrs={(i,): [["tt.divisibility", 16]] for i in range(4)})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))

if __name__ == "__main__":
    sass(compile(18944, 3584, 4, UNROLL=2), "u2")
    sass(compile(18944, 3584, 4, UNROLL=4), "u4")
    sass(compile(18944, 3584, 4, MB=16), "u2m16")
