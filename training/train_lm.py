"""Trains the embedded `pydoc-2m` language model: a Llama-shaped decoder on the Python documentation.

The model is stratum_jax.model.llama's Decoder with its parameter layout, run through the same dense
attention path (`attend_dense_causal`) in bfloat16, the dtype the runtime serves it in; float32 master
weights are kept by the optimizer (AdamW, warm-up + cosine decay, global-norm clipping). Windows of
`--seq-len` + 1 tokens are drawn at random offsets of the training ids on the device. Every
`--eval-every` steps the held-out split is scored (non-overlapping windows, bf16 weights); the best of
those evaluations is exported as an HF directory (training/lm_export.py) and kept as an orbax checkpoint.

Data comes from training/lm_corpus.py (train.npy, val.npy, tokenizer files). The run that produced
stratum_jax/model/weights/pydoc-2m (one H200, jax 0.11.2: 61.8 s of training, 69 s for the whole
process after imports; benchmarks/results/pydoc_2m_train.json; its best held-out step was 1700):

    python -m training.lm_corpus --sources pydoc/usr/share/doc/python3.11/html/_sources --out runs/lm-data
    python -m training.train_lm --data runs/lm-data --out runs/pydoc-2m --steps 2500 --weight-decay 0.3 \
        --eval-every 100 --seed 0

`--steps auto` times 10 steps first and picks the step count that fits `--time-budget-s` (at most
`--max-steps`); the results JSON records the count, so a rerun with `--steps N` repeats it.
Outputs under --out: export/ (the HF directory), ckpt/ (orbax), results.json, loss.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stratum_jax.model.config import ModelConfig
from stratum_jax.model.llama import attend_dense_causal, compute_logits, forward, init_kv_cache, init_params
from training.lm_corpus import BOS, END, EOS, PAD, SPECIAL_TOKENS
from training.lm_export import export_hf

BOS_ID, EOS_ID, PAD_ID, END_ID = (SPECIAL_TOKENS.index(t) for t in (BOS, EOS, PAD, END))


def model_config(args) -> ModelConfig:
    """The served shape: bf16, head_dim 64 (the Pallas kernels' size), tied embeddings."""
    if args.hidden % 64:
        raise SystemExit(f"--hidden must be a multiple of head_dim 64, got {args.hidden}")
    return ModelConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_layers=args.layers, num_heads=args.hidden // 64, num_kv_heads=args.kv_heads, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
        max_position_embeddings=args.seq_len, dtype="bfloat16", bos_token_id=BOS_ID,
        eos_token_ids=(EOS_ID, END_ID))


def sequence_logits(params, cfg: ModelConfig, ids: jax.Array) -> jax.Array:
    """ids [L] int32, one sequence from position 0 -> float32 logits [L, vocab] (the runtime's math)."""
    positions = jnp.arange(ids.shape[0], dtype=jnp.int32)

    def attend(layer, q, k_pool, v_pool):
        return attend_dense_causal(q, k_pool, v_pool, positions)

    hidden, _ = forward(params, cfg, ids, positions, init_kv_cache(cfg, ids.shape[0]), positions, attend)
    return compute_logits(params, cfg, hidden)


def batch_nll(params32, cfg: ModelConfig, windows: jax.Array) -> jax.Array:
    """windows [B, L+1] int32 -> per-token negative log-likelihood [B, L] (float32), weights cast to cfg.dtype."""
    params = jax.tree.map(lambda p: p.astype(cfg.dtype), params32)
    logits = jax.vmap(lambda w: sequence_logits(params, cfg, w[:-1]))(windows)
    return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:])


def sample_windows(key, data: jax.Array, batch: int, seq_len: int) -> jax.Array:
    """data [N] int32 on device -> [batch, seq_len + 1] windows at uniform random offsets."""
    offsets = jax.random.randint(key, (batch,), 0, data.shape[0] - seq_len - 1)
    return jax.vmap(lambda o: jax.lax.dynamic_slice(data, (o,), (seq_len + 1,)))(offsets)


