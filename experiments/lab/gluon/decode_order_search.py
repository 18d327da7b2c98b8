"""Lab (CPU): is there a cheaper bit order for the E2M1 decode than nvfp4.DECODE_ORDER_BITS?

The Gluon kernel makes 4 bf16x2 registers from one 32-bit block word (8 codes). Register i needs the sign of
each of its two codes at bits 15 / 31 and the three magnitude bits at 8..6 / 24..22 (the set P below). A register
built from pieces ``(word << t) & mask`` (t < 0: a right shift) costs one LOP3 a piece and one shift a nonzero t
(ptxas issues left shifts as IMAD.SHL on the FMA pipe, right shifts as SHF on the ALU pipe). The decode order is a
free choice of which word bit holds which code bit, so the question is a matching: given shifts T_i for register i,
can every target bit (i, p) take a distinct source bit p - t, t in T_i, inside the word?

  python3 experiments/lab/gluon/decode_order_search.py     # about 2 minutes on one core

Session 26's answer: no assignment with at most two pieces a register costs fewer than 11 instructions, nor one with
three single-piece registers and a three-piece one (checked separately, same matching), so the shipped order (11:
pieces 1 + 1 + 1 + 3) is at the minimum of this family; none with 6 pieces uses left shifts only; with 6 pieces and
one right shift there are several (e.g. shifts {0}, {3}, {-3, 1}, {2, 6}), which move one ALU shift to the FMA pipe
per 8 weights at the same total count. Not built: the ALU saving is 1 of about 9 ALU operations per 8 weights.
"""
import itertools

P = [6, 7, 8, 15, 22, 23, 24, 31]


def match(shifts):
  """A perfect matching of the 32 target bits (register i, bit p) to the 32 word bits, or None."""
  targets = [(i, p) for i in range(4) for p in P]
  adj = [[p - t for t in shifts[i] if 0 <= p - t <= 31] for i, p in targets]
  owner = [-1] * 32

  def augment(u, seen):
    for s in adj[u]:
      if not seen[s]:
        seen[s] = True
        if owner[s] < 0 or augment(owner[s], seen):
          owner[s] = u
          return True
    return False

  return owner if all(augment(u, [False] * 32) for u in range(32)) else None


def cost(shifts) -> int:
  return sum(t != 0 for t in shifts) + len(shifts)


def main():
  options = [(t,) for t in range(0, 7)] + list(itertools.combinations(range(-25, 32), 2))
  by_cost = {}
  for s in options:
    by_cost.setdefault(cost(s), []).append(s)
  for total in range(7, 11):
    hit = None
    for costs in itertools.combinations_with_replacement(sorted(by_cost), 4):
      if sum(costs) == total:
        hit = next((s for s in itertools.product(*(by_cost[c] for c in costs)) if match(s)), None)
        if hit:
          break
    print(f"{total} instructions, at most 2 pieces a register: {hit or 'none'}", flush=True)
  found = []
  for a, b in itertools.combinations(range(0, 7), 2):
    for pair in itertools.combinations_with_replacement(list(itertools.combinations(range(-25, 32), 2)), 2):
      shifts = ((a,), (b,)) + pair
      if sum(t < 0 for t in pair[0] + pair[1]) <= 1 and match(shifts):
        found.append(shifts)
  left_only = [s for s in found if all(t >= 0 for piece in s for t in piece)]
  print(f"6 pieces with at most one right shift: {len(found)} (left shifts only: {len(left_only)}); e.g. {found[:3]}")


if __name__ == "__main__":
  main()
