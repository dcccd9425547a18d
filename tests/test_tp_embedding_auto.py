"""`--tp-embedding auto` (the default): the embedding/LM head layout chosen per model by
tensor_parallel.choose_embedding, and decided when a model is laid out (TensorParallel.for_model). No
devices needed: an abstract 2-device mesh stands in. (The engine path with auto at tp=4 is in
tests/test_tensor_parallel.py.)"""
import dataclasses

import pytest
from jax.sharding import AbstractMesh

from stratum_jax.model.config import PRESETS
from stratum_jax.tensor_parallel import AUTO_REPLICATED_MAX_EXTRA_BYTES, TensorParallel, choose_embedding


def _head_bytes_cfg(vocab: int, hidden: int, dtype: str = "bfloat16"):
    return dataclasses.replace(PRESETS["tiny"], vocab_size=vocab, hidden_size=hidden, dtype=dtype)


@pytest.mark.parametrize("model, size, expected", [
    ("llama-8b", 2, "replicated"),     # 0.53 GB of extra head per device: measured faster at batch 1
    ("llama-70b", 2, "replicated"),    # 1.05 GB
    ("llama-70b", 8, "replicated"),    # 1.84 GB, still under 2 GiB
])
def test_presets(model, size, expected):
    assert choose_embedding(PRESETS[model], size) == expected


def test_the_threshold_is_on_the_extra_head_bytes_per_device():
    # bf16 head [vocab, 8192] at tp=2: each device adds vocab * 8192 bytes (half of 2 bytes per weight).
    at_limit = AUTO_REPLICATED_MAX_EXTRA_BYTES // 8192
    assert choose_embedding(_head_bytes_cfg(at_limit, 8192), 2) == "replicated"
    assert choose_embedding(_head_bytes_cfg(at_limit + 2, 8192), 2) == "vocab-parallel"
    # The same head in float32 reads twice the bytes; more devices leave each a larger share to add.
    assert choose_embedding(_head_bytes_cfg(at_limit, 8192, "float32"), 2) == "vocab-parallel"
    assert choose_embedding(_head_bytes_cfg(at_limit, 8192), 4) == "vocab-parallel"


def test_a_vocabulary_the_devices_do_not_divide_is_replicated():
    # Large enough for vocab-parallel, but 256001 rows do not split two ways.
    assert choose_embedding(_head_bytes_cfg(256_001, 16384), 2) == "replicated"
    assert choose_embedding(_head_bytes_cfg(256_000, 16384), 2) == "vocab-parallel"


def test_for_model_decides_auto_and_keeps_an_explicit_choice():
    mesh = AbstractMesh((2,), ("tp",))
    auto = TensorParallel(mesh, vocab_parallel=None)
    with pytest.raises(ValueError, match="decided per model"):
        auto.splits_vocab()
    assert auto.for_model(PRESETS["llama-8b"]).splits_vocab() is False
    assert auto.for_model(_head_bytes_cfg(256_000, 16384)).splits_vocab() is True
    explicit = TensorParallel(mesh, vocab_parallel=True)
    assert explicit.for_model(PRESETS["llama-8b"]) is explicit
