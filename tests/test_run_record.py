"""benchmarks/run_record.py: the header every saved benchmark result starts with, and its JSON writer."""
import json
import os
import sys

import jax

from benchmark_module import load_benchmark


def test_provenance_names_the_run(monkeypatch):
    record = load_benchmark("run_record.py", "run_record")
    monkeypatch.setattr(sys, "argv", ["benchmarks/kernels.py", "--delta", "--quick"])
    head = record.provenance("kernels")
    assert head["benchmark"] == "kernels" and head["command"] == "benchmarks/kernels.py --delta --quick"
    assert head["jax"].count(".") >= 2 and len(head["date"]) == 10
    # On the CPU backend the core count, which a CPU timing depends on; elsewhere the device's kind.
    device = jax.devices()[0]
    assert head["device"] == (f"cpu ({os.cpu_count()} cores)" if device.platform == "cpu" else device.device_kind)
    # A device a script names itself wins.
    assert record.provenance("kernels", device="NVIDIA H200")["device"] == "NVIDIA H200"


def test_save_json_makes_the_folder_and_round_trips(tmp_path):
    record = load_benchmark("run_record.py", "run_record")
    doc = {"rows": [{"ms": 0.25, "ok": True}], "nan": None}
    path = record.save_json(tmp_path / "new" / "deeper" / "result.json", doc)
    text = path.read_text()
    assert path == tmp_path / "new" / "deeper" / "result.json" and text.endswith("}\n")
    assert json.loads(text) == doc
    assert "\n" not in record.save_json(tmp_path / "flat.json", doc, indent=None).read_text().rstrip("\n")
