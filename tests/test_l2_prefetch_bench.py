"""benchmarks/l2_prefetch.py: the dry run runs the layer skeleton on the engine's kernels (interpreter) with and
without the prefetch and finds the same bits, the plans' sizes are what the budgets ask, and bad flags say what to
fix (the timed run needs a GPU)."""
import pytest

from benchmark_module import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("l2_prefetch.py", "l2_prefetch")


def test_dry_run_keeps_the_bits(bench, tmp_path):
    out = bench.main(["--dry-run", "--budgets", "0,1,1:down", "--out", str(tmp_path / "a.json")])
    assert [r["variant"] for r in out["results"]] == ["0", "1", "1:down"]
    assert all(r["same_bits_as_no_prefetch"] for r in out["results"])
    off, on, down = (r["prefetched_mb"] for r in out["results"])
    assert off == {"qkv": 0.0, "gate_up": 0.0, "down": 0.0} and all(0 < mb <= 1.0 for mb in on.values())
    assert down == {"qkv": 0.0, "gate_up": 0.0, "down": on["down"]}
    assert (tmp_path / "a.json").exists()


def test_the_budgets_at_llama_shapes(bench):
    """llama-1b at 64 rows: q/k/v (12 MB) whole from 12 MB up, gate/up (64 MB) and down (32 MB) as much as the budget;
    under a budget each split's prefix is rounded down to whole 64-column tiles (q/k/v's 4 splits of 512 columns:
    4 MB -> 2 tiles a split, 3 MB)."""
    shape = bench.layer_shapes("llama-1b")
    assert bench.prefetched_mb(16, shape, 64) == {"qkv": 12.0, "gate_up": 16.0, "down": 16.0}
    assert bench.prefetched_mb(4, shape, 64) == {"qkv": 3.0, "gate_up": 4.0, "down": 4.0}
    assert bench.down_splits(shape, 64) >= 1


@pytest.mark.parametrize("argv, match", [
    (["--dry-run", "--budgets", "x"], r"not MB\[:target"),
    (["--dry-run", "--budgets", "8:lm_head"], "targets must be among"),
    (["--dry-run", "--budgets", "60"], r"\[0, 50\] MB"),
    (["--dry-run", "--rows", "0"], r"\[1, 128\]"),
    (["--dry-run", "--models", "llama-3t"], "unknown presets"),
    (["--budgets", "0"], "needs an NVIDIA Hopper GPU"),
])
def test_bad_flags_say_what_to_fix(bench, argv, match):
    with pytest.raises(SystemExit, match=match):
        bench.main(argv)
