"""DKVC quality: next-token KL(bf16 cache || DKVC cache) on the embedded real-text model `pydoc-2m`.

For every held-aside prompt, the bf16-cache model generates greedily; at each generated position the
same token history is run through four caches side by side, in one jitted scan:
  - bf16: the engine's bf16 pools (the reference distribution p);
  - fp16-delta, fp8-delta: the engine's DKVC cache (stratum_jax/kv/delta_cache.py) around the anchor the
    engine builds at start-up (stratum_jax/kv/anchor.py: a warm-up run, mean vs position-aligned);
  - fp8: plain fp8 KV without an anchor (a zero anchor, the same per-granule scale rule and floor rule);
  - fp8-delta-head-scale: fp8 deltas around the same anchor whose floor is the largest warm-up delta / 448
    (`AnchorChoice.max_floors`), so the per-granule rule nearly always keeps that one scale per layer and head:
    what a kernel with one scale per head (folded into q and the output, no per-key scale work) would read;
  - fp8-delta-fixed-head: what `--fp8-scale head` stores: the same max floors as fixed scales, never
    rewritten (a delta beyond the warm-up's largest saturates instead of widening its granule's scale).
Every variant is fed the bf16 greedy token (teacher forcing), so all see the same history, and reports
KL(p || q) of its next-token distribution q and whether its argmax agrees with p's (greedy-token
agreement). The prompt is written by one prefill step (whole granules per step), the generated positions
one token per step, as the engine's decode writes them, read through the engine's tiled jnp attention.

Prompts: windows of `--prompt-len` tokens (after BOS) from the files of the Python documentation that
the model's corpus held out (training/lm_corpus.py `is_held_out`: whole files, never trained on), spread
evenly over those files. With `--sources` they are cut from the corpus and saved to
benchmarks/results/dkvc_quality_prompts.npy; without it that file is read (so a machine without the
corpus, e.g. the H200, runs the same prompts).

    python benchmarks/dkvc_quality.py --sources /path/to/_sources --prompts 64 --positions 128
    python benchmarks/dkvc_quality.py --prompts 256 --positions 512        # reads the saved prompts
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import logging
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stratum_jax.attention import RowTables, tiled_paged_attention  # noqa: E402
from stratum_jax.kv.anchor import fit_anchor, warmup_windows  # noqa: E402
from stratum_jax.kv.delta_cache import init_delta_cache  # noqa: E402
from stratum_jax.model import llama  # noqa: E402
from stratum_jax.model.loader import load_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROMPTS_FILE = RESULTS / "dkvc_quality_prompts.npy"
VARIANTS = ("fp16-delta", "fp8-delta", "fp8", "fp8-delta-head-scale", "fp8-delta-fixed-head")
PAGE = 256                     # page size of the study's block tables (each row's slots are contiguous)
KEY_BLOCK = 128                # the tiled attention's key block: a loop to the step's context, not the bound


def held_out_prompts(sources: Path, tokenizer, count: int, length: int) -> np.ndarray:
    """[count, length + 1] int32: BOS + `length` tokens, non-overlapping windows of the held-out files,
    `count` of them taken evenly over all windows (in file order)."""
    from training.lm_corpus import read_sources
    _, val = read_sources(sources)
    windows = []
    for _, text in val:
        ids = tokenizer.encode(text, add_bos=False)
        windows += [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)]
    if len(windows) < count:
        raise SystemExit(f"the held-out files give {len(windows)} windows of {length} tokens, {count} asked for")
    pick = np.linspace(0, len(windows) - 1, count).round().astype(int)
    bos = tokenizer.bos_token_id
    return np.array([[bos] + windows[i] for i in pick], np.int32)


def make_caches(model, choice, num_slots: int) -> dict:
    cfg = model.config
    caches = {"bf16": llama.init_kv_cache(cfg, num_slots)}
    for name in ("fp16-delta", "fp8-delta"):
        caches[name] = init_delta_cache(choice.anchors, choice.floors, num_slots, name)
    zero = [(jnp.zeros((cfg.num_kv_heads, 1, cfg.head_dim), cfg.dtype),) * 2 for _ in range(cfg.num_layers)]
    caches["fp8"] = init_delta_cache(zero, choice.zero_floors, num_slots, "fp8-delta")
    caches["fp8-delta-head-scale"] = init_delta_cache(choice.anchors, choice.max_floors, num_slots, "fp8-delta")
    caches["fp8-delta-fixed-head"] = init_delta_cache(choice.anchors, choice.max_floors, num_slots, "fp8-delta",
                                                      fixed_scales=True)
    return caches


def _attend_prefill(prompt_len, tables):
    rows = tables.context_lens.shape[0]
    positions = jnp.tile(jnp.arange(prompt_len, dtype=jnp.int32), (rows, 1))

    def attend(layer, q, k_pool, v_pool):
        out = tiled_paged_attention(q.reshape(rows, prompt_len, *q.shape[1:]), positions,
                                    jnp.arange(rows, dtype=jnp.int32), tables, k_pool, v_pool, key_block=KEY_BLOCK)
        return out.reshape(q.shape)
    return attend


@functools.partial(jax.jit, static_argnames=("cfg", "steps"))
def run_study(params, caches, prompts, page_starts, *, cfg, steps: int):
    """prompts [R, P] int32 -> (kl [steps, V, R] float32, agree [steps, V, R] bool, tokens [steps, R]) for the
    variants V = VARIANTS, at generated positions P .. P + steps - 1."""
    rows, plen = prompts.shape
    sizes = jnp.full((rows,), PAGE, jnp.int32)
    pos = jnp.arange(plen, dtype=jnp.int32)
    slots = (page_starts[:, :1] + pos[None, :]).reshape(-1)              # pages are contiguous per row
    tables = RowTables(jnp.full((rows,), plen, jnp.int32), page_starts, sizes)
    attend = _attend_prefill(plen, tables)
    logps = {}
    for name in caches:
        hidden, caches[name] = llama.forward(params, cfg, prompts.reshape(-1), jnp.tile(pos, rows), caches[name],
                                             slots, attend)
        last = hidden.reshape(rows, plen, -1)[:, -1]
        logps[name] = jax.nn.log_softmax(llama.compute_logits(params, cfg, last), axis=-1)

    def compare(logps):
        p = logps["bf16"]
        kl = jnp.stack([jnp.sum(jnp.exp(p) * (p - logps[v]), axis=-1) for v in VARIANTS])           # [V, R]
        agree = jnp.stack([jnp.argmax(logps[v], -1) == jnp.argmax(p, -1) for v in VARIANTS])
        return kl, agree

    def body(carry, i):
        caches, logps = carry
        kl, agree = compare(logps)
        token = jnp.argmax(logps["bf16"], axis=-1).astype(jnp.int32)                             # [R]
        position = jnp.full((rows,), plen, jnp.int32) + i
        slot = page_starts[:, 0] + position
        own = RowTables(position + 1, page_starts, sizes)

        def attend(layer, q, k_pool, v_pool):
            out = tiled_paged_attention(q[:, None], position[:, None], jnp.arange(rows, dtype=jnp.int32), own,
                                        k_pool, v_pool, key_block=KEY_BLOCK)
            return out[:, 0]
        new = {}
        for name in caches:
            hidden, cache = llama.forward(params, cfg, token, position, caches[name], slot, attend)
            caches = {**caches, name: cache}
            new[name] = jax.nn.log_softmax(llama.compute_logits(params, cfg, hidden), axis=-1)
        return (caches, new), (kl, agree, token)

    # Step i compares the distributions of position plen + i (the first from the prefill), then writes
    # the bf16 greedy token there; `steps` comparisons in all.
    _, (kl, agree, tokens) = jax.lax.scan(body, (caches, logps), jnp.arange(steps, dtype=jnp.int32))
    return kl, agree, tokens


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name in VARIANTS:
        r = result["variants"][name]
        curve = np.maximum(np.array(r["kl_by_position"]), 1e-9)
        ax1.plot(np.arange(len(curve)), curve, label=f"{name} (mean {r['kl_mean']:.2e})")
        ax2.plot(np.arange(len(curve)), r["agreement_by_position"], label=f"{name} ({r['agreement']:.4f})")
    ax1.set_yscale("log")
    ax1.set_xlabel("generated position")
    ax1.set_ylabel("mean KL(bf16 || variant), nats")
    ax1.axhline(0.002, color="gray", ls=":", lw=1)
    ax1.axhline(0.005, color="gray", ls="--", lw=1)
    ax2.set_xlabel("generated position")
    ax2.set_ylabel("greedy-token agreement with bf16")
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    c = result["config"]
    fig.suptitle(f"DKVC quality, pydoc-2m, {c['prompts']} held-out prompts x {c['positions']} positions "
                 f"(anchor: {result['anchor']['kind']}), {result['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sources", type=Path, default=None,
                    help="python3.11-doc's html/_sources folder: cut the held-out prompts from it (and save them)")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt after BOS")
    ap.add_argument("--positions", type=int, default=512, help="generated positions per prompt")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default: benchmarks/results/...)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    model = load_model("pydoc-2m", dtype="bfloat16")
    cfg = model.config
    if args.sources is not None:
        all_prompts = held_out_prompts(args.sources, model.tokenizer, max(args.prompts, 256), args.prompt_len)
        RESULTS.mkdir(exist_ok=True)
        np.save(PROMPTS_FILE, all_prompts.astype(np.uint16))
    else:
        if not PROMPTS_FILE.exists():
            raise SystemExit(f"{PROMPTS_FILE} is missing: give --sources (python3.11-doc's html/_sources)")
        all_prompts = np.load(PROMPTS_FILE).astype(np.int32)
    if all_prompts.shape[1] != args.prompt_len + 1 or all_prompts.shape[0] < args.prompts:
        raise SystemExit(f"{PROMPTS_FILE} holds {all_prompts.shape[0]} prompts of {all_prompts.shape[1] - 1} "
                         f"tokens; --prompts {args.prompts} --prompt-len {args.prompt_len} needs --sources")
    pick = np.linspace(0, all_prompts.shape[0] - 1, args.prompts).round().astype(int)
    prompts = all_prompts[pick]
    rows, plen = prompts.shape
    context = plen + args.positions
    if context > cfg.max_position_embeddings:
        raise SystemExit(f"prompt ({plen}) + positions ({args.positions}) exceed the model's "
                         f"{cfg.max_position_embeddings} positions")
    per_row = -(-context // PAGE) * PAGE
    page_starts = (np.arange(rows)[:, None] * per_row + np.arange(per_row // PAGE)[None, :] * PAGE).astype(np.int32)

    t0 = time.perf_counter()
    choice = fit_anchor(model.params, cfg, warmup_windows(model.tokenizer))
    caches = make_caches(model, choice, rows * per_row)
    t1 = time.perf_counter()
    kl, agree, tokens = jax.device_get(run_study(model.params, caches, jnp.asarray(prompts), jnp.asarray(page_starts),
                                                 cfg=cfg, steps=args.positions))
    seconds = time.perf_counter() - t1
    variants = {}
    for i, name in enumerate(VARIANTS):
        k, a = kl[:, i].astype(np.float64), agree[:, i]
        variants[name] = {
            "kl_mean": float(k.mean()), "kl_median": float(np.median(k)), "kl_p99": float(np.quantile(k, 0.99)),
            "kl_max": float(k.max()), "agreement": float(a.mean()),
            "kl_mean_per_prompt_max": float(k.mean(axis=0).max()),
            "kl_by_position": [float(x) for x in k.mean(axis=1)],
            "agreement_by_position": [float(x) for x in a.mean(axis=1)],
        }
    result = {
        "benchmark": "dkvc_quality", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": jax.devices()[0].device_kind, "platform": jax.default_backend(), "jax": jax.__version__,
        "model": "pydoc-2m (bfloat16)",
        "config": {"prompts": rows, "prompt_len": plen - 1, "positions": args.positions,
                   "prompt_source": "held-out files of python3.11-doc (training/lm_corpus.py is_held_out)",
                   "anchor_warmup": "stdlib docstrings (stratum_jax/kv/anchor.py)", "teacher_forced": "bf16 greedy"},
        "anchor": {"kind": choice.kind, "anchor_len": int(choice.anchors[0][0].shape[1]), "held_out_rms": choice.rms},
        "seconds": {"anchor_and_alloc": t1 - t0, "study": seconds},
        "criteria": {"fp16-delta kl_mean < 0.002": variants["fp16-delta"]["kl_mean"] < 0.002,
                     "fp8-delta kl_mean < 0.005": variants["fp8-delta"]["kl_mean"] < 0.005,
                     "fp8-delta kl_mean < plain fp8": variants["fp8-delta"]["kl_mean"] < variants["fp8"]["kl_mean"],
                     "fp8-delta-fixed-head kl_mean < 0.005": variants["fp8-delta-fixed-head"]["kl_mean"] < 0.005,
                     "fp8-delta-fixed-head kl_mean < plain fp8":
                         variants["fp8-delta-fixed-head"]["kl_mean"] < variants["fp8"]["kl_mean"]},
        "variants": variants,
    }
    stem = f"dkvc_quality_{result['platform']}_{rows}x{args.positions}"
    out = args.out or RESULTS / f"{stem}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    for name in VARIANTS:
        r = variants[name]
        print(f"{name:11s} KL mean {r['kl_mean']:.3e} median {r['kl_median']:.3e} p99 {r['kl_p99']:.3e} "
              f"max {r['kl_max']:.3e}  greedy agreement {r['agreement']:.4f}")
    print(f"anchor {choice.kind}; {rows} prompts x {args.positions} positions in {seconds:.1f} s -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
