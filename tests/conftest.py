"""Shared test fixtures: the ../shared data folder, GPU skipping, the real Qwen2.5 tokenizer."""

import importlib.metadata
import os
import pathlib
import shutil
import tempfile

# The README's test command runs two pytest-xdist processes; on a GPU each would otherwise take 75% of its memory up
# front (JAX's default) and the second would run out. Set before JAX starts a backend; an explicit setting wins.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# No NVIDIA driver: the suite runs on XLA's CPU backend and is bound by compiling (the settings below).
_CPU_ONLY = not os.path.exists("/dev/nvidiactl")
# One persistent compilation cache for the whole run, shared by the pytest-xdist workers and the processes tests
# start (the launchers, bench scripts, the notebook): what one of them compiled (at least half a second's work), the
# others load (the CPU suite on 2 cores: 753 s against 949 s without, session 59). Removed at the end of the run
# (pytest_unconfigure); an explicit JAX_COMPILATION_CACHE_DIR wins. Not on a machine with an NVIDIA driver, where
# the suite is not bound by compiling and the cache has not been tried with the Gluon launcher's kernels.
# (The workers inherit the variable from the controller, which made the folder and so removes it.)
_OWN_CACHE = _CPU_ONLY and "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="qerl-jax-tests-")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# On a machine without an NVIDIA driver the suite is bound by XLA's CPU compiler. Two settings halve it; they change
# how XLA's CPU code is made, not what it computes (no fast-math either way):
# - LLVM at -O0 (`--xla_backend_optimization_level=0`): test_model.py in 128 s against 211 s on 2 cores (session 61);
# - XLA's older loop emitters for fusions instead of its MLIR fusion emitters (`--xla_cpu_use_fusion_emitters=false`):
#   the tiny trainer's compiles 7 s against 15 s (bench_train_step.py --shape=tiny, session 62). jaxlib 0.10 only:
#   0.11 has no such flag (its XLA stops at an unknown flag) and always uses the fusion emitters.
#   (Not for the launchers: the embedded default's steps ran at 2.34 s against 2.02 s with it, at XLA's default -O2.)
# Inherited by the processes tests start; a setting already in XLA_FLAGS wins.


def _jaxlib_before(major_minor):
  try:
    v = importlib.metadata.version("jaxlib")
  except importlib.metadata.PackageNotFoundError:
    return False
  return tuple(int(x) for x in v.split(".")[:2]) < major_minor


if _CPU_ONLY:
  from qerl_jax import xla_flags  # (imports no JAX)
  _CPU_XLA_FLAGS = ("--xla_backend_optimization_level=0",) + (
      ("--xla_cpu_use_fusion_emitters=false",) if _jaxlib_before((0, 11)) else ())
  os.environ["XLA_FLAGS"] = xla_flags.merge(os.environ.get("XLA_FLAGS", ""), _CPU_XLA_FLAGS)

import jax  # noqa: E402
import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def _has_gpu() -> bool:
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False


def pytest_unconfigure(config):
  if _OWN_CACHE and not hasattr(config, "workerinput"):  # the controller (or a run without xdist), at the end
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def pytest_configure(config):
  # The README's `-n 2` distributes tests one at a time ("load"). Tests marked xdist_group share a module fixture
  # that must run once (test_trainer.py's three default-config processes, about 2 minutes on 2 cores), so the
  # distribution becomes "loadgroup": each group to one worker, every other test on its own, as before.
  # A worker parses the command line again ("-n 2" without --dist) and learns of it from its workerinput.
  if getattr(config.option, "dist", "no") == "load":
    config.option.dist = "loadgroup"
  if getattr(config, "workerinput", {}).get("qerl_loadgroup"):
    config.option.loadgroup = True


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
  node.workerinput["qerl_loadgroup"] = node.config.option.dist == "loadgroup"


def pytest_collection_modifyitems(config, items):
  # The longest tests (marked slow) first, so that neither worker starts a 1-2 minute test while the other is about
  # to run out of work; otherwise the collection's order.
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)
  if _has_gpu():
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU (none visible to JAX)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture(autouse=True)
def _full_precision_float32_matmuls():
  """Float32 matmuls at full precision in every test. On a GPU, JAX's default float32 matmuls are
  TF32 (10-bit mantissas): a float32 forward then moves by about 3e-3 against the float64 and
  PyTorch references the tests hold to 1e-4. On the CPU this is the default anyway."""
  with jax.default_matmul_precision("highest"):
    yield


@pytest.fixture(scope="session")
def shared_dir() -> pathlib.Path:
  """../shared beside the repository (data and fixtures); skips when absent (a user's fresh clone)."""
  if not SHARED.is_dir():
    pytest.skip(f"{SHARED} not present: these tests read the project's shared data (GSM8K, MATH, third-party "
                "fixtures), which a fresh clone does not have")
  return SHARED


@pytest.fixture(scope="session")
def data_dir(shared_dir) -> pathlib.Path:
  d = shared_dir / "data"
  if not d.is_dir():
    pytest.skip(f"{d} not present")
  return d


@pytest.fixture(scope="session")
def fixtures_dir(shared_dir) -> pathlib.Path:
  d = shared_dir / "fixtures"
  if not d.is_dir():
    pytest.skip(f"{d} not present")
  return d


@pytest.fixture(scope="session")
def qwen_tokenizer(fixtures_dir):
  """The real Qwen2.5-0.5B-Instruct tokenizer from ../shared/fixtures (offline; ~10 s to build
  once per session, so share this fixture rather than loading it again)."""
  transformers = pytest.importorskip("transformers")
  path = fixtures_dir / "qwen2.5-0.5b-instruct"
  if not path.is_dir():
    pytest.skip(f"{path} not present")
  return transformers.AutoTokenizer.from_pretrained(str(path))
