"""benchmarks/dmlp_predict_cost.py: times the predictor per row count on the chosen device and says what to fix
for bad flags."""
import json

import pytest

from benchmark_module import load_benchmark
from dmlp_checkpoint import write_checkpoint


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("dmlp_predict_cost.py", "dmlp_predict_cost")


def test_times_each_row_count_on_the_cpu(bench, tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt")
    out = bench.main(["--checkpoint", ckpt, "--device", "cpu", "--rows", "3,70", "--calls", "2",
                      "--out", str(tmp_path / "r.json")])
    assert [r["rows"] for r in out["results"]] == [3, 70] and all(r["ms_median"] > 0 for r in out["results"])
    assert "cpu" in out["device"].lower()
    assert json.loads((tmp_path / "r.json").read_text())["results"] == out["results"]


@pytest.mark.parametrize("argv, match", [(["--rows", "x"], "comma-separated"), (["--rows", "0"], ">= 1")])
def test_bad_flags(bench, tmp_path, argv, match):
    with pytest.raises(SystemExit, match=match):
        bench.main(["--checkpoint", str(tmp_path), *argv])
