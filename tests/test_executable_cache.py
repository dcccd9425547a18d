"""The on-disk executable cache (stratum_jax/executable_cache.py): an engine started on a cache directory
an earlier one filled loads its step executables without tracing or lowering, and runs them to the same
tokens; a damaged entry is dropped and compiled again; another config misses."""
from __future__ import annotations

import dataclasses
import logging
import shutil

import pytest

from stratum_jax import model_runner
from stratum_jax.config import RuntimeConfig
from stratum_jax.engine import Engine
from stratum_jax.model.config import PRESETS
from stratum_jax.model.llama import init_params
from stratum_jax.model.loader import LoadedModel, load_model
from stratum_jax.model.tokenizer import ByteTokenizer
from stratum_jax.request import SamplingParams

PROMPTS = [[5, 6, 7], list(range(20, 61)), [9] * 17]


def _start(model, cache_dir, monkeypatch, **overrides):
    """An engine as a new process starts it: no executables in memory. Returns (engine, shapes it lowers:
    a list that keeps growing as the engine runs)."""
    monkeypatch.setattr(model_runner, "_EXECUTABLES", {})
    lowered = []
    real = model_runner.ModelRunner._lower

    def counting(self, shape, kv_cache):
        lowered.append(shape)
        return real(self, shape, kv_cache)
    monkeypatch.setattr(model_runner.ModelRunner, "_lower", counting)
    kw = dict(model="tiny", max_context=128, kv_pool_tokens=2048, max_batch_size=4, prefill_chunk=32,
              compilation_cache_dir=str(cache_dir))
    return Engine(RuntimeConfig(**{**kw, **overrides}), model=model), lowered


def _tokens(engine):
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    return [r.token_ids for r in engine.generate(PROMPTS, sp)]


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """(model, a cache directory filled by one engine's run, the shapes it compiled, its tokens)."""
    model = load_model("tiny", seed=0)
    cache_dir = tmp_path_factory.mktemp("xc")
    with pytest.MonkeyPatch.context() as mp:
        engine, lowered = _start(model, cache_dir, mp)
        tokens = _tokens(engine)
    assert lowered and engine.runner.disk.misses == len(lowered)
    assert len(list((cache_dir / "executables").glob("*.exe"))) == len(lowered)
    return model, cache_dir, list(lowered), tokens


def test_a_warm_start_loads_its_shapes_without_lowering(filled, monkeypatch, caplog):
    model, cache_dir, shapes, want = filled
    engine, lowered = _start(model, cache_dir, monkeypatch)
    engine.runner.shapes = shapes              # warm-up over what the first run compiled
    with caplog.at_level(logging.INFO, logger="stratum_jax.model_runner"):
        engine.warmup(progress=False)
    assert lowered == [] and engine.runner.disk.hits == len(shapes)
    assert f"loaded {len(shapes)} step shapes from the executable cache" in caplog.text
    assert _tokens(engine) == want and lowered == []


def test_a_damaged_entry_is_compiled_again_and_another_config_is_another_key(filled, tmp_path, monkeypatch, caplog):
    model, cache_dir, shapes, want = filled
    shutil.copytree(cache_dir, tmp_path / "xc")
    entry = sorted((tmp_path / "xc" / "executables").glob("*.exe"))[0]
    entry.write_bytes(b"not an executable")
    engine, lowered = _start(model, tmp_path / "xc", monkeypatch)
    with caplog.at_level(logging.WARNING, logger="stratum_jax.executable_cache"):
        assert _tokens(engine) == want
    assert len(lowered) == 1 and "dropping unreadable entry" in caplog.text
    assert entry.read_bytes() != b"not an executable"                 # written again by the recompile

    # Another config is another key (checked on the keys: compiling it would only repeat the cold start).
    other, _ = _start(model, tmp_path / "xc", monkeypatch, max_batch_size=2)
    assert all(other.runner._disk_key(s, other.kv_cache) != engine.runner._disk_key(s, engine.kv_cache)
               for s in shapes)
    assert all(engine.runner._disk_key(s, engine.kv_cache) == engine.runner._disk_key(s, engine.kv_cache)
               for s in shapes)


def test_no_disk_cache_without_a_directory_or_with_interpreted_kernels(filled, monkeypatch):
    model, cache_dir, _, _ = filled
    assert _start(model, cache_dir, monkeypatch, compilation_cache_dir=None)[0].runner.disk is None
    cfg = dataclasses.replace(PRESETS["tiny"], head_dim=64, dtype="bfloat16")     # a shape the kernel takes
    d64 = LoadedModel(config=cfg, params=init_params(cfg, seed=0), tokenizer=ByteTokenizer(cfg.vocab_size),
                      name="tiny-d64")
    kernel = dict(attention="kernel", interpret_kernels=True)
    assert _start(d64, cache_dir, monkeypatch, **kernel)[0].runner.disk is None
    assert _start(d64, cache_dir, monkeypatch)[0].runner.disk is not None