def eval_windows(ids: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping [n, seq_len + 1] windows (each shares its last token with the next one's first)."""
    n = (ids.size - 1) // seq_len
    if n == 0:
        raise SystemExit(f"the held-out split has {ids.size} tokens, fewer than --seq-len + 1")
    return np.stack([ids[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)]).astype(np.int32)


def make_optimizer(args, steps: int):
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(args.warmup, steps // 10 + 1), steps,
                                                  end_value=args.lr * 0.05)
    # No weight decay on the RMSNorm weights (the only 1-D parameters).
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay, mask=decay_mask))


def build_steps(cfg: ModelConfig, opt, train_data: jax.Array, batch: int, seq_len: int):
    def loss_fn(params, key):
        return batch_nll(params, cfg, sample_windows(key, train_data, batch, seq_len)).mean()

    @jax.jit
    def train_step(params, opt_state, key):
        loss, grads = jax.value_and_grad(loss_fn)(params, key)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def eval_sum(params, windows):
        return batch_nll(params, cfg, windows).sum()

    return train_step, eval_sum


def evaluate(eval_sum, params, windows: np.ndarray, batch: int) -> float:
    """Mean held-out NLL per token (nats) over all windows."""
    total = 0.0
    for i in range(0, len(windows), batch):
        chunk = windows[i:i + batch]
        pad = batch - len(chunk)  # padded rows repeat row 0 and are subtracted out below
        full = np.concatenate([chunk, np.repeat(chunk[:1], pad, axis=0)]) if pad else chunk
        s = float(eval_sum(params, jnp.asarray(full)))
        if pad:
            s -= pad * float(eval_sum(params, jnp.asarray(np.repeat(chunk[:1], batch, axis=0)))) / batch
        total += s
    return total / (len(windows) * (windows.shape[1] - 1))


