"""Shared pytest set-up: tests marked `gpu` skip cleanly unless jax sees an NVIDIA GPU."""
import jax
import pytest


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (jax.default_backend() is not 'gpu')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
