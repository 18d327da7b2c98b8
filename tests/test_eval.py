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


def test_config_errors_and_positional_arguments_are_one_line_errors(tmp_path):
  """As in train.py: a mistyped key or a missing config file is one line (exit 2), not a traceback."""
  r = _eval("--config.rl.num_generatons=16")
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert r.stderr.startswith("error: unknown config key among ['--config.rl.num_generatons=16']: "
                             "'num_generatons' Did you mean \"num_generations\"")
  for args in (["--config=configs/no_such_recipe.py"],  # read in main()
               ["--config=configs/no_such_recipe.py", "--config.seed=1"]):  # read while parsing the override
    r = _eval(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        "error: could not load the config file --config:  [Relative path]: configs/no_such_recipe.py "
        "[Errno 2] No such file or directory: 'configs/no_such_recipe.py'"]
  r = _eval("workdirs/run", f"--out={tmp_path}")  # a path given without --workdir=
  assert r.returncode == 1 and "unexpected positional arguments: ['workdirs/run']" in r.stderr, r.stderr[-2000:]
  assert not os.listdir(tmp_path)  # it used to evaluate the base model and write eval_base.json
