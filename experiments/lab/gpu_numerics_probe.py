"""Lab (GPU, session 19): does XLA on a GPU keep an f32 -> E4M3 -> f32 round trip, and is its f32 division IEEE?
Compares with the CPU backend in the same process."""
import jax, jax.numpy as jnp, numpy as np
x = np.float32([4.5e-6, 9.765625e-4, 1.0e-3, 0.002, 3.3, 300.0])
f = jax.jit(lambda x: (x.astype(jnp.float8_e4m3fn).astype(jnp.float32) == 0, x.astype(jnp.float8_e4m3fn).astype(jnp.float32) * 1.0))
print("gpu e4m3 round trip == 0, value:", f(x))
print("cpu:", jax.jit(f, backend="cpu")(x) if False else jax.device_get(jax.jit(f)(jax.device_put(x, jax.devices("cpu")[0]))))
d = jax.jit(lambda a, b: a / (b + a * 0))
a = np.float32(np.random.default_rng(0).uniform(0.1, 10, 100000)); b = np.float32(np.random.default_rng(1).uniform(0.1, 10, 100000))
g = np.asarray(d(a, b)); c = np.asarray(d(jax.device_put(a, jax.devices("cpu")[0]), jax.device_put(b, jax.devices("cpu")[0])))
print("f32 division gpu != cpu:", (g != c).mean())
from qerl_jax import _packing
g2 = np.asarray(jax.jit(_packing.exact_divide)(a, b)); print("exact_divide gpu != cpu:", (g2 != c).mean())
