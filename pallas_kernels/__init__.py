"""Pallas (Mosaic GPU) kernels, each beside its pure-jnp reference; nothing here imports the engine."""
