"""experiments/eval.py refuses a missing checkpoint or an impossible flag before it loads a model."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _eval(*args):
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
         "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "eval.py"),
                         "--config=configs/default.py", "--benchmarks=aime24", "--limit=1", *args],
                        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


def test_missing_checkpoint_is_a_clear_error_and_creates_nothing(tmp_path, data_dir):
  typo = tmp_path / "typo"
  r = _eval(f"--workdir={typo}", f"--data_dir={data_dir}")
  assert r.returncode == 2, r.stderr[-2000:]
  assert "a checkpoint not found" in r.stderr and "Traceback" not in r.stderr
  assert not typo.exists()  # opening the checkpoint folder would have created <typo>/checkpoints
  (tmp_path / "run" / "checkpoints" / "3").mkdir(parents=True)  # a run with step 3 only
  r = _eval(f"--workdir={tmp_path / 'run'}", "--step=5", f"--data_dir={data_dir}")
  assert r.returncode == 2 and "step 5 not found" in r.stderr and "[3]" in r.stderr, r.stderr[-2000:]


def test_step_without_workdir_and_negative_limit_are_usage_errors(data_dir):
  r = _eval("--step=5", f"--data_dir={data_dir}")
  assert r.returncode == 1 and "--step=5 needs --workdir" in r.stderr, r.stderr[-2000:]
  r = _eval("--limit=-2", f"--data_dir={data_dir}")
  assert r.returncode == 1 and "--limit=-2 must be >= 0" in r.stderr, r.stderr[-2000:]
