"""`--attention kernel`: the engine's greedy output equals the reference backend's. On CPU the Pallas
Mosaic GPU kernel runs in the interpreter; on an H200 the GPU-marked test runs the compiled kernel."""
import dataclasses

import jax
import pytest

from stratum_jax.config import RuntimeConfig
from stratum_jax.engine import Engine
from stratum_jax.model.config import PRESETS
from stratum_jax.model.llama import init_params
from stratum_jax.model.loader import LoadedModel
from stratum_jax.model.tokenizer import ByteTokenizer
from stratum_jax.request import SamplingParams

on_gpu = jax.default_backend() == "gpu"


def _tiny_d64():
    """The tiny preset with head_dim 64 and bf16 KV, as the kernel serves."""
    cfg = dataclasses.replace(PRESETS["tiny"], head_dim=64, dtype="bfloat16")
    return LoadedModel(config=cfg, params=init_params(cfg, seed=0), tokenizer=ByteTokenizer(cfg.vocab_size),
                       name="tiny-d64")


def _run(model, attention, interpret, prompts, page_size=None, max_tokens=6, max_batch_size=8, decode_steps=4,
         kv_precision="bf16", prefill_chunk=64, decode_kernel="swapped", fp8_scale="granule"):
    engine = Engine(RuntimeConfig(model="tiny", max_context=256, kv_pool_tokens=4096, max_batch_size=max_batch_size,
                                  prefill_chunk=prefill_chunk, attention=attention, interpret_kernels=interpret,
                                  page_size=page_size, decode_steps=decode_steps, kv_precision=kv_precision,
                                  decode_kernel=decode_kernel, fp8_scale=fp8_scale),
                    model=model)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [r.token_ids for r in engine.generate(prompts, sp)]


PROMPTS = [[5, 6, 7], list(range(20, 61)), [9] * 17, list(range(100, 110))]


def _count_traces(monkeypatch, module, names, traced=None) -> dict:
    """Wraps `module`'s functions `names` (as the attention layer imports them at each call) to count their
    traces in `traced` (a new dict, or the one given); returns it. (An engine whose config another test in the worker
    built runs that test's compiled steps untraced: a counting test whose config is not its own takes the
    `fresh_engine_steps` fixture.)"""
    traced = {} if traced is None else traced
    traced.update(dict.fromkeys(names, 0))
    for name in names:
        def counted(*a, _fn=getattr(module, name), _name=name, **kw):
            traced[_name] += 1
            return _fn(*a, **kw)
        monkeypatch.setattr(module, name, counted)
    return traced


@pytest.mark.parametrize("decode_kernel", ["swapped", "paged"])
def test_engine_kernel_interpret_matches_reference(monkeypatch, two_splits, decode_kernel):
    """--decode-kernel swapped (the default) and paged. The interpreter runs every CTA of every step in Python
    (every row of every packed and decode step, padding rows too), so: 2 rows, 2 splits, 2 decode steps per
    call. The decode kernel asked for is counted as it is traced, and the other must not be."""
    import pallas_kernels.paged_attention as paged_module
    import pallas_kernels.swapped_decode_attention as swapped_module
    traced = _count_traces(monkeypatch, swapped_module, ["swapped_paged_attention"])
    _count_traces(monkeypatch, paged_module, ["paged_attention"], traced)
    model = _tiny_d64()
    prompts = [[5, 6, 7], list(range(20, 45))]
    kw = dict(page_size=8, max_tokens=3, max_batch_size=2, decode_steps=2)
    got = _run(model, "kernel", True, prompts, decode_kernel=decode_kernel, **kw)
    ran = "swapped_paged_attention" if decode_kernel == "swapped" else "paged_attention"
    assert traced[ran] > 0 and sum(traced.values()) == traced[ran], traced
    assert got == _run(model, "reference", False, prompts, **kw)


@pytest.mark.parametrize("precision,fp8_scale,variant,decode_kernel", [
    ("fp8-delta", "granule", "swapped", "swapped_paged_attention"),
    ("fp8-delta", "granule", "paged", "delta_attention"),
    ("fp8-delta", "head", "swapped", "swapped_paged_attention"),
    ("fp16-delta", "granule", "swapped", "swapped_paged_attention")])
