"""The page tables the engine really gives an e2e_decode.py batch, dumped for kernel benchmarks (CPU, ~1 min).

    JAX_PLATFORMS=cpu python benchmarks/engine_page_tables.py --batch 64 --prompt-len 512 --new-tokens 256 \\
        --context 640 --out benchmarks/results/engine_page_tables_b64_p512_c640.json

A decode kernel timed alone reads pages laid out by its benchmark (`benchmarks/attention_bound.py`: at random, or
every row's pages one after another). In the engine's step the same kernel was 11-13% slower than alone at the same
context (BENCHMARKS.md #18, session 28), and one candidate cause is where the pages are: the engine's buddy
allocator gives each prompt its pages as the prefill chunks arrive and each row its decode pages one at a time as
the rows grow, after e2e_decode.py's warm-up pass has left its own pages free. This script runs that exact sequence
(e2e_decode.py's engine config and request pattern: a warm-up pass, then the timed batch) until the decode rows hold
--context keys, and writes every running row's length, page size and page starts, with the pool's slot count.

Where the pages go does not depend on the model: the pool's size is the config's (batch x (prompt + new tokens +
256) token slots), the page size comes from the request lengths, and the prompts are random token ids that share no
prefix. So the `tiny` preset (reference attention, on CPU) gives the tables llama-1b and 8b get on the H200;
`attention_bound.py --layouts engine` times the kernel on them. One caveat: the HAB scheduler's admission can depend
on measured device idle time, so a GPU run could place pages differently; for e2e's pattern (every request queued
at once, a pool with room for all) three runs here under different load gave identical tables.
"""
from __future__ import annotations

import argparse
import pathlib

import numpy as np

import e2e_decode  # noqa: E402  (beside this script)
from run_record import provenance, save_json  # noqa: E402  (beside this script)
from stratum_jax.engine import Engine
from stratum_jax.request import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=8, help="decode steps per device call (e2e_decode.py's)")
    ap.add_argument("--context", type=int, default=640,
                    help="stop once the decode rows hold this many keys (e2e's timed pass averages prompt + half "
                         "the new tokens)")
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/engine_page_tables_"
                                                "b<batch>_p<prompt>_c<context>.json)")
    return ap


def dump_tables(args) -> dict:
    """Runs the engine as e2e_decode.py does and returns its running rows' page tables at --context keys."""
    e2e_args = e2e_decode.build_parser().parse_args(
        ["--model", "tiny", "--batch", str(args.batch), "--prompt-len", str(args.prompt_len),
         "--new-tokens", str(args.new_tokens), "--decode-steps", str(args.decode_steps)])
    config = e2e_decode.engine_config(e2e_args, "reference")
    engine = Engine(config)
    vocab = engine.model_config.vocab_size
    # e2e_decode.run_one's request pattern: random prompts, a warm-up pass, then the timed batch.
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab - 1, args.prompt_len).tolist() for _ in range(args.batch)]
    sp = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    engine.generate([[1] + p[1:] for p in prompts], sp)
    for p in prompts:
        engine.add_request([2] + p[1:], sp)
    while engine.has_unfinished():
        engine.step()
        seqs = list(engine.requests.values())
        if len(seqs) == args.batch and min(s.num_computed for s in seqs) >= args.context:
            break
    else:
        raise SystemExit(f"--context {args.context}: the rows finished first (prompt {args.prompt_len} + "
                         f"{args.new_tokens} new tokens)")
    engine.close()
    # length: the keys the cache holds (num_computed: K/V written), which the pages cover.
    rows = [dict(length=int(s.num_computed), page_size=int(s.blocks.page_size),
                 page_starts=[int(x) for x in s.blocks.page_starts()]) for s in seqs]
    return dict(provenance("engine_page_tables"), num_slots=int(config.kv_pool_slots), batch=args.batch,
                prompt_len=args.prompt_len, new_tokens=args.new_tokens, context=args.context,
                rows=rows)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if not 0 < args.prompt_len < args.context <= args.prompt_len + args.new_tokens:
        raise SystemExit(f"--context must be past the prompt and within prompt + new tokens, got {args.context} "
                         f"(prompt {args.prompt_len}, new tokens {args.new_tokens})")
    out = dump_tables(args)
    lengths = [r["length"] for r in out["rows"]]
    sizes = sorted({r["page_size"] for r in out["rows"]})
    runs = [sum(1 for a, b in zip(r["page_starts"], r["page_starts"][1:]) if b == a + r["page_size"])
            / max(1, len(r["page_starts"]) - 1) for r in out["rows"]]
    print(f"{len(lengths)} rows, {min(lengths)}-{max(lengths)} keys, page sizes {sizes}, pool {out['num_slots']} "
          f"slots; a row's next page follows its last in the pool {np.mean(runs):.0%} of the time")
    path = pathlib.Path(args.out or pathlib.Path(__file__).resolve().parent / "results" /
                        f"engine_page_tables_b{args.batch}_p{args.prompt_len}_c{args.context}.json")
    print(f"wrote {save_json(path, out, indent=None)}")
    return out


if __name__ == "__main__":
    main()
