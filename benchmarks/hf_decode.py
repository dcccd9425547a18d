"""HF transformers' decode throughput on a preset's shapes, for reference beside the engine (issue #18).

    python benchmarks/hf_decode.py --model llama-1b --batch 64 --prompt-len 512 --new-tokens 256 \
        --modes static-compiled,dynamic --out benchmarks/results/hf_decode_llama-1b_b64.json
    python benchmarks/hf_decode.py --dry-run          # tiny preset, fp32, on CPU: what tests/test_hf_decode.py runs

Needs torch and transformers >= 5 (not project dependencies: the GPU machine has both; locally,
`source .ci/hf_env.sh` and use "$STRATUM_HF_PYTHON" with PYTHONPATH=. ). The model is a LlamaForCausalLM
built from the stratum-jax preset's ModelConfig (stratum_jax/model/config.py PRESETS; `hf_config` maps
the fields), with HF's random init, made directly on --device in --dtype (bf16 on cuda by default, so
the 8B shape never exists in fp32). The prompts are --batch rows of --prompt-len random token ids, no
padding; decoding is greedy (argmax on the device, no host read per step).

Modes (--modes, comma-separated; one result per mode):
  static-compiled  transformers' StaticCache, and the decode step (forward + argmax) under
                   torch.compile(backend=--compile-backend, mode=--compile-mode, fullgraph=True): HF's
                   documented fast path (its LLM optimization guide compiles a one-token decode function
                   so). Mode "reduce-overhead" replays the step as a CUDA graph. No host work between
                   steps: an upper bound for HF.
  static           StaticCache, eager.
  dynamic          DynamicCache (HF's default cache, which grows by concatenation), eager.
  generate         `model.generate` itself, greedy, with a StaticCache passed in: on cuda, generate
                   compiles the forward on its own when the cache is static (its default CompileConfig:
                   reduce-overhead, fullgraph=False); on CPU it runs eager. It adds generate's per-step host work
                   (logits processors, stopping criteria, growing input_ids) that the loops above leave out.

What is timed, per mode: one warm-up pass (--warmup-passes; it holds torch.compile's tracing, autotuning
and the CUDA-graph capture, and is reported only as warmup_seconds), then --repeats timed passes. A pass
resets the cache, runs the prefill once (all --prompt-len tokens in one eager forward; timed on its own,
with a device sync each side: prefill_seconds) and takes the first token from it, then runs --new-tokens
decode steps back to back, each feeding the previous step's token (so the timed steps see contexts
prompt_len .. prompt_len + new_tokens - 1, as e2e_decode.py's decode does). A CUDA event is recorded
before the first step and after each step, and the device is synchronised once at the end of the pass,
so a step's time is the device-timeline interval between consecutive events: it includes any time the GPU
waits for the host to launch the step's kernels (what eager modes lose), and nothing of the prefill.
  decode_tokens_per_s    = batch * new_tokens * repeats / (sum over timed passes of first->last event)
  decode_step_ms_median  = median over all timed steps of all timed passes
On CPU (--device cpu) host clocks stand in for the events (the CPU runs each step synchronously).
generate is timed from inside: one generate(max_new_tokens=new_tokens + 1) call per pass, with a logits
processor that marks the clock each time generate asks it for a token. The first mark follows the prefill
(prefill_seconds is from a mark taken before the call, so it holds generate's set-up too); each later interval
is one decode step with generate's own host work between forwards. (Subtracting a timed generate(1) from a
timed generate(new_tokens + 1) read negative decode times on a loaded CPU with short runs.)
Prints a short table; writes JSON (a list, one record per mode) to --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import statistics
import sys
import time

# Run as a script, Python puts benchmarks/ first on sys.path, where kernels.py would shadow the `kernels`
# package that transformers probes for at import (and pull in jax). This script imports nothing from there.
if __name__ == "__main__":
    _HERE = pathlib.Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _HERE]

try:
    from stratum_jax.model.config import PRESETS, ModelConfig
except ImportError:      # run without PYTHONPATH from a checkout: the package is beside benchmarks/
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from stratum_jax.model.config import PRESETS, ModelConfig

MODES = ("static-compiled", "static", "dynamic", "generate")
# aot_eager in the dry run: dynamo still captures the whole HF model and its StaticCache (fullgraph), but
# inductor's C++ code generation, about 30 s of a CPU test for nothing the GPU runs reuse, is left out.
DRY_RUN = dict(model="tiny", device="cpu", dtype="float32", batch=2, prompt_len=16, new_tokens=8, repeats=2,
               compile_backend="aot_eager")


def hf_config(cfg: ModelConfig, attn_implementation: str | None = None):
    """A transformers.LlamaConfig with the shapes and numerics of a stratum-jax ModelConfig (transformers 5:
    rope_theta and the RoPE scaling go together in `rope_parameters`)."""
    from transformers import LlamaConfig

    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    fields = {k: v for k, v in cfg.to_hf_llama_config().items() if k != "model_type"}   # LlamaConfig sets it
    return LlamaConfig(**fields, bos_token_id=cfg.bos_token_id, eos_token_id=list(cfg.eos_token_ids) or None,
                       pad_token_id=None, **kwargs)


def build_model(cfg: ModelConfig, device: str, dtype: str, attn_implementation: str | None):
    """LlamaForCausalLM for `cfg` with HF's random init, created on `device` in `dtype` (no fp32 copy)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = hf_config(cfg, attn_implementation)
    torch.manual_seed(0)          # HF's init draws from the global generator: the same weights every run
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype), **kwargs)
    # Every row decodes its full length, as the engine's benchmarks run (ignore_eos): no EOS for `generate`.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


