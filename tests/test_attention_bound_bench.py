"""benchmarks/attention_bound.py: the three layouts of one batch (the timed run needs a GPU; the dry run runs the
kernel in the interpreter on each and checks it against the reference)."""
import numpy as np
import pytest

from benchmark_module import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("attention_bound.py", "attention_bound")


def test_the_layouts_read_the_same_tiles_from_different_places(bench):
    shape = dict(batch=4, context=200, page=32, head_dim=64, block_kv=64, q_heads=8, kv_heads=2)
    hbm, contiguous, l2, one = (bench.make_case(layout, **shape) for layout in bench.LAYOUTS)
    # l2: every row's table is row 0's, with the same lengths; hbm: rows own their pages; contiguous: row b's 7 pages
    # (200 keys of 32) at slots (7 b + i) * 32, one after another.
    assert np.all(np.asarray(l2["page_starts"]) == np.asarray(l2["page_starts"])[:1])
    assert len({tuple(r[:7]) for r in np.asarray(hbm["page_starts"]).tolist()}) == 4
    np.testing.assert_array_equal(np.asarray(contiguous["page_starts"])[:, :7],
                                  (7 * np.arange(4)[:, None] + np.arange(7)[None, :]) * 32)
    assert bench.kv_bytes(hbm) == bench.kv_bytes(contiguous) == bench.kv_bytes(l2) == 4 * 200 * 2 * 64 * 2 * 2
    # one-tile: one block_kv-key tile a row.
    assert np.all(np.asarray(one["lengths"]) == 64) and bench.kv_bytes(one) == 4 * 64 * 2 * 64 * 2 * 2


def test_dry_run_runs_every_layout_checked(bench, tmp_path):
    out = bench.main(["--dry-run", "--out", str(tmp_path / "a.json")])
    (row,) = out["rows"]
    assert set(row["layouts"]) == set(bench.LAYOUTS) and all(v["us"] > 0 for v in row["layouts"].values())
    assert (tmp_path / "a.json").exists()


def test_the_gemm_in_between_streams_about_the_bytes_asked(bench):
    w, _ = bench.between_weight(8.0, 64, 2048)          # llama-1b's o projection: 2048 x 2048 bf16, 8 MiB
    assert w.shape == (2048, 2048) and str(w.dtype) == "bfloat16"
    w, _ = bench.between_weight(0.01, 64, 4096)         # never under one 64-row tile
    assert w.shape == (64, 4096)


@pytest.mark.parametrize("argv", [["--layouts", "dram"], ["--pages", "48"], ["--between", "8"]])
def test_bad_flags_say_what_to_fix(bench, argv, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--dry-run", *argv])
    assert argv[0] in capsys.readouterr().err
