"""paged_attention with no config runs `default_config(head_dim)`, the per-head-dim default (what the
engine gets: it passes no config)."""
import jax
import pytest

from pallas_kernels.paged_attention import TuningConfig, default_config, paged_attention
from pallas_kernels.testing import random_paged_case


def _jaxpr(case, config):
    """The traced kernel call (no execution): its text names the tile shapes the kernel was built with."""
    return str(jax.make_jaxpr(lambda c: paged_attention(**c, config=config))(case))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_no_config_traces_the_head_dims_default(head_dim):
    case = random_paged_case(3, lengths=[300, 40], page_sizes=[16, 64], num_q_heads=8, num_kv_heads=2,
                             head_dim=head_dim)
    got = _jaxpr(case, None)
    assert got == _jaxpr(case, default_config(head_dim))
    # The two tile sizes trace different kernels, so the equality above tells them apart.
    other = TuningConfig(block_kv=64 if default_config(head_dim).block_kv == 128 else 128)
    assert got != _jaxpr(case, other)


def test_the_d64_default_lowers_to_mosaic_gpu_with_stats_and_split_k():
    """The engine's D = 64 decode (128-token tiles) in the variant only a GPU run would otherwise build:
    with the score statistics (the DMLP's features) and split-K (a batch of 2: the grid picks splits;
    the benchmark compiled the plain one on the H200). Lowering to Mosaic GPU runs on a CPU (SMEM layouts, TMA copies, barriers), so a tile change
    that breaks them fails here; ptxas's register allocation is the one step only a GPU runs."""
    import jax.numpy as jnp
    shape = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
    batch = 2
    args = (shape(batch, 32, 64), shape(8, 1 << 16, 64), shape(8, 1 << 16, 64), shape(batch, dt=jnp.int32),
            shape(batch, 128, dt=jnp.int32), shape(batch, dt=jnp.int32))
    fn = jax.jit(lambda *a: paged_attention(*a, return_score_stats=True))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
