"""The committed Python stubs must be what serving/proto/regenerate.py makes from stratum.proto today."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
STUBS = ROOT / "serving" / "proto" / "stratum" / "v1"


@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="grpcio-tools is not installed")
def test_committed_stubs_match_the_proto(tmp_path):
    from serving.proto import regenerate

    for fresh in regenerate.generate(tmp_path):
        committed = STUBS / fresh.name
        assert committed.exists(), f"{committed} is missing: run python serving/proto/regenerate.py"
        assert committed.read_text() == fresh.read_text(), (
            f"{committed.relative_to(ROOT)} is stale: run python serving/proto/regenerate.py and commit the result")


def test_stubs_import_through_the_package():
    from serving.proto.stratum.v1 import stratum_pb2, stratum_pb2_grpc

    service = stratum_pb2.DESCRIPTOR.services_by_name["Stratum"]
    assert service.full_name == "stratum.v1.Stratum"
    assert {m.name for m in service.methods} == {"Messages", "CountTokens", "CostEstimate", "Health", "GetMetrics",
                                                 "Profile"}
    assert hasattr(stratum_pb2_grpc, "StratumStub")
