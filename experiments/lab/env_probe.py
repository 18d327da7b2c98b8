"""Lab: what the GPU image offers below Pallas (nvcc, Triton's Gluon, jaxlib's Triton kernel call)."""
import importlib, shutil, subprocess

print("nvcc:", shutil.which("nvcc"))
if shutil.which("nvcc"):
  print(subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1])
import triton
print("triton", triton.__version__)
for mod in ("triton.experimental.gluon", "triton.experimental.gluon.language",
            "triton.experimental.gluon.language.nvidia.hopper", "triton.experimental.gluon.language.nvidia.ampere",
            "jax_triton", "jax._src.lib.gpu_triton", "jax.ffi"):
  try:
    m = importlib.import_module(mod)
    print(f"{mod}: ok;", ", ".join(n for n in dir(m) if not n.startswith("_"))[:1500])
  except Exception as e:  # noqa: BLE001 - a probe reports every failure
    print(f"{mod}: FAILED {type(e).__name__}: {e}")
try:
  import jax
  print("ffi include dir:", jax.ffi.include_dir())
except Exception as e:  # noqa: BLE001
  print("ffi include dir FAILED", e)
