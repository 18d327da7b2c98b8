"""Lab (CPU, about 3 minutes): how few integer instructions can an E2M1 -> bf16x2 decode of one 32-bit code word take?

The M <= 16 Gluon build turns each 32-bit word of 8 E2M1 codes into 4 bf16x2 registers by bit placement: every
code's sign goes to bit 15 and its three magnitude bits to 8..6 of a 16-bit half (``w4_gluon._asm``; the
scale multiply then fixes the exponent). In the decode order (``nvfp4.DECODE_ORDER_BITS``) three registers
are ``(word << k) & 0x81C081C0`` for k = 0, 3, 6 and the fourth takes three shifted pieces: 6 masks (LOP3)
and 2 right shifts (SHF) on the ALU pipe, 2 left shifts that ptxas puts on the FMA pipe (IMAD.SHL).

A register built from p pieces costs p LOP3 (the first an AND, each further one an AND-OR), plus one SHF per
piece moved right (a left shift can be an IMAD). Since the bit order inside a block word is free (the decode
order is a permutation), this script searches every layout:

1. whether 4 single-piece registers (shifts or rotations) can cover a word: no;
2. the layouts with the fewest ALU instructions, half-symmetric pieces (the same shift for both halves);
3. whether two words can share the fourth registers' pieces with 3 single-piece registers each: no.

  python3 experiments/lab/gluon/decode_layout_search.py
"""
import itertools

DST = (6, 7, 8, 15, 22, 23, 24, 31)  # a bf16x2 register's code bits: magnitude 8..6 and sign 15 of each half
HALF = (6, 7, 8, 15)


def rotation_tilings():
  """Rotations r (mod 32) of the register pattern whose four copies partition a 32-bit word."""
  return [rs for rs in itertools.combinations(range(32), 4)
          if len(set().union(*({(d - r) % 32 for d in DST} for r in rs))) == 32]


def cheapest_one_word(max_pieces: int = 7):
  """Exact covers of the 32 bits by half-symmetric pieces (subset of HALF, shift k: source bit d + h - k for
  h in (0, 16)), grouped into 4 registers; sorted by ALU instructions (pieces + right shifts)."""
  pieces = []
  for r in range(1, 5):
    for sub in itertools.combinations(HALF, r):
      for k in range(-31, 32):
        src = frozenset(d + h - k for d in sub for h in (0, 16))
        if all(0 <= s < 32 for s in src):
          pieces.append((frozenset(sub), k, src))
  by_bit = {b: [p for p in pieces if b in p[2]] for b in range(32)}

  def groups(subs):
    def rec(i, regs):
      if i == len(subs):
        return all(reg == frozenset(HALF) for reg in regs)
      for j in range(4):
        if not regs[j] & subs[i]:
          if rec(i + 1, regs[:j] + [regs[j] | subs[i]] + regs[j + 1:]):
            return True
          if not regs[j]:
            break
      return False
    return rec(0, [frozenset()] * 4)

  found = []

  def dfs(covered, chosen, uses):
    if len(chosen) > max_pieces:
      return
    if len(covered) == 32:
      if all(uses[d] == 4 for d in HALF) and groups([p[0] for p in chosen]):
        found.append(chosen)
      return
    b = min(set(range(32)) - covered)
    for p in by_bit[b]:
      if p[2] & covered or any(uses[d] == 4 for d in p[0]):
        continue
      for d in p[0]:
        uses[d] += 1
      dfs(covered | p[2], chosen + [p], uses)
      for d in p[0]:
        uses[d] -= 1

  dfs(frozenset(), [], {d: 0 for d in HALF})
  alu = lambda c: len(c) + sum(1 for p in c if p[1] < 0)
  return sorted(((alu(c), c) for c in found), key=lambda x: (x[0], len(x[1])))


def two_word_shared_fourth():
  """Layouts where each of two words gives 3 single-piece registers (left shifts k1 < k2 < k3) and the two
  fourth registers each take one piece from either word."""
  dst = frozenset(DST)
  subs = [frozenset(c) for r in range(1, 8) for c in itertools.combinations(DST, r)]
  out = []
  for ks in itertools.combinations(range(7), 3):
    used = [frozenset(d - k for d in DST) for k in ks]
    if len(used[0] | used[1] | used[2]) != 24:
      continue
    rest = frozenset(range(32)) - used[0] - used[1] - used[2]
    fits = {}
    for sub in subs:
      for k in range(-31, 32):
        src = frozenset(d - k for d in sub)
        if all(0 <= s < 32 for s in src) and src <= rest:
          fits.setdefault(sub, []).append(src)
    for d1, d1p in itertools.product(fits, fits):
      if dst - d1 not in fits or dst - d1p not in fits:
        continue
      if any(a | c == rest and not a & c for a in fits[d1] for c in fits[d1p]) and \
         any(b | d == rest and not b & d for b in fits[dst - d1] for d in fits[dst - d1p]):
        out.append((ks, sorted(d1), sorted(d1p)))
  return out


if __name__ == "__main__":
  print("1. four single-piece registers (rotations) covering a word:", rotation_tilings() or "none")
  best = cheapest_one_word()
  print(f"2. {len(best)} layouts of at most 7 pieces; the cheapest (ALU instructions, pieces, [(half bits, left shift)]):")
  for alu, c in best[:5]:
    print("  ", alu, len(c), [(sorted(p[0]), p[1]) for p in c])
  print("   the library's decode order: 8 ALU instructions, 6 pieces (shifts 0, 3, 6 and three pieces, two right)")
  print("3. two words, 3 single-piece registers each, the fourth registers shared:", two_word_shared_fourth() or "none")
