"""experiments/eval.py refuses a missing checkpoint or an impossible flag before it loads a model."""

import os
import subprocess
import sys

import pytest

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
  for item in ("state", "meta"):  # a run with step 3 only (a numbered folder without them is no checkpoint)
    (tmp_path / "run" / "checkpoints" / "3" / item).mkdir(parents=True)
  r = _eval(f"--workdir={tmp_path / 'run'}", "--step=5", f"--data_dir={data_dir}")
  assert r.returncode == 2 and "step 5 not found" in r.stderr and "[3]" in r.stderr, r.stderr[-2000:]


def test_step_without_workdir_and_negative_limit_are_usage_errors(data_dir):
  r = _eval("--step=5", f"--data_dir={data_dir}")
  assert r.returncode == 1 and "--step=5 needs --workdir" in r.stderr, r.stderr[-2000:]
  r = _eval("--limit=-2", f"--data_dir={data_dir}")
  assert r.returncode == 1 and "--limit=-2 must be >= 0" in r.stderr, r.stderr[-2000:]


def test_impossible_flags_and_recipe_values_stop_before_the_model_loads(tmp_path):
  """--batch_size=-1 wrote pass@1 NaN and exited 0; --out naming a file lost the results after the whole
  evaluation; --config.lora.rank=0 and --temperature=nan failed after the model loaded."""
  out = tmp_path / "file"
  out.write_text("x")
  for args, code, needle in ((["--batch_size=-1"], 1, "--batch_size=-1 must be >= 0"),
                             (["--temperature=nan", "--num_samples=4"], 1, "--temperature=nan must be a finite number"),
                             ([f"--out={out}"], 1, f"--out={out} is a file"),
                             (["--config.lora.rank=0"], 2, "error: impossible config:\n  - lora.rank=0 must be >= 1")):
    r = _eval(*args, f"--data_dir={tmp_path / 'no_data'}")  # checked before the data too
    assert r.returncode == code and needle in r.stderr and "Traceback" not in r.stderr, (args, r.stderr[-2000:])
  assert out.read_text() == "x"


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


@pytest.mark.slow
def test_heldout_is_the_default_for_the_embedded_recipe_and_matches_the_asset(tmp_path):
  """With configs/default.py and no --benchmarks, eval.py scores the base model on the recipe's own held-out
  set (synthetic:test:100), with no data folder at all: its greedy accuracy is the NVFP4 held-out accuracy
  that experiments/pretrain_tiny.py recorded when it made the asset (assets/tiny-gsm/metrics.json, 0.38), to
  within one prompt: its own code computed that, and a bf16 near-tie can go the other way (this base model
  without an adapter reads 0.37; the trainer's step 0, with the zero-initialized adapter, 0.38). A wrong
  template, answer check or padding drops it far below."""
  import json
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
         "JAX_PLATFORMS": "cpu"}
  r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "eval.py"), "--config=configs/default.py",
                      f"--out={tmp_path}", f"--data_dir={tmp_path / 'no_data'}"],
                     cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
  assert r.returncode == 0, r.stderr[-3000:]
  with open(os.path.join(ROOT, "assets", "tiny-gsm", "metrics.json")) as f:
    want = json.load(f)["heldout_greedy_accuracy_nvfp4"]
  with open(tmp_path / "eval_base.json") as f:
    got = json.load(f)["results"]
  assert list(got) == ["heldout"] and got["heldout"]["num_prompts"] == 100
  assert abs(got["heldout"]["pass@1_greedy"] - want) <= 0.011, (got, want)
  assert "heldout pass@1 (greedy)" in r.stdout


def test_heldout_needs_data_eval():
  r = _eval("--benchmarks=heldout", "--config.data.eval=")
  assert r.returncode == 1 and "--benchmarks=heldout needs the config's data.eval" in r.stderr, r.stderr[-2000:]


def test_every_launcher_help_shows_its_docstring_unchanged():
  """absl's --help %-formats __main__'s docstring with the program's name, so a lone '%' in it (eval.py once
  had '4.6% at') printed the path in its place. Each launcher's docstring must come out as written."""
  import ast
  import contextlib
  import io
  import types
  from unittest import mock

  from absl import app
  names = sorted(n for n in os.listdir(os.path.join(ROOT, "experiments")) if n.endswith(".py"))
  assert "eval.py" in names and "train.py" in names
  for name in names:
    with open(os.path.join(ROOT, "experiments", name)) as f:
      doc = ast.get_docstring(ast.parse(f.read()), clean=False)
    if not doc:
      continue
    out = io.StringIO()
    with mock.patch.dict(sys.modules, {"__main__": types.SimpleNamespace(__doc__=doc)}), \
         mock.patch.object(sys, "argv", ["experiments/" + name]), contextlib.redirect_stdout(out):
      app.usage(shorthelp=True, writeto_stdout=True)
    assert out.getvalue().startswith(doc.replace("%%", "%")), name
