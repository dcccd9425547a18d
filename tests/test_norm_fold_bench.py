"""benchmarks/norm_fold.py: the dry run runs the unfused and the folded layers on the engine's kernels (interpreter)
and finds the fold computes the same layers; the GPU run's folded program lowers for CUDA with two kernels fewer a
layer; its kernels are attributed to their parts; bad flags say what to fix (the timed run needs a GPU)."""
import pathlib
import sys

import pytest

from benchmark_module import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("norm_fold.py", "norm_fold")


def test_dry_run_computes_the_same_layers(bench, tmp_path):
    """The engine's configs, so one-block clusters when interpreted (multi-block cluster barriers deadlock jax
    0.11.2's interpreter now and then: tests/test_norm_fold.py, CLUSTER_HANGS)."""
    out = bench.main(["--dry-run", "--out", str(tmp_path / "a.json")])
    # The folded norms round in other places than the unfused ones (a bf16 step), and that spreads through two
    # layers: bounded here. A wrong fold (a missed scale, a lost split) is off by far more.
    assert out["stream_scale"] > 1
    assert out["stream_max_abs_diff"] < 0.02 * out["stream_scale"]
    assert out["pool_max_abs_diff"] < 0.05
    assert (tmp_path / "a.json").exists()


@pytest.mark.parametrize("model", ["llama-1b", "llama-8b"])
def test_the_folded_program_lowers_for_cuda_with_one_kernel_fewer(bench, model):
    """2 layers, lowered for CUDA on this CPU: the unfused layer launches 8 Mosaic GPU kernels, the folded one 6 (both
    residual_rmsnorm kernels gone; q/k/v, o, gate/up and down are their fold variants), with the engine's cluster
    split and with --cluster-splits' forced ones (8 over L2; 2 on tiles of H / 64 columns with 4 stages over
    DSMEM)."""
    import jax
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))   # gpu_preflight's imports
    try:
        kernel_calls = load_benchmark("gpu_preflight.py", "gpu_preflight").kernel_calls
    finally:
        sys.path.pop(0)
    import jax.numpy as jnp
    from stratum_jax.attention import RowTables
    from stratum_jax.model.projection import DecodeKernelMatmul
    shape, rows, context, layers = bench.layer_shapes(model), 64, 640, 2
    sd = jax.ShapeDtypeStruct
    weights = jax.eval_shape(lambda: bench.with_folded_weights(bench.make_weights(shape, layers)))
    slots = 1 << 16
    pools = [(sd((shape["kv_heads"], slots, shape["head_dim"]), jnp.bfloat16),) * 2] * layers
    tables = RowTables(sd((rows,), jnp.int32), sd((rows, context // 8), jnp.int32), sd((rows,), jnp.int32))
    half = sd((rows, shape["head_dim"] // 2), jnp.float32)
    step = bench.LayerStep(tables, half, half, sd((rows,), jnp.int32))
    x = sd((rows, shape["hidden"]), jnp.bfloat16)
    pending = sd((bench.down_splits(shape, rows), rows, shape["hidden"]), jnp.float32)
    counts = {}
    h, i, qkv = shape["hidden"], shape["intermediate"], shape["q_out"] + 2 * shape["kv_out"]
    # At 1b each exchange and each form of --cluster-splits once (the engine's, a forced split, a forced split, tile
    # and ring depth); at 8b the engine's. Each lowering costs ~7 s on the 2-core CI machine.
    forms = ([((None, 8), "l2"), (((2, h // 64, 4),), "dsmem")] if model == "llama-1b" else [((None,), "l2")])
    fns = {}
    for splits, exchange in forms:
        fns.update(bench.variant_fns(DecodeKernelMatmul(), shape, max_context=context, cluster_splits=splits,
                                     exchanges=(exchange,)))
    for variant, fn in fns.items():
        text = fn.trace(x, pending, weights, pools, step).lower(lowering_platforms=("cuda",)).as_text()
        counts[variant] = kernel_calls(text)
        if variant.startswith("fold"):
            for name in (f"decode_matmul_normed_{qkv}x{h}", f"decode_matmul_residual_{h}x{h}",
                         f"decode_gated_matmul_normed_{i}x{h}", f"decode_matmul_residual_{h}x{i}"):
                assert name in text
    want = {"fold", "fold_s8", f"fold_dsmem_s2x{h // 64}_st4"} if model == "llama-1b" else {"fold"}
    assert counts == {"unfused": 8 * layers, **{name: 6 * layers for name in want}}


def test_the_fold_kernels_are_attributed_to_their_parts(bench):
    from l2_prefetch import part_of
    shape = bench.layer_shapes("llama-8b")
    assert part_of("decode_matmul_residual_4096x4096_mosaic_gpu_kernel", shape) == "o"
    assert part_of("decode_gated_matmul_normed_14336x4096_mosaic_gpu_kernel", shape) == "gate_up"
    assert part_of("decode_matmul_residual_4096x14336_mosaic_gpu_kernel", shape) == "down"
    assert part_of("decode_matmul_normed_6144x4096_mosaic_gpu_kernel", shape) == "qkv"


@pytest.mark.parametrize("argv, match", [
    (["--dry-run", "--rows", "0"], r"\[1, 128\]"),
    (["--dry-run", "--models", "llama-3t"], "unknown presets"),
    (["--dry-run", "--page", "48"], "--page must be one of"),
    (["--dry-run", "--rounds", "0"], ">= 1"),
    (["--dry-run", "--cluster-splits", "4x64:1"], "ring depth >= 2"),
    (["--dry-run", "--cluster-splits", "3"], "auto, 1, 2, 4 or 8"),
    (["--dry-run", "--exchanges", "nvlink"], "--exchanges"),
    ([], "needs an NVIDIA Hopper GPU"),
])
def test_bad_flags_say_what_to_fix(bench, argv, match):
    with pytest.raises(SystemExit, match=match):
        bench.main(argv)
