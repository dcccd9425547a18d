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


def test_fold_dry_run_times_the_whole_fold_call(sweep, tmp_path):
    """--fold: a config runs the engine's fold call (s_k into q, s_v and a_v onto a bf16 output; here the map in
    the kernel's epilogue), checked against the bf16 kernel's attention with the same map."""
    out = sweep.main(["--dry-run", "--fold", "--configs", "num_splits=1,out_affine_in_kernel=True",
                      "--out", str(tmp_path / "s.json")])
    (shape,) = out["shapes"]
    assert out["meta"]["fold"] is True
    (run,) = shape["runs"]
    assert run["config"]["out_affine_in_kernel"] and run["ok"] and run["max_abs_err_vs_bf16"] < 5e-2, run


def test_ncu_probe_checks_the_fp8_kernel_against_the_paged_kernel(capsys):
    """benchmarks/ncu_fp8_attention.py (what ncu profiles for #12's bar) at small shapes in the interpreter: the fp8
    kernel on mixed pages against the bf16 paged kernel over the same values; a bad page size says what to fix."""
    probe = load_benchmark("ncu_fp8_attention.py", "ncu_fp8_attention")
    assert probe.main(["--interpret", "--small", "--calls", "1", "--page", "mixed"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("fp8 B=2") and float(line.rsplit(" ", 1)[1]) < 3e-2, line
    # the fold's path with a config override (the merged fold's cluster barrier hangs the interpreter by luck:
    # cluster_interpreter.py, so the one-launch config here)
    one = "num_splits=1,shared_smem=True,out_affine_in_kernel=True"
    assert probe.main(["--interpret", "--small", "--calls", "1", "--page", "16", "--fold", one]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"fp8 fold {one} B=2") and float(line.rsplit(" ", 1)[1]) < 3e-2, line
    with pytest.raises(SystemExit, match="not field=value"):
        probe.main(["--interpret", "--small", "--fold", "splits=2"])
    with pytest.raises(SystemExit):
        probe.main(["--interpret", "--small", "--page", "12"])
    assert "--page must be one of" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        probe.main(["--interpret", "--small", "--kernel", "paged", "--fold", "num_splits=1"])
    assert "add --kernel fp8" in capsys.readouterr().err
