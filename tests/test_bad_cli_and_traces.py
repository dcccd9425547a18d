"""Bad CLI flags and bad trace files get a clear error that names the flag (or the file and line) and says what to
fix: no traceback, no silently wrong run. Every test here is fast: argument parsing, config validation and the
trace readers, called directly (one test opens a gRPC port, and no model is loaded)."""
from __future__ import annotations

import json
import logging
import socket

import pytest

from benchmarks import serving_trace
from serving.options import ServerOptions
from stratum_jax import client, generate, serve, train_dmlp
from stratum_jax.config import RuntimeConfig
from training import shift
from training.traces import TraceFormatError, read_mooncake

GOOD = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}


def _write(path, lines) -> str:
    path.write_bytes(b"".join((l if isinstance(l, bytes) else json.dumps(l).encode()) + b"\n" for l in lines))
    return str(path)


# ---- environment variables: a bad value is a usage error of the command, not a traceback ----

@pytest.mark.parametrize("env, value, message", [
    ("STRATUM_DKVC_PRECISION", "fp9", "$STRATUM_DKVC_PRECISION) must be one of"),
    ("STRATUM_HAB_THRESHOLD_MS", "soon", "$STRATUM_HAB_THRESHOLD_MS must be a number of ms"),
    ("STRATUM_HAB_THRESHOLD_MS", "nan", "$STRATUM_HAB_THRESHOLD_MS) must be a finite number of ms"),
])
def test_bad_environment_value_is_a_usage_error(monkeypatch, capsys, env, value, message):
    monkeypatch.setenv(env, value)
    generate.build_parser()                  # building the parser reads no environment: no error yet
    with pytest.raises(SystemExit) as e:
        serve.main(["--model", "tiny"])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert generate.main(["--model", "tiny", "--prompt", "x"]) == 2
    assert message in capsys.readouterr().err


# ---- RuntimeConfig (serve and generate) ----

def test_runtime_config_checks_paths_and_seed_before_the_model_loads(tmp_path):
    with pytest.raises(ValueError, match="--trace-out .*: is a directory"):
        RuntimeConfig(trace_out=str(tmp_path))
    with pytest.raises(ValueError, match="--trace-out .*its directory .*missing.* does not exist"):
        RuntimeConfig(trace_out=str(tmp_path / "missing" / "events.jsonl"))
    RuntimeConfig(trace_out=str(tmp_path / "events.jsonl"))
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match="--compilation-cache-dir .*afile: is a file"):
        RuntimeConfig(compilation_cache_dir=str(tmp_path / "afile"))
    with pytest.raises(ValueError, match="--engine-seed must be an integer >= 0, got -1"):
        RuntimeConfig(seed=-1)


# ---- ServerOptions and serve ----

def test_server_options_refuse_contradicting_and_unusable_flags(tmp_path):
    with pytest.raises(ValueError, match="--port and --metrics-port are both 5000"):
        ServerOptions(port=5000, metrics_port=5000)
    with pytest.raises(ValueError, match="--port and --http-port are both 5000"):
        ServerOptions(port=5000, http_port=5000)
    with pytest.raises(ValueError, match="--metrics-port and --profile-port are both 6000"):
        ServerOptions(metrics_port=6000, profile_port=6000, metrics_host="127.0.0.2")
    ServerOptions(port=5000, http_port=5000, http_host="127.0.0.2")          # two addresses: no clash
    with pytest.raises(ValueError, match="--baseline-kv-pool-tokens sizes the baseline stack, which is not running"):
        ServerOptions(baseline_kv_pool_tokens=1024)
    with pytest.raises(ValueError, match="--long-context-max-context sizes the long-context stack"):
        ServerOptions(long_context_max_context=512)
    with pytest.raises(ValueError, match="--gpu-usd-per-hour must be a finite number"):
        ServerOptions.from_cli_args(serve.build_parser().parse_args(["--gpu-usd-per-hour", "inf"]))
    not_pem = tmp_path / "cert.pem"
    not_pem.write_text("hello\n")
    with pytest.raises(ValueError, match="--tls-cert .*cert.pem: not a PEM file"):
        ServerOptions(tls_cert=str(not_pem), tls_key=str(not_pem))
    comments = tmp_path / "keys.txt"
    comments.write_text("# no keys yet\n")
    with pytest.raises(ValueError, match="--keys-file .*keys.txt: no keys in it"):
        ServerOptions(keys_file=str(comments))


