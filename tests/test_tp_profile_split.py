"""benchmarks/tp_profile_split.py: GPU kernel time split into compute and communication (synthetic trace)."""
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def split():
    spec = importlib.util.spec_from_file_location("tp_profile_split", ROOT / "benchmarks" / "tp_profile_split.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.split


def test_collectives_count_as_communication_and_overlap_once_in_busy_time(split):
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    kernels = [{"ph": "X", "pid": 1, "name": "fusion.3", "ts": 0, "dur": 10},
               {"ph": "X", "pid": 1, "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "ts": 5, "dur": 10},
               {"ph": "X", "pid": 1, "name": "all-gather-start.1", "ts": 30, "dur": 2},
               {"ph": "X", "pid": 2, "name": "all-reduce on the host", "ts": 0, "dur": 99}]
    got = split(meta + kernels)
    assert list(got) == ["/device:GPU:0"]
    assert got["/device:GPU:0"] == {"compute_us": 10.0, "communication_us": 12.0, "busy_us": 17.0}
