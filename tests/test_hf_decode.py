"""benchmarks/hf_decode.py (HF transformers' decode throughput on a preset's shapes): its flag checks, and its
--dry-run (the tiny preset on CPU, every mode, torch.compile included) under a Python with torch and
transformers: this interpreter when it has them, else STRATUM_HF_PYTHON (.ci/hf_env.sh's side venv, which CI
sources); skipped when neither has them. The project venv stays torch-free."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

from benchmark_module import forget, load_benchmark

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hd():
    yield load_benchmark("hf_decode.py", "hf_decode")
    forget("hf_decode")


def _hf_python() -> str:
    if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
        return sys.executable
    if os.environ.get("STRATUM_HF_PYTHON"):
        return os.environ["STRATUM_HF_PYTHON"]
    pytest.importorskip("torch", reason="torch is not installed and STRATUM_HF_PYTHON is not set (.ci/hf_env.sh)")
    pytest.importorskip("transformers", reason="transformers is not installed and STRATUM_HF_PYTHON is not set")
    return sys.executable


def _run(python, *args, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([python, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("flags, message", [
    (["--modes", "static-compiled,fast"], "--modes: fast; choose from"),
    (["--modes", ","], "--modes: none given"),
    (["--modes", "dynamic,dynamic"], "names a mode twice"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--new-tokens", "-3"], "--new-tokens must be >= 1"),
    (["--model", "tiny", "--prompt-len", "2040"], "past tiny's max_position_embeddings"),
    (["--model", "llama-3b"], "invalid choice"),
])
def test_bad_flags_are_named(hd, capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        hd.parse_args(flags)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_dry_run_every_mode(tmp_path):
    python = _hf_python()
    out = tmp_path / "hf.json"
    proc = _run(python, "benchmarks/hf_decode.py", "--dry-run", "--modes", "static-compiled,static,dynamic,generate",
                "--new-tokens", "6", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    runs = json.loads(out.read_text())
    assert [r["mode"] for r in runs] == ["static-compiled", "static", "dynamic", "generate"]
    from stratum_jax.model.config import PRESETS
    for r in runs:
        assert (r["model"], r["batch"], r["prompt_len"], r["new_tokens"], r["dtype"]) == ("tiny", 2, 16, 6, "float32")
        assert r["decode_tokens_per_s"] > 0 and r["decode_step_ms_median"] > 0 and r["prefill_seconds"] > 0
        assert len(r["decode_seconds_per_pass"]) == r["repeats"] == 2
        assert r["parameters"] == PRESETS["tiny"].num_params       # the preset's shapes, nothing more or less
        assert r["torch"] and r["transformers"].startswith("5.") and r["device"] and r["command"]
        assert len(r["tokens_row0"]) == 6
    # The same greedy tokens from every cache, the compiled step and generate (fp32).
    assert len({tuple(r["tokens_row0"]) for r in runs}) == 1
    assert "static-compiled" in proc.stdout and "wrote" in proc.stdout
    # The dry run compiles with aot_eager (dynamo's full-graph capture, no inductor code generation).
    assert (runs[0]["compiled"], runs[0]["compile_backend"], runs[0]["compile_mode"]) == (True, "aot_eager", None)
    assert not runs[1]["compiled"] and runs[1]["compile_backend"] is None


def test_hf_config_is_the_preset(tmp_path):
    """hf_config maps every preset field: transformers' config read back by ModelConfig.from_hf_config is the
    preset again (llama3 RoPE scaling, tied and untied heads, GQA)."""
    python = _hf_python()
    code = ("import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('hd', 'benchmarks/hf_decode.py')\n"
            "hd = importlib.util.module_from_spec(spec); spec.loader.exec_module(hd)\n"
            "from stratum_jax.model.config import PRESETS, ModelConfig\n"
            "for name, cfg in PRESETS.items():\n"
            "    back = ModelConfig.from_hf_config(hd.hf_config(cfg).to_dict(), dtype=cfg.dtype)\n"
            "    assert back == cfg, (name, back, cfg)\n"
            "print('ok', len(PRESETS))\n")
    proc = _run(python, "-c", code, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr[-3000:]
