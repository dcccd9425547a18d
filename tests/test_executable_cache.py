"""The export cache of step programs (stratum_jax/executable_cache.py): a restart reads every step
program back instead of tracing it and produces the same tokens; unreadable files are replaced; the
key follows the source."""
import json
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from stratum_jax import executable_cache
from stratum_jax.executable_cache import SUBDIRECTORY, ExportedSteps

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@jax.jit
def _affine(x, y):
    return x * 2.0 + y


def _generate(cache_dir):
    """One `generate` process on the tiny preset (greedy and sampled prompts): (token ids per prompt, log)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    cmd = [sys.executable, "-m", "stratum_jax.generate", "--model", "tiny", "--max-batch-size", "4",
           "--max-context", "256", "--compilation-cache-dir", str(cache_dir), "--prompt", "hello world",
           "--prompt", "a longer prompt " * 8, "--max-tokens", "12", "--ignore-eos", "--json"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokens = [json.loads(line)["token_ids"] for line in proc.stdout.splitlines() if line.startswith("{")]
    return tokens, proc.stderr


def test_a_restart_reads_the_exported_programs_and_generates_the_same_tokens(tmp_path):
    first, log1 = _generate(tmp_path)
    files = sorted((tmp_path / SUBDIRECTORY).glob("*.jax_exported"))
    assert files, log1[-2000:]
    mtimes = [f.stat().st_mtime_ns for f in files]
    second, log2 = _generate(tmp_path)
    assert second == first and len(first) == 2 and all(len(t) == 12 for t in first)
    # read back, not exported again (an export rewrites its file)
    assert sorted((tmp_path / SUBDIRECTORY).glob("*.jax_exported")) == files
    assert [f.stat().st_mtime_ns for f in files] == mtimes


def test_an_unreadable_file_is_exported_again_and_replaced(tmp_path, caplog):
    cache = ExportedSteps(str(tmp_path))
    x, y = jnp.arange(4.0), jnp.ones(4)
    path = cache.path_for("affine", ("key",))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a flatbuffer")
    with caplog.at_level(logging.WARNING, logger="stratum_jax.executable_cache"):
        out = cache.lower("affine", ("key",), _affine, (x, y), {}).compile()(x, y)
    np.testing.assert_array_equal(np.asarray(out), np.arange(4.0) * 2 + 1)
    assert "not readable" in caplog.text and cache.exports == 1
    again = ExportedSteps(str(tmp_path))
    np.testing.assert_array_equal(np.asarray(again.lower("affine", ("key",), _affine, (x, y), {}).compile()(x, y)),
                                  np.asarray(out))
    assert again.hits == 1 and not list(path.parent.glob("*.tmp"))


def test_the_file_name_follows_the_key_and_the_source(tmp_path, monkeypatch):
    cache = ExportedSteps(str(tmp_path))
    a = cache.path_for("affine", ("key", 1))
    assert a == cache.path_for("affine", ("key", 1)) != cache.path_for("affine", ("key", 2))
    monkeypatch.setattr(executable_cache, "source_digest", lambda: "edited")
    assert cache.path_for("affine", ("key", 1)) != a


def test_without_a_directory_nothing_is_written(tmp_path):
    cache = ExportedSteps(None)
    x = jnp.ones(3)
    assert np.asarray(cache.lower("affine", (), _affine, (x, x), {}).compile()(x, x)).tolist() == [3.0] * 3
    assert cache.exports == cache.hits == 0 and not list(tmp_path.iterdir())


def test_old_files_are_pruned_past_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(executable_cache, "MAX_FILES", 2)
    cache = ExportedSteps(str(tmp_path))
    x = jnp.ones(2)
    for i in range(4):
        cache.lower("affine", ("key", i), _affine, (x, x), {})
        os.utime(cache.path_for("affine", ("key", i)), ns=(i * 10**9, i * 10**9))   # written in this order
    left = sorted(p.name for p in (tmp_path / SUBDIRECTORY).iterdir())
    assert left == sorted(cache.path_for("affine", ("key", i)).name for i in (2, 3))


def test_fresh_engine_steps_makes_an_engine_of_a_compiled_config_trace_its_steps(monkeypatch, request):
    """Engines of one config share this process's compiled steps (model_runner._EXECUTABLES) and the step functions'
    trace caches, so a second engine runs without tracing; tests that count what a step traces take the
    `fresh_engine_steps` fixture (conftest.py) to see a trace whatever ran before them in the process."""
    from stratum_jax import model_runner
    from stratum_jax.config import RuntimeConfig
    from stratum_jax.engine import Engine
    from stratum_jax.model import llama
    from stratum_jax.request import SamplingParams

    traced = []
    real = llama.forward
    monkeypatch.setattr(llama, "forward", lambda *a, **kw: traced.append(1) or real(*a, **kw))

    def run():
        engine = Engine(RuntimeConfig(model="tiny", max_context=128, kv_pool_tokens=1024, max_batch_size=2,
                                      prefill_chunk=32, decode_steps=2, attention="reference", projections="xla"))
        return [r.token_ids for r in engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0,
                                                                                   ignore_eos=True))]
    first = run()
    traced.clear()
    assert run() == first and not traced          # the first engine's steps, untraced
    shared = model_runner._EXECUTABLES
    request.getfixturevalue("fresh_engine_steps")
    assert run() == first and traced              # traced anew
    assert model_runner._EXECUTABLES is not shared and shared      # the others' steps kept, to come back after
