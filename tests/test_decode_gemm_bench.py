"""benchmarks/decode_gemm.py: the dry run checks the kernel in the interpreter against the reference, and bad
flags get an error that says what to fix (the timed run needs a GPU); benchmarks/ncu_decode_kernels.py's calls."""
import pytest

from benchmark_module import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("decode_gemm.py", "decode_gemm")


def test_dry_run_checks_the_kernel(bench):
    out = bench.main(["--dry-run", "--configs", "default;tile_n=64,num_stages=2"])
    assert out["dry_run"] and len(out["results"]) == 6 and sum(r["gated"] for r in out["results"]) == 2
    assert all(r["rel_err"] < 1e-2 for r in out["results"])


@pytest.mark.parametrize("argv, match", [
    (["--dry-run", "--configs", "tile_n=100"], "tile_n must be"),
    (["--dry-run", "--configs", "stages=3"], "not field=value"),
    (["--dry-run", "--rows", "0"], r"\[1, 256\]"),
    (["--dry-run", "--rows", "x"], "comma-separated list of ints"),
])
def test_bad_flags_say_what_to_fix(bench, argv, match):
    with pytest.raises(SystemExit, match=match):
        bench.main(argv)


def test_projections_of_a_preset(bench):
    from stratum_jax.model.config import PRESETS
    shapes = bench.projections(PRESETS["llama-1b"])
    assert shapes == {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
                      "lm_head": (128256, 2048), "gate_up_act": (16384, 2048)}


def test_ncu_probe_runs_each_kernel_against_its_reference(capsys):
    """benchmarks/ncu_decode_kernels.py (what ncu profiles on the H200) at small shapes in the interpreter: it runs the
    attention kernel and both GEMMs and prints each one's error against its reference, all small."""
    probe = load_benchmark("ncu_decode_kernels.py", "ncu_decode_kernels")
    assert probe.main(["--interpret", "--small", "--calls", "1"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    errors = dict(part.split() for part in line.split(": ", 1)[1].split(", "))
    assert set(errors) == {"attention", "matmul_128x256", "matmul_128x512"}
    assert all(float(e) < 0.05 for e in errors.values()), errors
