import os, subprocess, re, collections, triton
NV = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
def instructions(text):
    """[(address, instruction)] of a cuobjdump -sass listing."""
    return [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", text)]
def opcode(ins):
    """An instruction's opcode, its predicate dropped."""
    return re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0]
def sass(k, tag):
    open(f"/tmp/gl/{tag}.cubin", "wb").write(k.asm["cubin"])
    open(f"/tmp/gl/{tag}.ttgir", "w").write(k.asm["ttgir"])
    s = subprocess.check_output([NV + "/cuobjdump", "-sass", f"/tmp/gl/{tag}.cubin"]).decode()
    open(f"/tmp/gl/{tag}.sass", "w").write(s)
    u = subprocess.check_output([NV + "/cuobjdump", "--dump-resource-usage", f"/tmp/gl/{tag}.cubin"]).decode()
    regs = re.search(r"REG:(\d+)", u).group(1); smem = re.search(r"SHARED:(\d+)", u).group(1)
    ins = [t for _, t in instructions(s)]
    ops = collections.Counter(opcode(t) for t in ins)
    print(f"{tag}: regs {regs} smem {smem} total {len(ins)}", sorted(ops.items(), key=lambda x: -x[1])[:40])
    return s
