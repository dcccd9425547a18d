"""benchmarks/host_tier.py's multi-turn run on the tiny model (CPU, seconds): every condition serves the same
greedy answers (float32), the host tier turns recomputed prompt tokens into host hits, and `--recall always`
recalls every host hit where the measured choice may recompute them (a CPU prefills the tiny model cheaply)."""
import json

import pytest

from benchmark_module import load_benchmark

WORKLOAD = ["--conversations", "8", "--turns", "2", "--system-len", "64", "--user-len", "48", "--answer-len", "4",
            "--batch", "4", "--kv-pool-tokens", "512", "--kv-host-tokens", "8192", "--rounds", "1",
            "--conditions", "no-host,host"]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("host_tier.py", "host_tier_bench")


def test_always_recall_turns_the_recomputed_history_into_host_hits(bench, tmp_path):
    out = tmp_path / "ht.json"
    assert bench.main(WORKLOAD + ["--recall", "always", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "host_tier" and result["device"].startswith("cpu")
    assert result["args"]["recall"] == "always" and result["same_answers_in_every_condition"]
    no_host, host = result["conditions"]
    assert (no_host["condition"], host["condition"]) == ("no-host", "host")
    assert no_host["host_hit_pages"] == 0 and no_host["recall_choices"] == no_host["recompute_choices"] == 0
    assert host["host_hit_pages"] > 0 and host["recall_choices"] > 0 and host["recompute_choices"] == 0
    assert host["prompt_tokens_computed"] < no_host["prompt_tokens_computed"]
    assert host["prompt_tokens_computed"] + host["prompt_tokens_cached"] == \
        no_host["prompt_tokens_computed"] + no_host["prompt_tokens_cached"]
    assert (tmp_path / "ht.png").exists()


def test_a_bad_recall_mode_says_what_to_choose(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(WORKLOAD + ["--recall", "sometimes"])
    assert "--recall" in capsys.readouterr().err
