"""benchmarks/chain_overhead.py: what a chain of calls in one executable costs beyond its kernels (the check behind
kernels.py's device timing, #12's verdict). The trace reading runs on a small jnp chain on the CPU (the XLA ops stand
in for kernels); flags that cannot work say what to fix."""
import jax.numpy as jnp
import pytest

from benchmark_module import load_benchmark


@pytest.fixture(scope="module")
def chain():
    return load_benchmark("chain_overhead.py", "chain_overhead")


def test_traced_chain_reads_the_device_span_and_the_dispatch(chain):
    fn = lambda x, w: jnp.tanh(x @ w)                                       # noqa: E731
    x, w = jnp.ones((64, 64)), jnp.eye(64) * 0.5
    short, long = (chain.traced_chain(chain.chained(fn, n), (x, w), "/host:CPU") for n in (2, 6))
    for t in (short, long):
        assert t["kernels"] > 0 and 0 < t["busy_us"] <= t["span_us"] + 1e-6
        assert t["host_lead_us"] >= 0          # the jitted call starts before its first op
        assert t["top_host"] and all(h["us"] >= 0 for h in t["top_host"])
    assert long["kernels"] > short["kernels"]   # three times the calls: more traced ops


@pytest.mark.parametrize("argv, message", [(["--chains", "8,x"], "comma-separated"),
                                           (["--chains", "0,8"], ">= 1"),
                                           (["--kernels", "paged,triton"], "paged and/or fp8")])
def test_bad_flags_say_what_to_fix(chain, argv, message, capsys):
    with pytest.raises(SystemExit):
        chain.main(argv)
    assert message in capsys.readouterr().err
