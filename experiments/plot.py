r"""Plot training curves of one or more runs (several runs on one figure, for ablations).

  python experiments/plot.py --workdirs=workdirs/a,workdirs/b --out=plots/

Reads each workdir's ``metrics.jsonl`` and writes one PNG per quantity (reward, accuracy,
entropy, KL, response length, AQN sigma) with one line per run, labelled by the workdir's name
(or ``--labels``). Quantities that no run logged are skipped.
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from absl import app, flags  # noqa: E402

from qerl_jax import plotting  # noqa: E402

_WORKDIRS = flags.DEFINE_list("workdirs", None, "Comma-separated run folders (each with metrics.jsonl).")
_LABELS = flags.DEFINE_list("labels", None, "Optional labels, one per workdir.")
_OUT = flags.DEFINE_string("out", None, "Output folder for the PNGs (default: the first workdir's plots/).")
flags.mark_flags_as_required(["workdirs"])


def rejoin_commas(parts: list[str]) -> list[str]:
  """``--workdirs`` split on commas, with the pieces of a folder whose own name holds a comma joined again: a
  piece that is not a folder is joined with the next ones while that makes an existing folder (train.py
  accepts such a --workdir)."""
  out, i = [], 0
  while i < len(parts):
    j = i + 1
    if not os.path.isdir(parts[i]):
      for k in range(i + 2, len(parts) + 1):
        if os.path.isdir(",".join(parts[i:k])):
          j = k
          break
    out.append(",".join(parts[i:j]))
    i = j
  return out


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected positional arguments: {argv[1:]} (several runs: --workdirs=a,b)")
  if not _WORKDIRS.value:
    raise app.UsageError("--workdirs is empty: give one or more run folders, comma-separated")
  workdirs = rejoin_commas(_WORKDIRS.value)
  out = _OUT.value or os.path.join(workdirs[0], "plots")
  try:
    paths = plotting.plot_runs(workdirs, out, labels=_LABELS.value)
  except (FileNotFoundError, ValueError) as e:  # a workdir without metrics, mismatched --labels
    print(f"error: {e}", file=sys.stderr)
    return 2
  if not paths:
    print(f"error: nothing to plot: no metrics.jsonl in {_WORKDIRS.value} has a value of "
          f"{[k for _, _, keys in plotting.PANELS for k in keys]}", file=sys.stderr)
    return 1
  for p in paths:
    print(p)
  return 0


if __name__ == "__main__":
  app.run(main)
