"""DKVC's anchor: per layer and KV head, from a warm-up text run through the model at start-up.

Two candidates, fitted on half of the warm-up windows and measured on the other half:
  - "mean": anchor_len 1, the mean K/V over every fitted position;
  - "aligned": anchor_len ALIGNED_LEN (a multiple of 256), position-aligned blocks: anchor[p] = the mean
    K/V at positions p (mod ALIGNED_LEN) over the fitted windows.
Each held-out window spans 2 x ALIGNED_LEN positions, so the measurement sees the aligned anchor wrap
around (position t reads anchor[t % anchor_len], and RoPE makes K at t differ from K at t % anchor_len).
The one whose deltas are smaller (root mean square over layers, heads, K and V, held-out positions) is
chosen, and both figures are logged.

For fp8 deltas it also gives each layer/head its scale floor (stratum_jax/kv/delta_cache.py): the
FLOOR_QUANTILE quantile of the per-token max |delta| over the held-out positions, / 448.

The warm-up text is the docstrings of a fixed list of standard-library modules: English prose that every
Python install has, so no data file ships with the package, and not the pydoc-2m model's training text
(the reST sources of the Python documentation) nor the quality study's held-out prompts.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from stratum_jax.kv.delta_cache import FP8_MAX
from stratum_jax.model import llama

log = logging.getLogger(__name__)

ALIGNED_LEN = 256                      # the position-aligned candidate's anchor_len
WARMUP_WINDOWS = 8                     # half fit the anchors, half measure them
FLOOR_QUANTILE = 0.99
WARMUP_MODULES = ("argparse", "collections", "dataclasses", "functools", "itertools", "json", "logging",
                  "pathlib", "re", "string", "subprocess", "textwrap", "threading", "contextlib", "unittest")


@dataclasses.dataclass(frozen=True)
class AnchorChoice:
    """kind: "mean" or "aligned"; anchors: per layer (anchor_k, anchor_v) [Hkv, anchor_len, D] in the model
    dtype; floors: per layer (k_floor, v_floor) [Hkv] float32; rms: {"mean", "aligned", "kv"}: held-out
    root mean square of the deltas under each candidate, and of K/V themselves (a plain fp8 cache's
    "delta" from a zero anchor); zero_floors: the floors the same rule gives a zero anchor (plain fp8 KV,
    the quality study's comparison); max_floors: per layer (k, v) [Hkv] the largest per-token max |delta| of
    the held-out windows / 448 (a per-head scale that no warm-up token would have saturated: the quality
    study's "fp8-delta, per-head scale" variant)."""

    kind: str
    anchors: list
    floors: list
    rms: dict
    zero_floors: list
    max_floors: list


def warmup_text() -> str:
    """The docstrings (module, then its public classes and functions) of WARMUP_MODULES, joined."""
    parts = []
    for name in WARMUP_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if not attr.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj)):
                parts.append(inspect.getdoc(obj) or "")
    return "\n\n".join(p for p in parts if p)


def warmup_windows(tokenizer, windows: int = WARMUP_WINDOWS, length: int = 2 * ALIGNED_LEN) -> np.ndarray:
    """[windows, length] int32 token ids: consecutive pieces of the warm-up text, each opened by BOS (as a
    request's prompt is) when the tokenizer has one."""
    ids = tokenizer.encode(warmup_text(), add_bos=False)
    bos = tokenizer.bos_token_id
    body = length - (bos is not None)
    if len(ids) < windows * body:
        raise ValueError(f"the warm-up text has {len(ids)} tokens, {windows} windows of {body} need more")
    out = np.array([ids[i * body:(i + 1) * body] for i in range(windows)], np.int32)
    if bos is not None:
        out = np.concatenate([np.full((windows, 1), bos, np.int32), out], axis=1)
    return out


