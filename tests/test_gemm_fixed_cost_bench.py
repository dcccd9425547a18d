"""benchmarks/gemm_fixed_cost.py: the dry run checks the fit on exact points and the kernels it times against their
references (interpreter); bad flags say what to fix (the timed run needs a GPU)."""
import pytest

from benchmark_module import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("gemm_fixed_cost.py", "gemm_fixed_cost")


def test_the_fit_recovers_a_fixed_cost_and_a_rate(bench):
    fixed, rate = bench.fit([8e6, 16e6, 32e6], [2.5 + b / 3.0e6 for b in (8e6, 16e6, 32e6)])
    assert fixed == pytest.approx(2.5) and rate == pytest.approx(3.0)


def test_dry_run_runs_the_kernels_it_times(bench, tmp_path):
    out = bench.main(["--dry-run", "--out", str(tmp_path / "a.json")])
    assert set(out["errors"]) == {"tiny", "tiny_gated"}
    assert max(out["errors"].values()) < 2.0 ** -7          # bf16 roundings of the gated product at most
    assert (tmp_path / "a.json").exists()


@pytest.mark.parametrize("argv,match", [
    (["--families", "nope"], "--families: choose from"),
    (["--stages", "x"], "not a comma-separated list"),
    (["--stages", "1"], "--stages must be >= 2"),
    ([], "needs an NVIDIA Hopper GPU"),
])
def test_bad_flags_say_what_to_fix(bench, argv, match):
    with pytest.raises(SystemExit, match=match):
        bench.main(argv + ["--out", ""])
