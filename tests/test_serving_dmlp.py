"""The server with --cache-policy dmlp and online fine-tuning: real gRPC over loopback, the stratum_dmlp_*
series in /metrics and GetMetrics, and the fine-tuner's final orbax checkpoint after shutdown."""
from __future__ import annotations

import math
import urllib.request

import grpc
import jax
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from serving.background import BackgroundServer
from serving.options import ServerOptions
from dmlp_checkpoint import write_checkpoint
from serving.proto.stratum.v1 import stratum_pb2 as pb
from serving.proto.stratum.v1 import stratum_pb2_grpc as pb_grpc
from stratum_jax.config import RuntimeConfig
from stratum_jax.dmlp.features import FEATURE_NAMES, Normalizer
from stratum_jax.dmlp.model import DmlpConfig, init_params
from stratum_jax.metrics import DMLP_METRICS
from stratum_jax.dmlp.checkpoint import DmlpCheckpoint, latest_checkpoint, load_checkpoint, save_checkpoint


def _feed_labelled_examples(tuner, rows: int, batch: int = 256, seed: int = 0) -> None:
    """rows labelled examples: raw features [N, F] (the checkpoint's normaliser range) and reuse labels
    [N, H] that are monotone in the horizon (reused within 10 ms implies within 500 ms), as real ones are."""
    rng = np.random.default_rng(seed)
    n_features, n_horizons = len(FEATURE_NAMES), len(tuner.model.config.horizons_ms)
    for start in range(0, rows, batch):
        n = min(batch, rows - start)
        raw = rng.uniform(0, 100, (n, n_features)).astype(np.float32)
        first_reuse = rng.integers(0, n_horizons + 1, n)          # horizon index of the first reuse; H = never
        labels = (np.arange(n_horizons)[None, :] >= first_reuse[:, None]).astype(np.float32)
        assert tuner.observe(raw, labels), "the fine-tuner's queue is full"


def _wait_for(condition, timeout_s: float) -> None:
    """Polls until condition() holds; fails after timeout_s (a bound, not a guess at how long it takes)."""
    import time
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"condition not met within {timeout_s} s"
        time.sleep(0.1)


def test_server_with_dmlp_and_online_fine_tuning(tmp_path):
    online_dir = tmp_path / "online"
    config = RuntimeConfig(model="tiny", max_batch_size=4, max_context=256, max_tokens_cap=64, prefill_chunk=32,
                           max_num_batched_tokens=4 + 128,   # prefill buckets 32-128: 3 packed shapes to compile
                           kv_pool_tokens=512, cache_policy="dmlp",
                           dmlp_checkpoint=write_checkpoint(tmp_path / "ck"), dmlp_online=True,
                           dmlp_online_dir=str(online_dir), dmlp_online_cores=(0,))
    options = ServerOptions(port=0, metrics_port=0, drain_grace_s=0.0, profile_dir=str(tmp_path / "profiles"))
    bg = BackgroundServer(config, options).start()
    try:
        engine = bg.server.runner.engine
        assert engine.dmlp_tuner is not None and engine.dmlp_tuner._process is not None   # started
        with grpc.insecure_channel(bg.target) as channel:
            stub = pb_grpc.StratumStub(channel)
            system = "You are a helpful assistant. Answer briefly and precisely. " * 3
            for i in range(6):
                req = pb.MessagesRequest(system=system, messages=[pb.Message(role="user", content=f"Question {i}")],
                                         max_tokens=6, temperature=0.0)
                events = list(stub.Messages(req, timeout=60))
                assert events[-1].WhichOneof("event") == "stop"
            tuner = engine.dmlp_tuner
            assert tuner.evaluations == 0 and math.isnan(tuner.accuracy)
            # The first round needs OnlineConfig.min_examples training + min_holdout holdout examples, far
            # more than six tiny requests make. Labelled examples go in through the entry the outcome
            # tracker uses (tuner.observe), and the test waits for the worker's first evaluation itself,
            # not for a fixed time.
            _feed_labelled_examples(tuner, rows=4000)
            _wait_for(lambda: tuner.evaluations >= 1 or tuner.error is not None, timeout_s=180)
            assert tuner.error is None, tuner.error
            snap = stub.GetMetrics(pb.GetMetricsRequest(), timeout=10)
        assert snap.HasField("dmlp") and snap.dmlp.online and 0.5 <= snap.dmlp.confidence <= 0.95
        assert tuner.evaluations >= 1 and math.isfinite(snap.dmlp.accuracy) and 0 <= snap.dmlp.accuracy <= 1
        # Later rounds may still swap weights while the test reads: counters only ever grow.
        assert snap.dmlp.updates <= tuner.updates and snap.dmlp.dropped == 0
        assert snap.prefix_cache_hits > 0                  # the shared system prompt was reused
        text = urllib.request.urlopen(bg.metrics_url, timeout=10).read().decode()
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        for name in DMLP_METRICS:
            assert name in samples, f"{name} missing from /metrics"
        assert samples["stratum_dmlp_confidence"] == snap.dmlp.confidence
        assert snap.dmlp.updates <= samples["stratum_dmlp_updates_total"] <= tuner.updates
        assert math.isfinite(samples["stratum_dmlp_accuracy"]) and 0 <= samples["stratum_dmlp_accuracy"] <= 1
    finally:
        bg.stop()
    # Shutdown stopped the fine-tuner after its final checkpoint.
    final = latest_checkpoint(str(online_dir))
    assert final is not None, f"no checkpoint in {online_dir}"
    loaded = load_checkpoint(final)
    assert "online_updates" in loaded.extra and engine.dmlp_tuner._process is None
