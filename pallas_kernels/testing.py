"""Random paged-attention inputs and float64 ground truths, shared by the kernel tests and the kernel
benchmark's correctness checks (tests/test_paged_attention.py, tests/test_delta_attention.py,
benchmarks/kernels.py).

A case is a dict of the kernel's arguments: q [B, Hq, D], k_pool/v_pool [Hkv, num_slots, D] (bf16),
lengths [B], page_starts [B, max_pages], page_sizes [B]. Pages are placed as the engine's buddy
allocator would (a page of P tokens at a P-aligned slot, random placement), every slot outside a
sequence holds NaN (so a kernel that reads one is caught), and table entries past a sequence's last
page are garbage (huge, negative or unaligned), so a kernel that reads one is caught too.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import PAGE_SIZES


def _alloc_pages(rng, num_slots, lengths, page_sizes):
    """Random buddy allocation: page_starts [B, max_pages] (garbage past each sequence's pages) and a
    bool mask [num_slots] of the slots that hold live tokens."""
    free = {p: [] for p in PAGE_SIZES}
    free[256] = list(rng.permutation(np.arange(0, num_slots, 256)))

    def take(p):
        if not free[p]:
            if p == 256:
                raise RuntimeError("pool too small for this batch")
            big = take(2 * p)
            halves = [big, big + p]
            rng.shuffle(halves)
            free[p].extend(halves)
        return int(free[p].pop(rng.integers(len(free[p]))))

    max_pages = max(1, max(-(-int(L) // int(P)) for L, P in zip(lengths, page_sizes)) + 1)
    starts = rng.choice([-12345, 10**8 + 3, num_slots * 7 + 1], size=(len(lengths), max_pages)).astype(np.int32)
    live = np.zeros(num_slots, bool)
    for b, (L, P) in enumerate(zip(lengths, page_sizes)):
        for i in range(-(-int(L) // int(P))):
            s = take(int(P))
            starts[b, i] = s
            n = min(int(P), int(L) - i * int(P))
            live[s:s + n] = True
    return starts, live


def random_paged_case(seed, *, lengths, page_sizes, num_q_heads, num_kv_heads, head_dim, num_slots=None,
                      q_dtype=jnp.bfloat16, nan_outside=True) -> dict:
    """A random ragged batch: sequence b has lengths[b] tokens in pages of page_sizes[b] tokens."""
    rng = np.random.default_rng(seed)
    need = sum(-(-L // P) * P for L, P in zip(lengths, page_sizes))
    num_slots = num_slots or max(256, -(-(2 * need + 256) // 256) * 256)
    starts, live = _alloc_pages(rng, num_slots, lengths, page_sizes)
    k = rng.standard_normal((num_kv_heads, num_slots, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_kv_heads, num_slots, head_dim)).astype(np.float32)
    if nan_outside:
        k[:, ~live] = np.nan
        v[:, ~live] = np.nan
    q = (rng.standard_normal((len(lengths), num_q_heads, head_dim)) * 1.5).astype(np.float32)
    return dict(q=jnp.asarray(q, q_dtype), k_pool=jnp.asarray(k, jnp.bfloat16),
                v_pool=jnp.asarray(v, jnp.bfloat16), lengths=jnp.asarray(lengths, jnp.int32),
                page_starts=jnp.asarray(starts), page_sizes=jnp.asarray(page_sizes, jnp.int32))



def ragged_decode_case(batch, head_dim, context, seed=0, page_sizes=None) -> dict:
    """`random_paged_case` at a decode step's shape (Hq=32, Hkv=8): lengths context - [0, 130), the first two
    0 and 1, page sizes cycling through PAGE_SIZES unless given (the swapped kernel's GPU tests and
    benchmarks/fp8_gpu_diag.py)."""
    sizes = page_sizes or [PAGE_SIZES[b % len(PAGE_SIZES)] for b in range(batch)]
    rng = np.random.default_rng(seed)
    lengths = [context - int(x) for x in rng.integers(0, 130, batch)]
    lengths[0], lengths[1] = 0, 1
    return random_paged_case(seed, lengths=lengths, page_sizes=sizes, num_q_heads=32, num_kv_heads=8,
                             head_dim=head_dim)

def fp8_granule_case(case, seed=0, *, scale_range=(0.002, 0.02)) -> tuple[dict, dict]:
    """A paged case's pools as fp8 e4m3 with a scale per 8-slot granule per kv head (`swapped_paged_attention`'s
    k_scale / v_scale): returns (the case with k_pool / v_pool e4m3 (the rows * 40, spanning e4m3's range) plus
    k_scale, v_scale [Hkv, S // 8] f32 uniform in scale_range, NaN where a granule has no live key (the pools'
    NaN slots); the float64 truth's case, its pools the e4m3 values times their granule's scale)."""
    rng = np.random.default_rng(seed + 2000)
    out, truth = dict(case), dict(case)
    for side in ("k", "v"):
        pool = case[f"{side}_pool"]
        f8 = (pool.astype(jnp.float32) * 40.0).astype(jnp.float8_e4m3fn)
        live = ~np.isnan(np.asarray(pool[0, :, 0].astype(jnp.float32)))
        scale = rng.uniform(*scale_range, (pool.shape[0], pool.shape[1] // 8))
        scale[:, ~live.reshape(-1, 8).any(axis=1)] = np.nan
        out[f"{side}_pool"], out[f"{side}_scale"] = f8, jnp.asarray(scale, jnp.float32)
        truth[f"{side}_pool"] = _float64(f8) * np.repeat(scale.astype(np.float32), 8, axis=1)[..., None]
    return out, truth


def _float64(x) -> np.ndarray:
    """A jax array's values (bf16/fp16/fp8 included) or a numpy array, as float64."""
    if isinstance(x, np.ndarray) and x.dtype == np.float64:
        return x
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def _float64_scores(case, sm_scale, soft_cap):
    """Yields (b, hq, scores [L] float64, v rows [L, D]) for every non-empty row, from the bf16-rounded
    inputs the kernel sees (k_pool/v_pool may also be float64 numpy pools)."""
    q = np.asarray(case["q"].astype(jnp.float32), np.float64)
    k, v = (_float64(case[n]) for n in ("k_pool", "v_pool"))
    lengths, starts, sizes = (np.asarray(case[n]) for n in ("lengths", "page_starts", "page_sizes"))
    B, Hq, D = q.shape
    group = Hq // k.shape[0]
    scale = 1.0 / np.sqrt(D) if sm_scale is None else sm_scale
    for b in range(B):
        L, P = int(lengths[b]), int(sizes[b])
        if L == 0:
            continue
        slots = np.array([starts[b, t // P] + t % P for t in range(L)])
        for hq in range(Hq):
            s = k[hq // group, slots] @ q[b, hq] * scale
            if soft_cap is not None:
                s = soft_cap * np.tanh(s / soft_cap)
            yield b, hq, s, v[hq // group, slots]


def float64_attention(case, *, sm_scale=None, soft_cap=None) -> np.ndarray:
    """Ground truth of the kernel's output: [B, Hq, D] float64 (zeros for length-0 rows)."""
    out = np.zeros(case["q"].shape, np.float64)
    for b, hq, s, vv in _float64_scores(case, sm_scale, soft_cap):
        p = np.exp(s - s.max())
        out[b, hq] = p @ vv / p.sum()
    return out


def float64_score_variance(case, *, sm_scale=None, soft_cap=None) -> np.ndarray:
    """Ground truth of the per-row score variance: [B, Hq] float64, the population variance over the
    valid keys of s = sm_scale * q.k (soft-capped if set); 0 for length-0 rows."""
    out = np.zeros(case["q"].shape[:2], np.float64)
    for b, hq, s, _ in _float64_scores(case, sm_scale, soft_cap):
        out[b, hq] = s.var()
    return out


def prefill_blocks_case(case, blocks, tokens, seed=0) -> dict:
    """Causal prefill blocks over the sequences of a `random_paged_case`: blocks is a list of
    (sequence, q_start, n_valid) — `tokens` query tokens at positions q_start.. of that sequence (its
    first n_valid are real, the rest padding); sequence -1 makes a padding block. Returns the
    `paged_prefill_attention` arguments (q [blocks, tokens, Hq, D] bf16, q_starts, lengths,
    page_starts, page_sizes, k_pool, v_pool) plus "valid" [blocks, tokens] bool."""
    rng = np.random.default_rng(seed)
    seq = np.array([max(s, 0) for s, _, _ in blocks])
    ctx = np.asarray(case["lengths"])[seq]
    starts = np.array([max(q0, 0) for _, q0, _ in blocks], np.int32)
    lengths = np.array([0 if s < 0 else min(q0 + tokens, int(c)) for (s, q0, _), c in zip(blocks, ctx)], np.int32)
    valid = np.array([[s >= 0 and i < n for i in range(tokens)] for s, _, n in blocks])
    q = rng.standard_normal((len(blocks), tokens, case["q"].shape[1], case["q"].shape[2])) * 1.5
    return dict(q=jnp.asarray(q, jnp.bfloat16), k_pool=case["k_pool"], v_pool=case["v_pool"],
                q_starts=jnp.asarray(starts), lengths=jnp.asarray(lengths),
                page_starts=case["page_starts"][seq], page_sizes=case["page_sizes"][seq], valid=valid)


def _per_token_case(pcase) -> dict:
    """A prefill-blocks case as a decode case with one row per query token (its visible keys as the
    row's length), so the decode truths serve the prefill kernel."""
    blocks, tokens = pcase["q"].shape[:2]
    seen = np.minimum(np.asarray(pcase["q_starts"])[:, None] + np.arange(1, tokens + 1)[None, :],
                      np.asarray(pcase["lengths"])[:, None])
    seen = np.where(np.asarray(pcase["lengths"])[:, None] > 0, seen, 0).reshape(-1)
    rep = lambda a: jnp.repeat(a, tokens, axis=0)
    return dict(q=pcase["q"].reshape(blocks * tokens, *pcase["q"].shape[2:]), k_pool=pcase["k_pool"],
                v_pool=pcase["v_pool"], lengths=jnp.asarray(seen, jnp.int32),
                page_starts=rep(pcase["page_starts"]), page_sizes=rep(pcase["page_sizes"]))


def float64_prefill_attention(pcase) -> np.ndarray:
    """Ground truth of `paged_prefill_attention`: [blocks, tokens, Hq, D] float64."""
    return float64_attention(_per_token_case(pcase)).reshape(pcase["q"].shape)


def float64_prefill_score_variance(pcase) -> np.ndarray:
    """Ground truth of its score variance: [blocks, tokens, Hq] float64."""
    return float64_score_variance(_per_token_case(pcase)).reshape(pcase["q"].shape[:3])


# ---------------------------------------------------------------------------------------------
# Delta-KV (DKVC) cases: anchor + fp16/fp8 deltas with per-granule scales
# ---------------------------------------------------------------------------------------------

def random_delta_case(seed, *, lengths, page_sizes, num_q_heads, num_kv_heads, head_dim, delta_dtype,
                      anchor_len=1, nan_outside=True) -> dict:
    """A random ragged batch in the delta-KV layout (`delta_attention`'s arguments): the pages of
    `random_paged_case`, anchor_k/v [Hkv, anchor_len, D] bf16 (offset from 0, as real K/V are),
    deltas [Hkv, S, D] of `delta_dtype` (float16 or float8_e4m3fn) spanning the dtype's range, and
    scales [Hkv, S // 8] float32 that differ per granule, so a kernel that picks a neighbour's scale
    or anchor row is caught. Every slot outside a live token holds a NaN delta, and every granule with
    no live token a NaN scale."""
    case = random_paged_case(seed, lengths=lengths, page_sizes=page_sizes, num_q_heads=num_q_heads,
                             num_kv_heads=num_kv_heads, head_dim=head_dim, nan_outside=nan_outside)
    rng = np.random.default_rng(seed + 1000)
    live = ~np.isnan(np.asarray(case["k_pool"][0, :, 0].astype(jnp.float32))) if nan_outside else None
    num_slots = case["k_pool"].shape[1]
    fp8 = jnp.dtype(delta_dtype) == jnp.float8_e4m3fn
    out = dict(q=case["q"], lengths=case["lengths"], page_starts=case["page_starts"], page_sizes=case["page_sizes"])
    for side in ("k", "v"):
        anchor = rng.standard_normal((num_kv_heads, anchor_len, head_dim)) + rng.standard_normal((num_kv_heads, 1, 1))
        # Deltas up to ~100 (fp8 e4m3 keeps 3 mantissa bits at any magnitude), scales ~1/200.
        delta = rng.standard_normal((num_kv_heads, num_slots, head_dim)) * (40.0 if fp8 else 1.0)
        scale = rng.uniform(0.002, 0.02, (num_kv_heads, num_slots // 8)) * (1.0 if fp8 else 40.0)
        if nan_outside:
            delta[:, ~live] = np.nan
            scale[:, ~live.reshape(-1, 8).any(axis=1)] = np.nan
        out[f"anchor_{side}"] = jnp.asarray(anchor, jnp.bfloat16)
        out[f"{side}_delta"] = jnp.asarray(delta, delta_dtype)
        out[f"{side}_scale"] = jnp.asarray(scale, jnp.float32)
    return out


def packed_delta_kwargs(case) -> dict:
    """A `random_delta_case`'s arguments with its two scale arrays packed (`pack_granule_scales`: the engine
    cache's layout) and passed as packed_scales (k_scale / v_scale None); float64 truths take the case itself."""
    from pallas_kernels.delta_attention import pack_granule_scales
    return {**case, "k_scale": None, "v_scale": None,
            "packed_scales": pack_granule_scales(case["k_scale"], case["v_scale"])}


def float64_delta_pools(case, *, mma_bf16=False) -> tuple[np.ndarray, np.ndarray]:
    """The rebuilt K and V pools [Hkv, S, D] float64 of a delta case: slot s holding token t of a
    sequence gets anchor[t % anchor_len] + scale[s // 8] * delta[s] (from the rounded stored values),
    then, with mma_bf16, rounded to bf16 as the kernel does for its MMAs; slots holding no live token
    are NaN."""
    lengths, starts, sizes = (np.asarray(case[n]) for n in ("lengths", "page_starts", "page_sizes"))
    pools = []
    for side in ("k", "v"):
        anchor, delta, scale = (_float64(case[n]) for n in (f"anchor_{side}", f"{side}_delta", f"{side}_scale"))
        pool = np.full(delta.shape, np.nan)
        for b, (L, P) in enumerate(zip(lengths, sizes)):
            t = np.arange(int(L))
            slots = starts[b, t // int(P)] + t % int(P)
            pool[:, slots] = anchor[:, t % anchor.shape[1]] + scale[:, slots // 8, None] * delta[:, slots]
        if mma_bf16:
            pool = _float64(jnp.asarray(pool.astype(np.float32), jnp.bfloat16))
        pools.append(pool)
    return pools[0], pools[1]


def _as_paged(case, mma_bf16) -> dict:
    k, v = float64_delta_pools(case, mma_bf16=mma_bf16)
    return dict(q=case["q"], k_pool=k, v_pool=v, lengths=case["lengths"], page_starts=case["page_starts"],
                page_sizes=case["page_sizes"])


def float64_delta_attention(case, *, sm_scale=None, soft_cap=None, mma_bf16=False) -> np.ndarray:
    """Ground truth of `delta_attention`: [B, Hq, D] float64 over the rebuilt K/V (unrounded, or with
    mma_bf16 rounded to bf16 as the kernel's MMAs see them)."""
    return float64_attention(_as_paged(case, mma_bf16), sm_scale=sm_scale, soft_cap=soft_cap)


def float64_delta_score_variance(case, *, sm_scale=None, soft_cap=None, mma_bf16=False) -> np.ndarray:
    """Ground truth of its score variance: [B, Hq] float64."""
    return float64_score_variance(_as_paged(case, mma_bf16), sm_scale=sm_scale, soft_cap=soft_cap)