def plot(history: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*history["train"]), label="train (batch mean)", lw=0.8)
    ax.plot(*zip(*history["val"]), "o-", label="held-out", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="training/lm_corpus.py output folder")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", default="auto", help="optimizer steps, or 'auto' (see --time-budget-s)")
    ap.add_argument("--time-budget-s", type=float, default=240.0, help="training time that --steps auto fills")
    ap.add_argument("--max-steps", type=int, default=6000, help="upper bound for --steps auto")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=352)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--kv-heads", type=int, default=2)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    from tqdm import tqdm
    import orbax.checkpoint as ocp

    args = parse_args(argv)
    t_start = time.perf_counter()
    cfg = model_config(args)
    tok_cfg = json.loads((args.data / "tokenizer_config.json").read_text())
    train_ids, val_ids = np.load(args.data / "train.npy"), np.load(args.data / "val.npy")
    if int(train_ids.max()) >= cfg.vocab_size:
        raise SystemExit(f"train.npy has token id {int(train_ids.max())} >= --vocab {cfg.vocab_size}")
    train_data = jnp.asarray(train_ids.astype(np.int32))
    val_windows = eval_windows(val_ids, args.seq_len)
    master = dataclasses.replace(cfg, dtype="float32")

    def fresh_state(steps):
        params = init_params(master, args.seed)
        opt = make_optimizer(args, steps)
        return params, opt, opt.init(params)

    steps = args.steps
    if steps == "auto":  # time 10 compiled steps on a throwaway state, then size the run
        params, opt, opt_state = fresh_state(1000)
        train_step, _ = build_steps(cfg, opt, train_data, args.batch, args.seq_len)
        key = jax.random.key(args.seed + 1)
        params, opt_state, loss = train_step(params, opt_state, key)
        loss.block_until_ready()
        t0 = time.perf_counter()
        for i in range(10):
            params, opt_state, loss = train_step(params, opt_state, jax.random.fold_in(key, i))
        loss.block_until_ready()
        per_step = (time.perf_counter() - t0) / 10
        steps = max(10, min(args.max_steps, int(args.time_budget_s / per_step)))
        print(f"[train_lm] {per_step * 1e3:.1f} ms/step -> --steps {steps}", file=sys.stderr)
    steps = int(steps)

    params, opt, opt_state = fresh_state(steps)
    train_step, eval_sum = build_steps(cfg, opt, train_data, args.batch, args.seq_len)
    ckpt_dir = (args.out / "ckpt").resolve()
    mngr = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(
        max_to_keep=1, best_fn=lambda m: m["val_loss"], best_mode="min"))

    history = {"train": [], "val": []}
    best = (math.inf, 0, params)
    key = jax.random.key(args.seed)
    pending = []  # (step, loss array): read back in groups so the host never waits on each step
    t_train = time.perf_counter()
    bar = tqdm(range(1, steps + 1), desc="train_lm", mininterval=10, file=sys.stderr)
    for step in bar:
        params, opt_state, loss = train_step(params, opt_state, jax.random.fold_in(key, step))
        pending.append((step, loss))
        if step % 50 == 0 or step == steps:
            history["train"] += [(s, float(v)) for s, v in pending]
            pending = []
            bar.set_postfix(loss=f"{history['train'][-1][1]:.3f}")
        if step % args.eval_every == 0 or step == steps:
            val = evaluate(eval_sum, params, val_windows, args.batch)
            history["val"].append((step, val))
            mngr.save(step, args=ocp.args.StandardSave(params), metrics={"val_loss": val})
            if val < best[0]:
                best = (val, step, params)
            tqdm.write(f"[train_lm] step {step}: held-out loss {val:.4f} (ppl {math.exp(val):.2f})", file=sys.stderr)
    jax.block_until_ready(params)
    train_s = time.perf_counter() - t_train
    mngr.wait_until_finished()

    best_val, best_step, best_params = best
    args.out.mkdir(parents=True, exist_ok=True)
    export = export_hf(best_params, cfg, args.data, args.out / "export", bos_id=BOS_ID, eos_ids=[EOS_ID, END_ID],
                       pad_id=PAD_ID)
    corpus = json.loads((args.data / "corpus.json").read_text()) if (args.data / "corpus.json").is_file() else {}
    corpus.pop("val_file_names", None)
    results = {
        "what": "pydoc-2m: Llama-shaped decoder trained on the Python 3.11 documentation sources",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
        "jax_version": jax.__version__,
        "command": "python -m training.train_lm " + " ".join(argv if argv is not None else sys.argv[1:]),
        "resolved_steps": steps,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)},
        "num_params": cfg.num_params,
        "safetensors_bytes": (export / "model.safetensors").stat().st_size,
        "tokens_seen": steps * args.batch * args.seq_len,
        "epochs": steps * args.batch * args.seq_len / max(1, train_ids.size),
        "train_seconds": train_s, "total_seconds": time.perf_counter() - t_start,
        "best_step": best_step, "held_out_loss": best_val, "held_out_ppl": math.exp(best_val),
        "held_out_tokens_scored": int(val_windows.shape[0] * args.seq_len),
        "held_out_bits_per_byte": (best_val / math.log(2) * val_windows.shape[0] * args.seq_len
                                   / corpus["val_bytes"] * corpus["val_tokens"] / (val_windows.shape[0] * args.seq_len)
                                   if corpus.get("val_bytes") else None),
        "final_held_out_loss": history["val"][-1][1],
        "corpus": corpus, "tokenizer_chat_template": tok_cfg.get("chat_template"),
        "history": history,
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(history, args.out / "loss.png", f"pydoc-2m ({cfg.num_params / 1e6:.2f}M params), {steps} steps")
    print(json.dumps({k: results[k] for k in ("num_params", "resolved_steps", "train_seconds", "best_step",
                                              "held_out_loss", "held_out_ppl", "safetensors_bytes")}, indent=1))
    return results


if __name__ == "__main__":
    main()