class _Clock:
    """Marks on the device timeline (CUDA events) or, on CPU, host times; `intervals` in seconds."""

    def __init__(self, device: str):
        import torch
        self.torch, self.cuda = torch, device.startswith("cuda")

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        e = self.torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def intervals(self, marks) -> list[float]:
        if not self.cuda:
            return [b - a for a, b in zip(marks, marks[1:])]
        return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]


class _MarkEachToken:
    """A logits processor (called once per generated token, after that token's forward) that calls
    `on_token` and leaves the scores alone: per-step marks from inside `model.generate`."""

    def __init__(self, on_token):
        self.on_token = on_token

    def __call__(self, input_ids, scores):
        self.on_token()
        return scores


def run_mode(model, cfg: ModelConfig, args, mode: str) -> dict:
    import torch
    from transformers import DynamicCache, LogitsProcessorList, StaticCache

    device = args.device
    clock = _Clock(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    prompts = torch.randint(3, cfg.vocab_size - 1, (args.batch, args.prompt_len), generator=gen).to(device)
    static = mode != "dynamic"
    # +1: the last step's own token is written to the cache too. One cache for every pass (reset in place),
    # so the compiled step and its CUDA graph always see the same buffers.
    cache = StaticCache(config=model.config, max_cache_len=args.prompt_len + args.new_tokens + 1) if static else None

    def forward(ids, kv):
        logits = model(input_ids=ids, past_key_values=kv, use_cache=True, logits_to_keep=1).logits
        return logits[:, -1].argmax(-1, keepdim=True)

    step = forward
    if mode == "static-compiled":
        # A mode is inductor's option: other backends take none.
        inductor_mode = {"mode": args.compile_mode} if args.compile_backend == "inductor" else {}
        compiled = torch.compile(forward, backend=args.compile_backend, fullgraph=True, **inductor_mode)

        def step(ids, kv):
            # CUDA-graph outputs are overwritten by the next replay: mark each step, keep a copy of the token.
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(ids, kv).clone()

    def generate(new_tokens, on_token):
        cache.reset()
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), past_key_values=cache,
                             do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             logits_processor=LogitsProcessorList([_MarkEachToken(on_token)]))
        return out[:, args.prompt_len:]

    passes = []
    with torch.no_grad():
        for i in range(args.warmup_passes + args.repeats):
            t0 = time.perf_counter()
            if mode == "generate":
                clock.sync()
                marks = [clock.mark()]
                toks = [generate(args.new_tokens + 1, on_token=lambda: marks.append(clock.mark()))[:, 1:]]
                clock.sync()
                if len(marks) != args.new_tokens + 2:
                    raise RuntimeError(f"generate asked for {len(marks) - 1} tokens, expected {args.new_tokens + 1}")
                prefill_s, *steps = clock.intervals(marks)
                decode_s = sum(steps)
            else:
                if static:
                    cache.reset()
                    kv = cache
                else:
                    kv = DynamicCache(config=model.config)
                clock.sync()
                tp = time.perf_counter()
                tok = forward(prompts, kv)        # prefill: eager, as generate runs it
                clock.sync()
                prefill_s = time.perf_counter() - tp
                marks, toks = [clock.mark()], []
                for _ in range(args.new_tokens):
                    tok = step(tok, kv)
                    marks.append(clock.mark())
                    toks.append(tok)       # a reference only: no device work, no host read
                clock.sync()
                steps = clock.intervals(marks)
                decode_s = sum(steps)
            passes.append({"prefill_s": prefill_s, "steps": steps, "decode_s": decode_s,
                           "wall_s": time.perf_counter() - t0})
            if i < args.warmup_passes:
                print(f"  {mode}: warm-up pass {i + 1} took {passes[-1]['wall_s']:.1f} s", flush=True)
    warm, timed = passes[:args.warmup_passes], passes[args.warmup_passes:]
    decode_s = sum(p["decode_s"] for p in timed)
    step_times = [s for p in timed for s in p["steps"]]
    prefill_s = statistics.median(p["prefill_s"] for p in timed)
    return {
        "model": args.model, "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "mode": mode, "cache": "static" if static else "dynamic",
        **_compiled(model, args, mode),
        "attn_implementation": model.config._attn_implementation, "dtype": args.dtype,
        "repeats": args.repeats, "warmup_passes": args.warmup_passes,
        "decode_tokens_per_s": args.batch * args.new_tokens * len(timed) / decode_s,
        "decode_step_ms_median": statistics.median(step_times) * 1e3,
        "decode_step_ms_mean": decode_s / (args.new_tokens * len(timed)) * 1e3,
        "decode_seconds_per_pass": [round(p["decode_s"], 6) for p in timed],
        "prefill_seconds": prefill_s, "prefill_tokens_per_s": args.batch * args.prompt_len / prefill_s,
        "warmup_seconds": sum(p["wall_s"] for p in warm),
        # The last pass's greedy tokens of row 0: the modes agree on them (in fp32; bf16 may drift).
        "tokens_row0": torch.cat(toks, 1)[0].tolist(),
        **({"peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9} if clock.cuda else {}),
    }


def _compiled(model, args, mode: str) -> dict:
    """Whether the decode step ran compiled, and in which torch.compile mode. For generate, what generate
    itself chose (it keeps its compiled forward and CompileConfig on the model: private attributes)."""
    if mode == "static-compiled":
        return {"compiled": True, "compile_backend": args.compile_backend,
                "compile_mode": args.compile_mode if args.compile_backend == "inductor" else None}
    if mode == "generate" and getattr(model, "_compiled_call", None) is not None:
        return {"compiled": True, "compile_backend": "inductor",
                "compile_mode": getattr(getattr(model, "_last_compile_config", None), "mode", None)}
    return {"compiled": False, "compile_backend": None, "compile_mode": None}


def environment(args) -> dict:
    import torch
    import transformers

    cuda = args.device.startswith("cuda")
    return {"device": torch.cuda.get_device_name(args.device) if cuda else platform.processor() or "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda if cuda else None, "python": platform.python_version(),
            "date": datetime.date.today().isoformat(), "command": " ".join([sys.executable, *sys.argv])}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)     # --dry-run's defaults read the flags given by name
    ap.add_argument("--model", default="llama-1b", choices=sorted(PRESETS), help="a stratum-jax preset's shapes")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256, help="decode steps timed per pass (after the prefill)")
    ap.add_argument("--modes", default="static-compiled,dynamic",
                    help=f"comma-separated, from {', '.join(MODES)} (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per mode")
    ap.add_argument("--warmup-passes", type=int, default=1, help="untimed passes first (compile, CUDA-graph capture)")
    ap.add_argument("--compile-mode", default="reduce-overhead",
                    choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
                    help="torch.compile mode of static-compiled (inductor's)")
    ap.add_argument("--compile-backend", default="inductor", choices=["inductor", "aot_eager", "eager"],
                    help="torch.compile backend of static-compiled (the dry run's default: aot_eager)")
    ap.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager", "flash_attention_2"],
                    help="transformers' attention (sdpa: its default)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/hf_decode_<model>.json)")
    ap.add_argument("--dry-run", action="store_true",
                    help="the tiny preset, fp32, on CPU, small batch and lengths (flags given still apply "
                         f"over these: {', '.join(f'{k}={v}' for k, v in DRY_RUN.items())})")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = build_parser()
    if argv is None:
        argv = sys.argv[1:]
    args = ap.parse_args(argv)
    if args.dry_run:
        # The dry run's values, except where a flag was given on the command line.
        given = {a.split("=")[0] for a in argv if a.startswith("--")}
        for k, v in DRY_RUN.items():
            if f"--{k.replace('_', '-')}" not in given:
                setattr(args, k, v)
    for name in ("batch", "prompt_len", "new_tokens", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup_passes < 0:
        ap.error(f"--warmup-passes must be >= 0, got {args.warmup_passes}")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        ap.error(f"--modes: {', '.join(bad) or 'none given'}; choose from {', '.join(MODES)}")
    if len(set(args.modes)) != len(args.modes):
        ap.error(f"--modes names a mode twice: {','.join(args.modes)}")
    cfg = PRESETS[args.model]
    ctx = args.prompt_len + args.new_tokens + 1
    if ctx > cfg.max_position_embeddings:
        ap.error(f"--prompt-len + --new-tokens + 1 = {ctx} is past {args.model}'s max_position_embeddings "
                 f"({cfg.max_position_embeddings})")
    try:
        import torch
        import transformers
    except ImportError as e:
        ap.error(f"needs torch and transformers (not project dependencies): {e}")
    if int(transformers.__version__.split(".")[0]) < 5:
        ap.error(f"needs transformers >= 5 (its cache and rope_parameters API), found {transformers.__version__}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device (--dry-run runs the tiny preset on CPU)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import transformers

    cfg = PRESETS[args.model]
    env = environment(args)
    out = pathlib.Path(args.out or f"benchmarks/results/hf_decode_{args.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    model = build_model(cfg, args.device, args.dtype, args.attn_implementation)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{args.model}: {n_params / 1e6:,.1f}M parameters in {args.dtype} on {env['device']} "
          f"(torch {torch.__version__}, transformers {transformers.__version__}), built in "
          f"{time.perf_counter() - t:.1f} s", flush=True)
    runs, failed = [], []
    for mode in args.modes:
        try:
            runs.append({**run_one_mode(model, cfg, args, mode), "parameters": n_params, **env})
        except Exception as e:  # noqa: BLE001 - one failing mode (a compile error) keeps the others
            if len(args.modes) == 1:
                raise
            failed.append({"model": args.model, "mode": mode, "error": f"{type(e).__name__}: {str(e)[:2000]}", **env})
            print(f"{mode} FAILED: {failed[-1]['error'][:500]}", flush=True)
        out.write_text(json.dumps(runs + failed, indent=2))
    print(f"{'model':10} {'batch':>5} {'mode':>16} {'tok/s':>10} {'step ms':>8} {'prefill s':>9} {'warm-up s':>9}")
    for r in runs:
        print(f"{r['model']:10} {r['batch']:5d} {r['mode']:>16} {r['decode_tokens_per_s']:10.0f} "
              f"{r['decode_step_ms_median']:8.2f} {r['prefill_seconds']:9.3f} {r['warmup_seconds']:9.1f}")
    print(f"HF transformers {transformers.__version__}, torch {torch.__version__}; wrote {out}")
    return 0 if runs else 1


def run_one_mode(model, cfg, args, mode):
    """run_mode, then the device's memory counters reset so each mode's peak is its own."""
    import torch
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    try:
        return run_mode(model, cfg, args, mode)
    finally:
        if mode == "static-compiled":
            torch._dynamo.reset()      # the next mode runs eager, untouched by this one's graphs
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
