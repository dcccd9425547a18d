"""benchmarks/gpu_preflight.py: the engine's step programs at llama-1b's real shapes, exported for CUDA on this CPU
with the kernels the engine runs on a Hopper GPU (Pallas attention and projections, no interpreter); an L2 prefetch
budget puts prefetches into the kernels' code; a program that fails to lower is reported and makes the exit code 1;
flags it cannot honour are refused."""
import json
import pathlib
import sys

import pytest

from benchmark_module import load_benchmark

E2E_FLAGS = ["--model", "llama-1b", "--batch", "64", "--prompt-len", "512", "--new-tokens", "256",
             "--attention", "kernel", "--layers", "1"]
# One llama-1b decode layer's kernels as Pallas names them: the two norms (one function), the q/k/v, o, gated
# gate/up and down GEMMs (named by their shapes), the fused RoPE + KV write, and the swapped attention kernel
# (`body`, the name benchmarks/device_trace.py files under attention).
LAYER_KERNELS = {"residual_rmsnorm", "decode_matmul_3072x2048", "rope_kv_write", "body", "decode_matmul_2048x2048",
                 "decode_gated_matmul_8192x2048", "decode_matmul_2048x8192"}


@pytest.fixture(scope="module")
def preflight():
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))   # e2e_decode's imports
    try:
        return load_benchmark("gpu_preflight.py", "gpu_preflight")
    finally:
        sys.path.pop(0)


@pytest.fixture
def first_of_each_kind(preflight, monkeypatch):
    """The runner's first program of each kind only (the sampler variants share the decode step's kernels): the
    same checks in a quarter of the time."""
    real = preflight.runner_for

    def runner_for(config, model, kv_cache):
        runner = real(config, model, kv_cache)
        kinds = {}
        for shape in runner.shapes:
            kinds.setdefault(shape.kind, shape)
        runner.shapes = list(kinds.values())
        return runner

    monkeypatch.setattr(preflight, "runner_for", runner_for)


def _programs(out_path):
    (run,) = json.loads(out_path.read_text())["runs"]
    return run, run["programs"]


def test_llama_1b_decode_lowers_for_cuda_with_and_without_l2_prefetch(preflight, first_of_each_kind, tmp_path):
    plain_out, fetched_out = tmp_path / "plain.json", tmp_path / "fetched.json"
    assert preflight.main([*E2E_FLAGS, "--shapes", "decode", "--out", str(plain_out)]) == 0
    assert preflight.main([*E2E_FLAGS, "--shapes", "decode", "--l2-prefetch-mb", "16", "--out", str(fetched_out)]) == 0
    run, plain = _programs(plain_out)
    assert (run["attention"], run["projections"], run["decode_kernel"]) == ("kernel", "kernel", "swapped")
    _, fetched = _programs(fetched_out)
    assert [p["shape"] for p in plain] == [p["shape"] for p in fetched] == ["decode(sampled=False, logprobs=False)"]
    (p,), (f,) = plain, fetched
    assert p["ok"] and f["ok"]
    assert set(p["kernels"]) == set(f["kernels"]) == LAYER_KERNELS
    assert p["distinct_kernels"] == f["distinct_kernels"] == 8        # the layer's 8 kernels, the norm twice
    assert p["kernel_calls"] == f["kernel_calls"] == 8
    # One layer's issuers: the post-attention norm (gate/up), the gated GEMM (down), the attention kernel (o) and
    # the fused q/k/v write (attention's first K/V tiles); the q/k/v prefetch sits in the norm ahead of a next layer.
    assert p["l2_prefetch_sites"] == 0 and f["l2_prefetch_sites"] == 4


def test_llama_8b_steps_lower_for_cuda_with_a_partial_l2_prefetch(preflight, first_of_each_kind, tmp_path):
    """head_dim 128, the 8b projections' tiles and an 8 MB budget (part of each weight: the plans' predicated rounds),
    one layer: the decode, packed and sampling programs all lower."""
    out = tmp_path / "8b.json"
    flags = ["--model", "llama-8b", *E2E_FLAGS[2:], "--l2-prefetch-mb", "8", "--prefill-tokens", "512"]
    assert preflight.main([*flags, "--shapes", "decode", "packed", "sample", "--out", str(out)]) == 0
    _, programs = _programs(out)
    assert [p["kind"] for p in programs] == ["decode", "packed", "sample"] and all(p["ok"] for p in programs)
    decode = programs[0]
    assert set(decode["kernels"]) == {"residual_rmsnorm", "decode_matmul_6144x4096", "rope_kv_write", "body",
                                      "decode_matmul_4096x4096", "decode_gated_matmul_14336x4096",
                                      "decode_matmul_4096x14336"}, decode["kernels"]
    assert decode["kernel_calls"] == 8 and decode["l2_prefetch_sites"] == 4


def test_the_packed_step_lowers_with_the_warp_specialised_prefill(preflight, first_of_each_kind, tmp_path):
    out = tmp_path / "packed.json"
    assert preflight.main([*E2E_FLAGS, "--shapes", "packed", "--prefill-tokens", "512", "--out", str(out)]) == 0
    _, programs = _programs(out)
    # Its attention: the prefill kernel over the chunks' tokens and the decode kernel over the decode rows (both
    # Pallas functions named `body`); the projections are XLA's dots in a packed step.
    assert programs and all(p["ok"] and p["distinct_kernels"] == 2 and p["kernels"] == ["body"] for p in programs)


