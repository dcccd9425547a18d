"""benchmarks/l2_prefetch.py: the dry run runs the layer skeleton on the engine's kernels (interpreter) with and
without the prefetch and finds the same bits, the plans' sizes are what the budgets ask, and bad flags say what to
fix (the timed run needs a GPU)."""
import pytest

from benchmark_module import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("l2_prefetch.py", "l2_prefetch")


def test_dry_run_keeps_the_bits(bench, tmp_path):
    out = bench.main(["--dry-run", "--budgets", "0,1", "--out", str(tmp_path / "a.json")])
    assert [r["variant"] for r in out["results"]] == ["0", "1"]
    assert all(r["same_bits_as_no_prefetch"] for r in out["results"])
    off, on = (r["prefetched_mb"] for r in out["results"])
    assert off == dict.fromkeys(bench.TARGETS, 0.0) and all(0 < mb <= 1.0 for mb in on.values())
    # A variant's targets: only those prefetch.
    assert bench.parse_variants("1:down+o") == [(1.0, ("down", "o"))]
    assert bench.prefetched_mb(1, bench.DRY_SHAPE, 8, ("down",), 100) == {**off, "down": on["down"]}
    assert (tmp_path / "a.json").exists()


def test_the_budgets_at_llama_shapes(bench):
    """llama-1b at 64 rows: q/k/v (12 MB) and o (8 MB) whole from their size up, gate/up (64 MB) and down (32 MB) as
    much as the budget; under a budget each split's prefix is rounded down to whole 64-column tiles (q/k/v's 4 splits
    of 512 columns: 4 MB -> 2 tiles a split, 3 MB)."""
    shape = bench.layer_shapes("llama-1b")
    first = 64 * 64 * 8 * 64 * 2 * 2 / 2**20       # rows x first keys x kv heads x D x (K, V) x bf16: 8 MB
    assert bench.prefetched_mb(16, shape, 64) == {"qkv": 12.0, "o": 8.0, "gate_up": 16.0, "down": 16.0,
                                                  "attention": first}
    assert bench.prefetched_mb(4, shape, 64) == {"qkv": 3.0, "o": 4.0, "gate_up": 4.0, "down": 4.0,
                                                 "attention": first}
    assert bench.down_splits(shape, 64) >= 1


def test_the_timed_program_lowers_for_cuda(bench):
    """The GPU run's program (llama-1b, 2 layers, every prefetch on) lowered for CUDA on this CPU: one Mosaic GPU call
    a kernel."""
    import jax
    import jax.numpy as jnp
    from stratum_jax.attention import RowTables
    from stratum_jax.model.projection import DecodeKernelMatmul
    shape, rows, context, layers = bench.layer_shapes("llama-1b"), 64, 640, 2
    sd = jax.ShapeDtypeStruct
    weights = jax.eval_shape(lambda: bench.make_weights(shape, layers))
    slots = 1 << 16
    pools = [(sd((shape["kv_heads"], slots, shape["head_dim"]), jnp.bfloat16),) * 2] * layers
    tables = RowTables(sd((rows,), jnp.int32), sd((rows, context // 8), jnp.int32), sd((rows,), jnp.int32))
    half = sd((rows, shape["head_dim"] // 2), jnp.float32)
    step = bench.LayerStep(tables, half, half, sd((rows,), jnp.int32))
    x, pending = sd((rows, shape["hidden"]), jnp.bfloat16), sd((bench.down_splits(shape, rows), rows, shape["hidden"]),
                                                                jnp.float32)
    text = bench.layers_fn(DecodeKernelMatmul(l2_prefetch_mb=8), shape, max_context=context).trace(
        x, pending, weights, pools, step).lower(lowering_platforms=("cuda",)).as_text()
    # One Mosaic GPU call per distinct kernel (the layers call the same outlined functions): the two norms (each with
    # its own prefetch plan), q/k/v, the fused write, attention, o, gate/up, down.
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 8


def test_the_gain_is_paired_by_round(bench):
    """Each variant's span against the no-prefetch variant's of the same round, the median over rounds."""
    runs = {(0.0, bench.TARGETS): [dict(span_us=10.0), dict(span_us=12.0), dict(span_us=11.0)],
            (8.0, ("qkv",)): [dict(span_us=9.0), dict(span_us=11.5), dict(span_us=10.0)]}
    assert bench.span_delta_vs_none(runs, (8.0, ("qkv",))) == -1.0
    assert bench.span_delta_vs_none({(8.0, ("qkv",)): runs[(8.0, ("qkv",))]}, (8.0, ("qkv",))) is None


@pytest.mark.parametrize("argv, match", [
    (["--dry-run", "--budgets", "x"], r"not MB\[:target"),
    (["--dry-run", "--budgets", "8:lm_head"], "targets must be among"),
    (["--dry-run", "--budgets", "60"], r"\[0, 50\] MB"),
    (["--dry-run", "--rows", "0"], r"\[1, 128\]"),
    (["--dry-run", "--models", "llama-3t"], "unknown presets"),
    (["--dry-run", "--page", "48"], "--page must be one of"),
    (["--budgets", "0"], "needs an NVIDIA Hopper GPU"),
])
def test_bad_flags_say_what_to_fix(bench, argv, match):
    with pytest.raises(SystemExit, match=match):
        bench.main(argv)
