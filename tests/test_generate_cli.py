"""`python -m stratum_jax.generate`: JSON output shape, batching of several prompts, clear errors."""
import json
import subprocess
import sys

import pytest

from stratum_jax import generate
from stratum_jax.model.tokenizer import ByteTokenizer


def test_json_output_with_logprobs(capsys):
    rc = generate.main(["--model", "tiny", "--max-context", "256", "--kv-pool-tokens", "1024",
                        "--prompt-ids", "5,6,7,8", "--prompt-ids", "9,10", "--max-tokens", "4",
                        "--ignore-eos", "--logprobs", "2", "--prompt-logprobs", "1", "--json"])
    assert rc == 0
    lines = [json.loads(l) for l in capsys.readouterr().out.strip().splitlines()]
    assert len(lines) == 2
    for obj, n_prompt in zip(lines, (4, 2)):
        assert set(obj) >= {"token_ids", "text", "logprobs", "prompt_logprobs"}
        assert len(obj["token_ids"]) == 4 and len(obj["logprobs"]) == 4
        assert all(len(step) == 3 for step in obj["logprobs"])
        assert obj["logprobs"][0][0]["token_id"] == obj["token_ids"][0]
        assert len(obj["prompt_logprobs"]) == n_prompt


def test_text_prompt_prints_text(capsys):
    """Plain output is the decoded text, one line per prompt. (Greedy, so the --json run gives the same
    tokens; tiny's random weights may pick ids >= 256 that decode to nothing, hence no non-empty check.)"""
    argv = ["--model", "tiny", "--max-context", "256", "--kv-pool-tokens", "1024", "--prompt", "hello",
            "--max-tokens", "3", "--ignore-eos"]
    assert generate.main(argv + ["--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["text"] == ByteTokenizer().decode(obj["token_ids"]) and len(obj["token_ids"]) == 3
    assert generate.main(argv) == 0
    assert capsys.readouterr().out == obj["text"] + "\n"


@pytest.mark.parametrize("argv, msg", [
    (["--prompt", "x", "--temperature", "-1"], "temperature"),
    (["--prompt", "x", "--max-tokens", "0"], "max_tokens"),
    (["--prompt", "x", "--top-p", "0"], "top_p"),
    (["--prompt", "x", "--model", "no-such-preset-or-dir"], "no-such-preset-or-dir"),
    (["--prompt", "x", "--page-size", "12"], "page-size"),
])
def test_bad_flags_exit_nonzero_with_message(argv, msg, capsys):
    rc = generate.main(["--model", "tiny", "--max-context", "256", "--kv-pool-tokens", "1024"] + argv)
    assert rc != 0
    assert msg in capsys.readouterr().err


def test_unreadable_checkpoint_dir(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    assert generate.main(["--model", str(tmp_path), "--prompt", "x"]) != 0
    err = capsys.readouterr().err
    assert "config.json" in err


def test_prompt_ids_parse_error():
    proc = subprocess.run([sys.executable, "-m", "stratum_jax.generate", "--prompt-ids", "1,a"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "comma-separated" in proc.stderr


GOLDEN_QWEN2 = str(__import__("pathlib").Path(__file__).parent / "hf_reference" / "golden" / "qwen2")


def test_default_max_context_follows_a_smaller_model_limit(capsys):
    """The qwen2 golden checkpoint allows 256 positions: with no --max-context it must run (the default is
    the model's limit, capped at 2048), and an explicit value above the limit stays an error."""
    assert generate.main(["--model", GOLDEN_QWEN2, "--prompt-ids", "5,6,7", "--max-tokens", "2",
                          "--ignore-eos", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out.strip())["token_ids"]) == 2
    assert generate.main(["--model", GOLDEN_QWEN2, "--max-context", "2048", "--prompt-ids", "5,6,7"]) != 0
    assert "exceeds the model's max_position_embeddings 256" in capsys.readouterr().err


def test_runtime_config_resolves_max_context_once_per_model():
    from stratum_jax.config import DEFAULT_MAX_CONTEXT, RuntimeConfig
    assert RuntimeConfig().for_model(512).max_context == 512
    assert RuntimeConfig().for_model(131072).max_context == DEFAULT_MAX_CONTEXT
    assert RuntimeConfig(max_context=300).for_model(512).max_context == 300
    with pytest.raises(ValueError, match="--max-context 1024 exceeds"):
        RuntimeConfig(max_context=1024).for_model(512)
    # The pool check runs again on the resolved value.
    with pytest.raises(ValueError, match="--kv-pool-tokens"):
        RuntimeConfig(kv_pool_tokens=1000).for_model(4096)
    with pytest.raises(ValueError, match="--max-context must be a positive integer"):
        RuntimeConfig(max_context=0)
