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


@pytest.fixture
def two_splits(monkeypatch):
    """The paged-attention kernel's default split for tiny grids is 16 CTAs per (row, kv head), which the
    Mosaic GPU interpreter runs slowly; 2 splits still exercise the split-K merge (of outputs and stats)."""
    import pallas_kernels.paged_attention as paged_attention_module
    monkeypatch.setattr(paged_attention_module, "default_num_splits", lambda batch, num_kv_heads: 2)
