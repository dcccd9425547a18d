"""Tensor parallelism on CPU devices: tp = 2 and 4 give tp = 1's greedy tokens and logprobs, the layout is
Megatron's (per-device shards, two all-reduces per layer), the Pallas kernel runs per shard under
shard_map, an HF checkpoint loads shard by shard, and two processes joined by jax.distributed give one
process's tokens.

The 4-device cases run in subprocesses (tests/tp_cases.py, in two parts side by side): the CPU device
count is fixed when jax starts, and the rest of the suite runs with one device. The two-process run uses
the generate CLI, with one CPU device per process and gloo collectives over loopback, alongside them.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stratum_jax.config import RuntimeConfig

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600
# The generate flags of every run (tp_cases.py's engines and the two processes' CLI), small shapes.
PROMPTS = [[5, 6, 7], list(range(20, 61)), [9] * 17]
FLAGS = ["--max-batch-size", "4", "--max-context", "256", "--kv-pool-tokens", "4096", "--prefill-chunk", "64",
         "--max-num-batched-tokens", "128", "--scheduler", "fcfs", "--compilation-cache-dir", "none",
         "--max-tokens", "6", "--logprobs", "2", "--ignore-eos", "--json"]
for _p in PROMPTS:
    FLAGS += ["--prompt-ids", ",".join(map(str, _p))]
ROWS, PREFILL_BUCKET, HIDDEN, VOCAB, LAYERS = 4, 64, 128, 512, 2     # of tiny with these flags


def _env() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)          # one CPU device per process (tp_cases.py sets its own 4)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results():
    """(the 4-device cases' JSON, [each process's generate output lines] of the two-process run)."""
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "stratum_jax.generate", *FLAGS, "--model", "tiny", "--tensor-parallel", "2",
         "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    parts = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "tp_cases.py"), part, *FLAGS], cwd=ROOT,
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for part in ("engines", "pieces")]
    cases, outputs = {}, []
    for p in parts:
        out, err = p.communicate(timeout=TIMEOUT_S)
        assert p.returncode == 0, err[-3000:]
        cases.update(json.loads(out))
    for p in procs:
        out, err = p.communicate(timeout=TIMEOUT_S)
        assert p.returncode == 0, err[-3000:]
        # gloo prints its connection messages on stdout too: keep the JSON lines.
        outputs.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    return cases, outputs


def _tokens(run):
    return [r["token_ids"] for r in run]


def test_greedy_tokens_and_logprobs_match_one_device(results):
    cases, _ = results
    assert cases["devices"] == 4
    one = cases["runs"]["tiny_tp1"]
    assert all(len(r["token_ids"]) == 6 for r in one)
    for name in ("tiny_tp2", "tiny_tp4_auto"):
        run = cases["runs"][name]
        assert _tokens(run) == _tokens(one), name
        for a, b in zip(run, one):
            for pa, pb in zip(a["logprobs"], b["logprobs"]):       # chosen token, then the top 2
                assert pa == pytest.approx(pb, abs=1e-4), name


def test_delta_kv_cache_splits_over_devices_and_matches_one_device(results):
    """--kv-precision fp8-delta at tp = 2: each device holds the anchor, deltas, scales and floors of its own
    kv head (tiny: 2 KV heads, head_dim 32, 4096 slots), and the greedy tokens are tp = 1's."""
    cases, _ = results
    one, two = cases["runs"]["tiny_fp8_tp1"], cases["runs"]["tiny_fp8_tp2"]
    assert _tokens(two) == _tokens(one)
    for a, b in zip(two, one):
        for pa, pb in zip(a["logprobs"], b["logprobs"]):
            assert pa == pytest.approx(pb, abs=1e-3)
    layout = cases["layout"]["tiny_fp8_tp2"]
    assert layout["precision"] == "fp8-delta"
    assert layout["k_delta"] == [[1, 4096, 32]] * 2
    assert layout["scales"] == [[1, 4096 // 8, 4]] * 2 and layout["k_floor"] == [[1]] * 2
    assert layout["anchor_k"][0][0] == 1 and len(layout["anchor_k"]) == 2


def test_parameters_and_kv_pools_live_split_over_devices(results):
    layout = results[0]["layout"]
    two = layout["tiny_tp2"]             # tiny: 4 heads, 2 KV heads, head_dim 32, FFN 384, vocab 512
    # Column-parallel, fused (model/fused.py): each device's block is its 2 q heads, its k head and its v head
    # (64 + 32 + 32 rows); gate and up: its 192 FFN rows of each.
    assert two["qkv_proj"]["per_device"] == [[1, 128, 128]] * 2
    assert two["gate_up_proj"]["per_device"] == [[1, 384, 128]] * 2
    assert two["o_proj"]["per_device"] == [[128, 64]] * 2                   # row-parallel
    assert two["down_proj"]["per_device"] == [[128, 192]] * 2
    assert two["embed_tokens"]["per_device"] == [[256, 128]] * 2            # vocab-parallel
    assert two["k_pool"]["per_device"] == [[1, 4096, 32]] * 2               # each device: its own head
    four = layout["tiny_tp4_auto"]
    # 2 KV heads over 4 devices: each head repeated twice, one copy per device.
    # Each device's fused block: its q head (32 rows) and its copies of a k and a v head (32 + 32).
    assert four["qkv_proj"]["global"] == [4, 96, 128] and four["qkv_proj"]["per_device"] == [[1, 96, 128]] * 4
    assert four["k_pool"]["global"] == [4, 4096, 32] and four["k_pool"]["per_device"] == [[1, 4096, 32]] * 4
    assert four["embed_tokens"]["per_device"] == [[512, 128]] * 4           # auto: replicated


def test_one_all_reduce_after_each_row_parallel_layer(results):
    """Per step: one all-reduce of the [tokens, hidden] activations after o_proj and after down_proj of
    each layer, plus one for the vocab-parallel embedding; nothing gathers a weight (every other
    collective is at most a [rows, vocab] block of logits or their statistics)."""
    for name, embedding_reduces in (("tiny_tp2", 1), ("tiny_tp4_auto", 0)):
        steps = results[0]["collectives"][name]
        assert set(steps) == {"decode", "packed"}
        for kind, ops in steps.items():
            tokens = ROWS if kind == "decode" else ROWS + PREFILL_BUCKET
            reduces = ops.get("all-reduce", [])
            assert reduces.count(tokens * HIDDEN) == 2 * LAYERS + embedding_reduces, (name, kind, ops)
            others = [n for n in reduces if n != tokens * HIDDEN] + ops.get("all-gather", [])
            assert all(n <= ROWS * VOCAB for n in others), (name, kind, ops)
            assert set(ops) <= {"all-reduce", "all-gather"}, (name, kind, ops)


def test_pallas_kernel_runs_per_shard_under_shard_map(results):
    kernel = results[0]["kernel"]
    assert kernel["out_sharding"] == "P(None, 'tp', None)"
    assert kernel["ref_max_abs"] > 0.5                       # a real output, not zeros
    assert kernel["max_abs_diff"] <= 1e-2                    # bf16 rounding of the same sums


def test_delta_kernel_runs_per_shard_under_shard_map(results):
    kernel = results[0]["delta_kernel"]
    assert kernel["delta_sharding"] == "P('tp', None, None)"
    assert kernel["out_sharding"] == "P(None, 'tp', None)"
    assert kernel["ref_max_abs"] > 0.3                       # a real output, not zeros
    assert kernel["max_abs_diff"] <= 2e-2                    # bf16 rounding of the same rebuilt sums


def test_host_tier_recalls_a_split_delta_cache(results):
    """At tp = 2 with fp8-delta, an evicted prefix goes to the host tier and comes back: the second run of
    the prompt takes its 9 full pages from the tier and gives the first run's tokens."""
    tier = results[0]["host_tier"]
    assert tier["cached"] == 9 * 16 and tier["host_hits"] == 9 and tier["recalled_pages"] >= 9
    assert tier["again"] == tier["first"] and len(tier["first"]) == 8


def test_hf_checkpoint_loads_shard_by_shard(results):
    hf = results[0]["hf_load"]
    assert hf["num_kv_heads"] == 4
    assert hf["equal"] and all(hf["equal"].values()), [k for k, v in hf["equal"].items() if not v]
    assert hf["per_device"]["embed_tokens"] == [[1024, 256]] * 4      # 4096 tied vocab / 4
    assert hf["per_device"]["gate_proj"] == [[88, 256]] * 4           # FFN 352 / 4


def test_bad_tensor_parallel_values_say_what_to_change(results):
    errors = results[0]["errors"]
    assert "must divide the model's 4 attention heads" in errors["tp3_heads"]
    assert "needs 8 devices, but jax sees 4" in errors["tp8_devices"]
    assert "xla_force_host_platform_device_count=8" in errors["tp8_devices"]


def test_two_processes_on_loopback_match_one_process(results):
    cases, outputs = results
    one = cases["runs"]["tiny_tp1"]
    for process_output in outputs:
        assert [r["token_ids"] for r in process_output] == _tokens(one)
        for a, b in zip(process_output, one):
            for pa, pb in zip(a["logprobs"], b["logprobs"]):       # chosen token, then the top 2
                assert [e["logprob"] for e in pa] == pytest.approx(pb, abs=1e-4)


@pytest.mark.parametrize("flags, message", [
    (dict(tensor_parallel=0), "--tensor-parallel must be a positive integer"),
    (dict(tp_embedding="sharded"), "--tp-embedding must be one of"),
    (dict(num_processes=2), "--coordinator HOST:PORT"),
    (dict(num_processes=2, process_id=2, coordinator="h:1", scheduler="fcfs"), "--process-id must lie in"),
    (dict(num_processes=2, coordinator="h:1"), "--scheduler fcfs"),
    (dict(coordinator="h:1"), "--coordinator needs --num-processes"),
])
def test_bad_parallel_flags_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        RuntimeConfig(**flags)