@functools.partial(jax.jit, static_argnames=("cfg",))
def _window_kv(params, token_ids, *, cfg):
    """token_ids [W] -> per layer (k, v) [Hkv, W, D]: the K/V the model writes for one window."""
    n = token_ids.shape[0]
    positions = jnp.arange(n, dtype=jnp.int32)
    shape = (cfg.num_kv_heads, n, cfg.head_dim)
    cache = [(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype)) for _ in range(cfg.num_layers)]
    _, cache = llama.forward(params, cfg, token_ids, positions, cache, positions,
                             lambda layer, q, k, v: llama.attend_dense_causal(q, k, v, positions))
    return cache


def fit_anchor(params, cfg, windows: np.ndarray) -> AnchorChoice:
    """Fits both candidates on windows[:half], measures them on windows[half:] ([S, 2 * ALIGNED_LEN] ids),
    and picks the one with the smaller held-out delta RMS."""
    start = time.perf_counter()
    per_window = [jax.device_get(_window_kv(params, jnp.asarray(w), cfg=cfg)) for w in windows]
    # [layers, 2 (k, v), S, Hkv, W, D] float32
    kv = np.stack([np.stack([np.stack([np.asarray(x, np.float32) for x in layer]) for layer in w])
                   for w in per_window], axis=2)
    choice = choose_anchor(kv, cfg.dtype)
    log.info("DKVC anchor: %s (anchor_len %d) chosen from a warm-up run of %d windows x %d tokens in %.2f s; "
             "held-out delta RMS: mean anchor %.4f, position-aligned (%d) %.4f, no anchor (|K/V|) %.4f",
             choice.kind, choice.anchors[0][0].shape[1], windows.shape[0], windows.shape[1],
             time.perf_counter() - start, choice.rms["mean"], ALIGNED_LEN, choice.rms["aligned"], choice.rms["kv"])
    return choice


def choose_anchor(kv: np.ndarray, dtype) -> AnchorChoice:
    """kv [layers, 2 (K, V), S windows, Hkv, W positions, D] float32, W a multiple of ALIGNED_LEN: fits both
    candidates on windows[:S // 2], measures on the rest, returns the choice (anchors in `dtype`)."""
    half = kv.shape[2] // 2
    fit, held = kv[:, :, :half], kv[:, :, half:]
    mean = fit.mean(axis=(2, 4), keepdims=True)[:, :, 0]                          # [L, 2, Hkv, 1, D]
    aligned = fit[..., :ALIGNED_LEN, :].mean(axis=2)                               # [L, 2, Hkv, A, D]
    w = held.shape[4]
    tiled = aligned[:, :, None, :, np.arange(w) % ALIGNED_LEN]                     # [L, 2, 1, Hkv, W, D]
    d_mean = held - mean[:, :, None]
    d_aligned = held - tiled
    rms = {"mean": float(np.sqrt(np.mean(d_mean ** 2))), "aligned": float(np.sqrt(np.mean(d_aligned ** 2))),
           "kv": float(np.sqrt(np.mean(held ** 2)))}
    kind = "aligned" if rms["aligned"] < rms["mean"] else "mean"
    chosen, deltas = (aligned, d_aligned) if kind == "aligned" else (mean, d_mean)
    anchors = [(jnp.asarray(chosen[i, 0], dtype), jnp.asarray(chosen[i, 1], dtype)) for i in range(kv.shape[0])]
    return AnchorChoice(kind, anchors, _floors(deltas), rms, _floors(held), _floors(deltas, quantile=1.0))


def _floors(deltas: np.ndarray, quantile: float = FLOOR_QUANTILE) -> list:
    """deltas [L, 2, S, Hkv, W, D] -> per layer (k_floor, v_floor) [Hkv] float32: the `quantile` quantile
    of the per-token max |delta| over windows and positions, / 448."""
    amax = np.abs(deltas).max(axis=-1).transpose(0, 1, 3, 2, 4)                    # [L, 2, Hkv, S, W]
    floors = np.quantile(amax.reshape(*amax.shape[:3], -1), quantile, axis=-1) / FP8_MAX
    return [(floors[i, 0].astype(np.float32), floors[i, 1].astype(np.float32)) for i in range(floors.shape[0])]