def test_engine_delta_kernels_interpret_match_reference(monkeypatch, two_splits, precision, fp8_scale, variant,
                                                        decode_kernel):
    """--kv-precision fp8-delta / fp16-delta: prefill blocks through the delta prefill kernel and decode rows
    through the swapped kernel on the deltas plus the anchor (the fold, stratum_jax/attention.py `_swapped_fold`:
    fp16; fp8 with its per-granule scales, the default, or with --fp8-scale head), or, with --decode-kernel paged,
    through the delta-KV decode kernel, all in the interpreter, give the greedy tokens of the tiled jnp path over
    the same delta cache. The kernels are counted as they are traced, so a fall-back to the tiled path fails here.
    prefill_chunk 32 (one 32-token block per prompt with GQA 2) keeps the interpreted CTAs few."""
    import pallas_kernels.delta_attention as delta_module
    import pallas_kernels.swapped_decode_attention as swapped_module
    traced = _count_traces(monkeypatch, delta_module, ["delta_prefill_attention", "delta_attention"])
    _count_traces(monkeypatch, swapped_module, ["swapped_paged_attention"], traced)
    model = _tiny_d64()
    prompts = [[5, 6, 7], list(range(20, 37))]
    kw = dict(page_size=16, max_tokens=2, max_batch_size=2, decode_steps=1, kv_precision=precision,
              prefill_chunk=32, fp8_scale=fp8_scale, decode_kernel=variant)
    got = _run(model, "kernel", True, prompts, **kw)
    assert traced["delta_prefill_attention"] > 0 and traced[decode_kernel] > 0, traced
    other = {"delta_attention", "swapped_paged_attention"} - {decode_kernel}
    assert all(traced[name] == 0 for name in other), traced
    assert got == _run(model, "reference", False, prompts, **kw)


def test_kernel_on_cpu_without_interpret_is_refused():
    if on_gpu:
        pytest.skip("on a GPU the compiled kernel is allowed")
    with pytest.raises(ValueError, match="interpret-kernels"):
        Engine(RuntimeConfig(attention="kernel"), model=_tiny_d64())


def test_auto_picks_the_kernel_only_where_it_runs():
    fp32_tiny = LoadedModel(config=PRESETS["tiny"], params=None, tokenizer=ByteTokenizer(PRESETS["tiny"].vocab_size),
                            name="tiny")
    assert Engine(RuntimeConfig(), model=fp32_tiny).attention_backend == "reference"     # fp32 KV
    want = "kernel" if on_gpu else "reference"
    assert Engine(RuntimeConfig(), model=_tiny_d64()).attention_backend == want


def test_kernel_refuses_a_head_dim_it_does_not_support():
    cfg = dataclasses.replace(PRESETS["tiny"], head_dim=96, dtype="bfloat16")
    model = LoadedModel(config=cfg, params=None, tokenizer=ByteTokenizer(cfg.vocab_size), name="tiny-d96")
    with pytest.raises(ValueError, match="head_dim"):
        Engine(RuntimeConfig(attention="kernel", interpret_kernels=True), model=model)


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("page_size", [None, 16, 128])
def test_engine_kernel_on_gpu_matches_reference(page_size):
    model = _tiny_d64()
    prompts = PROMPTS + [list(range(1, 200))]
    assert _run(model, "kernel", False, prompts, page_size) == _run(model, "reference", False, prompts, page_size)


def test_decode_kernel_and_prefill_splits_flags():
    """--decode-kernel and --prefill-splits from the server's CLI, and bad values refused with what to write."""
    from stratum_jax.serve import build_parser
    cfg = RuntimeConfig.from_cli_args(build_parser().parse_args(["--decode-kernel", "paged", "--prefill-splits", "3"]))
    assert cfg.decode_kernel == "paged" and cfg.prefill_split_setting == 3
    default = RuntimeConfig()
    assert default.decode_kernel == "swapped" and default.prefill_split_setting == "auto"
    assert RuntimeConfig(prefill_splits="off").prefill_split_setting is None
    with pytest.raises(ValueError, match="--decode-kernel must be one of"):
        RuntimeConfig(decode_kernel="fast")
    for bad in ("0", "17", "two", ""):
        with pytest.raises(ValueError, match="--prefill-splits must be 'auto', 'off' or a count from 1 to 16"):
            RuntimeConfig(prefill_splits=bad)
