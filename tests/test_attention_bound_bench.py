"""benchmarks/attention_bound.py: the layouts of one batch (the timed run needs a GPU; the dry run runs the kernel in
the interpreter on each and checks it against the reference); benchmarks/engine_page_tables.py: the engine's own
page tables for the engine layout."""
import json
import pathlib
import sys

import numpy as np
import pytest

from benchmark_module import load_benchmark

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("attention_bound.py", "attention_bound")


def test_the_layouts_read_the_same_tiles_from_different_places(bench):
    shape = dict(batch=4, context=200, page=32, head_dim=64, block_kv=64, q_heads=8, kv_heads=2)
    hbm, contiguous, l2, one = (bench.make_case(layout, **shape) for layout in ("hbm", "contiguous", "l2", "one-tile"))
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
    assert out["meta"]["engine_tables"] == str(bench.ENGINE_TABLES)
    assert (tmp_path / "a.json").exists()


def test_the_gemm_in_between_streams_about_the_bytes_asked(bench):
    w, _ = bench.between_weight(8.0, 64, 2048)          # llama-1b's o projection: 2048 x 2048 bf16, 8 MiB
    assert w.shape == (2048, 2048) and str(w.dtype) == "bfloat16"
    w, _ = bench.between_weight(0.01, 64, 4096)         # never under one 64-row tile
    assert w.shape == (64, 4096)


def test_own_pools_give_each_call_in_a_row_its_own_copy(bench, monkeypatch):
    """own-pools: one traced call runs the kernel once per copy, each on a distinct copy of K and V (the same
    tables), and the time is per kernel."""
    seen = {}

    def fake_profile(fn, args, *, calls):
        seen["calls"], seen["out"] = calls, fn(*args)
        return {"pallas_us": 12.0, "busy_us": 15.0}
    monkeypatch.setattr(bench, "kernel_profile", fake_profile)
    q, k, v = np.zeros(3, np.float32), np.ones(4, np.float32), np.full(4, 2.0, np.float32)
    fn = lambda x, k_pool, v_pool, lengths: x + k_pool.sum() * 10 + v_pool.sum() + lengths  # noqa: E731
    out = bench.own_pools_time(fn, [q, k, v, np.float32(0.5)], 3, calls=20)
    assert out == {"us": 4.0, "copies": 3, "busy_us": 5.0} and seen["calls"] == 6       # 20 calls: 6 of 3 layers
    # copies i = 0, 1, 2 hold k + i and v + i: sum_i (4 (1 + i) 10 + 4 (2 + i)) + 3 x 0.5
    np.testing.assert_allclose(np.asarray(seen["out"]), [sum(40 * (1 + i) + 4 * (2 + i) for i in range(3)) + 1.5] * 3)


@pytest.mark.parametrize("argv", [["--layouts", "dram"], ["--pages", "48"], ["--between", "8"],
                                  ["--own-pools", "4"]])
def test_bad_flags_say_what_to_fix(bench, argv, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--dry-run", *argv])
    assert argv[0] in capsys.readouterr().err


def test_the_engine_layout_is_the_dumps_tables_cut_to_the_context(bench, tmp_path):
    tables = bench.load_engine_tables(bench.ENGINE_TABLES)      # the committed dump: e2e's batch at 640 keys
    assert len(tables["rows"]) == 64 and {r["page_size"] for r in tables["rows"]} == {32}
    case = bench.make_case("engine", batch=3, context=100, page=32, head_dim=64, block_kv=64, q_heads=8, kv_heads=2,
                           tables=tables)
    np.testing.assert_array_equal(np.asarray(case["page_starts"]),
                                  [r["page_starts"][:4] for r in tables["rows"][:3]])     # 100 keys: 4 pages
    assert np.all(np.asarray(case["lengths"]) == 100) and case["k_pool"].shape == (2, tables["num_slots"], 64)
    with pytest.raises(SystemExit, match="must fit"):
        bench.engine_case(tables, batch=65, context=100, head_dim=64, q_heads=8, kv_heads=2)


@pytest.mark.parametrize("text, match", [
    ("{nope", "not a benchmarks/engine_page_tables.py dump"),
    (json.dumps({"num_slots": 64, "rows": [{"length": 40, "page_size": 32, "page_starts": [0]}]}), "do not hold"),
    (json.dumps({"num_slots": 64, "rows": [{"length": 8, "page_size": 32, "page_starts": [48]}]}), "do not hold"),
    (json.dumps({"num_slots": 64, "rows": [{"length": 8, "page_size": 32, "page_starts": [0]},
                                           {"length": 8, "page_size": 16, "page_starts": [32]}]}), "several page"),
])
def test_bad_engine_tables_say_what_to_fix(bench, tmp_path, text, match):
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(SystemExit, match=match):
        bench.load_engine_tables(path)


def test_the_engine_gives_each_row_its_own_pages(tmp_path):
    """engine_page_tables.py on a small batch (the engine's real allocator and scheduler, e2e's request pattern):
    every row's pages hold its keys, lie in the pool and are no other row's."""
    sys.path.insert(0, str(BENCHMARKS))            # its e2e_decode import
    try:
        dumper = load_benchmark("engine_page_tables.py", "engine_page_tables")
    finally:
        sys.path.pop(0)
    out = dumper.main(["--batch", "4", "--prompt-len", "64", "--new-tokens", "48", "--context", "90",
                       "--out", str(tmp_path / "t.json")])
    assert json.loads((tmp_path / "t.json").read_text()) == out
    rows = out["rows"]
    assert len(rows) == 4 and all(r["length"] >= 90 for r in rows)
    slots = [set(range(p, p + r["page_size"])) for r in rows for p in r["page_starts"]]
    assert all(len(r["page_starts"]) * r["page_size"] >= r["length"] for r in rows)
    assert all(max(s) < out["num_slots"] for s in slots)
    assert sum(map(len, slots)) == len(set().union(*slots))                  # no slot in two pages
    with pytest.raises(SystemExit, match="--context must be past the prompt"):
        dumper.main(["--batch", "4", "--prompt-len", "64", "--new-tokens", "48", "--context", "200"])
