"""qerl-jax: reinforcement learning of LLMs on NVFP4 weights (QeRL) in JAX."""

__version__ = "0.1.0"
