"""benchmarks/fp8_fold_sweep.py: the dry run runs the fp8-pool swapped kernel in the interpreter against the bf16
kernel on the same values, per config; a config value the kernel refuses is an error that says what to fix."""
import pytest

from benchmark_module import load_benchmark


@pytest.fixture(scope="module")
def sweep():
    return load_benchmark("fp8_fold_sweep.py", "fp8_fold_sweep")


def test_dry_run_checks_each_config_against_bf16(sweep, tmp_path):
    out = sweep.main(["--dry-run", "--configs", "default;fp8_q_terms=3", "--out", str(tmp_path / "s.json")])
    (shape,) = out["shapes"]
    assert [r["config"]["fp8_q_terms"] for r in shape["runs"]] == [3, 3]   # head_dim 64: the bf16 default tiles
    assert all(r["ok"] and r["max_abs_err_vs_bf16"] < 1e-2 for r in shape["runs"]), shape["runs"]
    assert (tmp_path / "s.json").exists()


def test_bad_config_says_what_to_fix(sweep, tmp_path):
    with pytest.raises(SystemExit, match="fp8_q_terms"):
        sweep.main(["--dry-run", "--configs", "fp8_q_terms=7", "--out", str(tmp_path / "s.json")])
