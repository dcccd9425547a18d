"""benchmarks/e2e_decode.py --collective-variant: what each variant sets, that it refuses to act once jax's
backend has started (it would silently not apply), and that this jaxlib's XLA knows every variant's flags
(an unknown XLA flag aborts the process: a GPU session would lose the run)."""
import importlib.util
import os
import pathlib
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def e2e():
    sys.path.insert(0, str(ROOT / "benchmarks"))          # e2e_decode imports tp_profile_split
    try:
        spec = importlib.util.spec_from_file_location("e2e_decode", ROOT / "benchmarks" / "e2e_decode.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def test_a_variant_appends_its_flags_and_sets_its_environment(e2e, monkeypatch):
    monkeypatch.setattr(e2e.xla_bridge, "backends_are_initialized", lambda: False)
    environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    got = e2e.apply_collective_variant("one-shot+cmdbuf", environ)
    flags, env = e2e.COLLECTIVE_VARIANTS["one-shot+cmdbuf"]
    assert environ["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=2", *flags]
    assert got["xla_flags"] == environ["XLA_FLAGS"]
    environ = {}
    e2e.apply_collective_variant("nccl-ll", environ)
    assert environ == e2e.COLLECTIVE_VARIANTS["nccl-ll"][1] and "XLA_FLAGS" not in environ


def test_a_variant_after_the_backend_started_is_refused(e2e):
    jax.devices()                                          # the backend is up in this process
    with pytest.raises(RuntimeError, match="already initialised"):
        e2e.apply_collective_variant("one-shot", {})
    assert e2e.apply_collective_variant("default", {})["xla_flags"] == ""    # sets nothing: allowed
    with pytest.raises(ValueError, match="--collective-variant must be one of"):
        e2e.apply_collective_variant("two-shot", {})


def test_this_jaxlib_knows_every_variants_flags(e2e):
    flags = sorted({f for fl, _ in e2e.COLLECTIVE_VARIANTS.values() for f in fl})
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags))
    run = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; print(float(jnp.ones(3).sum()))"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "3.0", run.stderr[-2000:]