def test_a_dkvc_cache_lowers_around_each_anchor_length(preflight, first_of_each_kind, tmp_path):
    """fp8-delta pools around the engine's two anchor candidates (1: the mean anchor; 256: position-aligned)."""
    out = tmp_path / "fp8.json"
    assert preflight.main([*E2E_FLAGS, "--shapes", "decode", "--kv-precision", "fp8-delta", "--anchor-lens", "1",
                           "256", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["kv_precision"], r["anchor_len"]) for r in runs] == [("fp8-delta", 1), ("fp8-delta", 256)]
    for run in runs:
        (program,) = run["programs"]
        assert program["ok"] and program["distinct_kernels"] >= 1, program


def test_llama_8b_fp8_fold_lowers_at_4k(preflight, first_of_each_kind, tmp_path):
    """#12's fold path as the engine runs it on llama-8b (head_dim 128, fp8 deltas with fixed per-head scales, 4K
    context): the decode program lowers, with the fp8 pools' attention kernel in it."""
    out = tmp_path / "fold.json"
    flags = ["--model", "llama-8b", "--batch", "64", "--prompt-len", "3840", "--new-tokens", "256", "--attention",
             "kernel", "--layers", "1", "--kv-precision", "fp8-delta", "--fp8-scale", "head", "--anchor-lens", "1"]
    assert preflight.main([*flags, "--shapes", "decode", "--out", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    (program,) = run["programs"]
    assert (run["kv_precision"], run["fp8_scale"]) == ("fp8-delta", "head")
    assert program["ok"] and "body" in program["kernels"], program


def test_kernel_calls_count_each_wrappers_call_sites(preflight):
    text = """module {
  func.func public @main() {
    call @_gemm(%a) : () -> ()
    call @_gemm(%b) : () -> ()
    stablehlo.custom_call @mosaic_gpu_v2(%c)
    call @_norm(%d) : () -> ()
  }
  func.func private @_gemm(%x) {
    stablehlo.custom_call @mosaic_gpu_v2(%x)
  }
  func.func private @_norm(%x) {
    stablehlo.custom_call @mosaic_gpu_v2(%x)
  }
  func.func private @_unused_by_name(%x) {
    stablehlo.add %x, %x
  }
}"""
    assert preflight.kernel_calls(text) == 2 + 1 + 1


def test_a_kernel_over_the_gpus_smem_fails_the_preflight(preflight, first_of_each_kind, tmp_path, monkeypatch):
    """What the pre-flight is for: a config that only breaks on the GPU. A swapped-kernel default that needs more SMEM
    than an H200 SM has (256-key tiles x 8 stages) fails Mosaic GPU's lowering here, on the CPU, with its reason."""
    import jax
    from pallas_kernels import swapped_decode_attention as swapped
    monkeypatch.setattr(swapped, "default_swapped_config",
                        lambda *a, **k: swapped.SwappedConfig(block_kv=256, num_stages=8))
    # A decode step of these shapes traced by an earlier test in this process would be reused without tracing (and
    # the patched default never read); the failing lowering itself leaves nothing cached for later tests.
    jax.clear_caches()
    out = tmp_path / "smem.json"
    assert preflight.main([*E2E_FLAGS, "--shapes", "decode", "--out", str(out)]) == 1
    _, (program,) = _programs(out)
    assert not program["ok"] and "exceeds available shared memory" in program["error"], program["error"]


def test_a_program_that_fails_to_lower_is_reported_and_fails_the_run(preflight, tmp_path, monkeypatch, capsys):
    real = preflight.ModelRunner.program

    def program(self, shape, kv_cache):
        if shape.kind == "sample" and shape.variant.logprobs:
            raise ValueError("an SMEM budget exceeded (test)")
        return real(self, shape, kv_cache)

    monkeypatch.setattr(preflight.ModelRunner, "program", program)
    out = tmp_path / "failed.json"
    assert preflight.main([*E2E_FLAGS, "--shapes", "sample", "--out", str(out)]) == 1
    _, programs = _programs(out)
    assert [p["ok"] for p in programs] == [False, True, False]      # the other programs still lowered
    assert "ValueError: an SMEM budget exceeded (test)" in programs[0]["error"]
    assert "1 of 3 step programs lowered for CUDA; 2 FAILED" in capsys.readouterr().out


@pytest.mark.parametrize("flags, match", [
    (["--interpret-kernels"], "for the GPU, not the interpreter"),
    (["--tensor-parallel", "2"], "for one device"),
    (["--kv-precision", "fp8-delta", "--anchor-lens", "0"], "--anchor-lens must be positive"),
    (["--layers", "17"], r"--layers must be in \[1, 16\]"),
])
def test_flags_it_cannot_honour_are_refused(preflight, flags, match):
    with pytest.raises(SystemExit, match=match):
        preflight.main([*E2E_FLAGS[:-2], *flags])


def test_a_checkpoint_directorys_shapes_lower_from_its_config_alone(preflight, first_of_each_kind, tmp_path):
    """A Qwen2-shaped checkpoint (q/k/v biases, head_dim 128) given as a directory holding only config.json: its
    decode program lowers with the Pallas kernels, no weights read."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 1024, "hidden_size": 1024, "intermediate_size": 2816,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "torch_dtype": "bfloat16", "tie_word_embeddings": False}))
    out = tmp_path / "qwen.json"
    assert preflight.main(["--model", str(tmp_path), "--batch", "16", "--attention", "kernel", "--shapes", "decode",
                           "--out", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    (program,) = run["programs"]
    assert run["attention"] == "kernel" and program["ok"] and "body" in program["kernels"], program


@pytest.mark.parametrize("files, match", [
    ({}, "give a preset .* or a checkpoint directory with a config.json"),
    ({"config.json": '{"architectures": ["GPT2LMHeadModel"]}'}, "config.json field 'architectures'"),
])
def test_a_model_it_cannot_read_is_refused_with_what_to_give(preflight, tmp_path, files, match):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(SystemExit, match=match):
        preflight.main(["--model", str(tmp_path), "--attention", "kernel"])