def test_serve_names_the_flags_when_a_port_is_taken(caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.ERROR, logger="stratum_jax.serve"):
            rc = serve.main(["--model", "tiny", "--port", "0", "--metrics-port", str(port),
                             "--compilation-cache-dir", "none"])
    assert rc == 2
    assert "could not open the server's ports" in caplog.text and f"--metrics-port {port}" in caplog.text


# ---- client ----

@pytest.mark.parametrize("argv, message", [
    (["hi", "--tls-ca", "/nonexistent/ca.pem"], "--tls-ca /nonexistent/ca.pem: cannot read it"),
    (["hi", "--tls-ca", __file__], "not a PEM certificate"),
    (["hi", "--max-tokens", str(2**40)], "--max-tokens must be an integer in [1, 2147483647]"),
    (["hi", "--seed", "-1"], "--seed must be an integer in [0, "),
    (["hi", "--top-k", str(2**40)], "--top-k must be an integer"),
    (["--profile", "-1"], "--profile must be an integer in [1, "),
    (["hi", "--timeout", "0"], "--timeout must be a number of seconds > 0"),
    (["hi", "--timeout", "nan"], "--timeout must be a number of seconds > 0"),
    (["--health", "a prompt"], "--health, --metrics and --profile send no prompt"),
])
def test_client_bad_flags(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        client.main(["--target", "127.0.0.1:1"] + argv)      # nothing listens there: no call may be made
    assert e.value.code == 2 and message in capsys.readouterr().err


# ---- train_dmlp ----

@pytest.mark.parametrize("extra, message", [
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--learning-rate", "nan"], "--learning-rate must be a finite number > 0"),
    (["--learning-rate", "-1"], "--learning-rate must be a finite number > 0"),
    (["--horizons-ms", "nan"], "--horizons-ms must be finite numbers > 0 in increasing order"),
    (["--capacity-fracs", "0"], "--capacity-fracs must lie in (0, 1]"),
    (["--capacity-fracs", "-1"], "--capacity-fracs must lie in (0, 1]"),
    (["--host-frac", "-1"], "--host-frac must be a finite number >= 0"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--time-scale", "inf"], "--time-scale must be a finite number > 0"),
    (["--warmup-traces", "w.jsonl"], "--warmup-traces applies to --eval-only"),
    (["--checkpoint", "ckpt"], "--checkpoint applies to --eval-only"),
    (["--online-track", "0.5"], "--online-track applies to --online replays"),
])
def test_train_dmlp_bad_flags(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit):
        train_dmlp.parse_args(["--traces", "t.jsonl", "--format", "mooncake", "--out", str(tmp_path / "o")] + extra)
    assert message in capsys.readouterr().err


def test_train_dmlp_output_paths(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit):
        train_dmlp.parse_args(["--traces", "t.jsonl", "--format", "mooncake", "--out", str(tmp_path / "afile")])
    assert "--out " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_dmlp.parse_args(["--eval-only", "--checkpoint", "c", "--traces", "t.jsonl", "--format", "mooncake",
                               "--report", str(tmp_path / "missing" / "r.json")])
    assert "--report " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_dmlp.parse_args(["--eval-only", "--checkpoint", "c", "--traces", "t.jsonl", "--format", "mooncake",
                               "--report", str(tmp_path / "r.json"), "--out", str(tmp_path)])
    assert "--out is where training writes" in capsys.readouterr().err


# ---- Mooncake traces: training/traces.py and training/shift.py ----

@pytest.mark.parametrize("bad, message", [
    (b'{"timestamp": 1, "input_length": 600, "output_length": 5, "hash_ids": [1, \xff]}', "not UTF-8 text"),
    (b'{"timestamp": 1' + b"0" * 400 + b', "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}',
     "'timestamp' must be a finite number"),
    ({**GOOD, "timestamp": 1, "hash_ids": [3, 3]}, "hash id 3 appears twice"),
])
def test_training_trace_reader_names_the_line(tmp_path, bad, message):
    p = _write(tmp_path / "t.jsonl", [GOOD, bad])
    for read in (read_mooncake, shift.read_records):
        with pytest.raises(TraceFormatError) as e:
            read(p)
        assert str(e.value).startswith(f"{p}:2: ") and message in str(e.value)


def test_shift_reads_checked_records_and_keeps_its_input(tmp_path, capsys):
    p = _write(tmp_path / "t.jsonl", [GOOD, "{not json".encode()])
    with pytest.raises(TraceFormatError, match=r"t.jsonl:2: not valid JSON"):
        shift.read_records(p)
    good = _write(tmp_path / "g.jsonl", [GOOD])
    before = (tmp_path / "g.jsonl").read_bytes()
    with pytest.raises(SystemExit):
        shift.main(["--trace", good, "--out", good, "--rate", "2"])
    assert "is the --trace file" in capsys.readouterr().err
    assert (tmp_path / "g.jsonl").read_bytes() == before


# ---- Mooncake traces: the serving replay's reader (benchmarks/serving_trace.py) ----

@pytest.mark.parametrize("bad, message", [
    ({**GOOD, "hash_ids": "12"}, "'hash_ids' must be a non-empty list of integers"),      # was read as (1, 2)
    ({**GOOD, "hash_ids": [1.5, 2]}, "'hash_ids' must be a non-empty list of integers"),  # was truncated to 1
    ({**GOOD, "timestamp": "12"}, "'timestamp' must be a number of ms"),
    ({**GOOD, "timestamp": -5}, "'timestamp' must be a number of ms"),
    (b'{"timestamp": Infinity, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}',
     "'timestamp' must be a number of ms"),
    ({**GOOD, "input_length": True}, "'input_length' must be an integer >= 1"),
    ({**GOOD, "output_length": 7.9}, "'output_length' must be an integer >= 1"),
    (b'{"timestamp": 1, "input_length": 600, "output_length": 5, "hash_ids": [1, \xff]}', "not UTF-8 text"),
])
def test_serving_replay_reader_does_not_coerce(tmp_path, bad, message):
    p = tmp_path / "t.jsonl"
    _write(p, [GOOD, bad])
    with pytest.raises(ValueError) as e:
        serving_trace.load_trace(p, 0, 2)
    assert str(e.value).startswith(f"{p}:2: ") and message in str(e.value)


def test_serving_replay_reader_skips_blank_lines(tmp_path):
    p = tmp_path / "t.jsonl"
    _write(p, [GOOD, b"", {**GOOD, "timestamp": 3000}, b"   "])
    window = serving_trace.load_trace(p, 0, 2)
    assert [(r.index, r.timestamp_ms) for r in window] == [(0, 0), (2, 3000)]
    assert [r.index for r in serving_trace.load_trace(p, 1, 1)] == [2]


# ---- a KV pool larger than the device: refused before allocating, naming the flag ----

def test_a_kv_pool_larger_than_the_device_is_refused_naming_the_flag(monkeypatch):
    import jax

    from stratum_jax.engine import Engine
    from stratum_jax.kv import pool_memory
    from stratum_jax.kv.pool_memory import free_bytes, pool_bytes
    from stratum_jax.model.config import PRESETS

    # The host's available memory moves from moment to moment; pin it so the refusal's edge is exact.
    free = 1 << 30
    monkeypatch.setattr(pool_memory, "_host_available_bytes", lambda: free)
    assert free_bytes(jax.devices()[0]) == free
    cfg = PRESETS["tiny"]
    tokens = (free // pool_bytes(cfg, 1, "bf16") + 1) // 256 * 256 + 256     # just past what the host holds
    with pytest.raises(ValueError, match=r"--kv-pool-tokens \d+ needs .* 1.0 GiB is host memory: lower "
                                         r"--kv-pool-tokens to at most about \d+"):
        Engine(RuntimeConfig(model="tiny", kv_pool_tokens=tokens, max_context=256))
    fits = (free // 2) // pool_bytes(cfg, 1, "bf16") // 256 * 256
    assert pool_bytes(cfg, fits, "bf16") <= free       # the check's arithmetic: half the host's memory passes it
    assert pool_bytes(cfg, 1024, "fp8-delta") * 2 == pool_bytes(cfg, 1024, "bf16")


def test_the_host_check_counts_available_memory_not_installed_memory():
    import os

    from stratum_jax.kv.pool_memory import _host_available_bytes
    available = _host_available_bytes()
    assert available is not None and 0 < available <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
