"""DMLP checkpoints: orbax-saved params plus `meta.json` (features, horizons, widths, normalizer).

Writes are atomic: everything goes to a temporary sibling directory, which is renamed into place only
when complete, so a crash never leaves a half-written checkpoint under the final name. Overwriting
moves the old checkpoint aside first (a crash between the two renames leaves it complete at
`<path>.old-*`). Loading validates the metadata and the parameter shapes and names the file at fault.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid

import jax
import numpy as np
import orbax.checkpoint as ocp

from stratum_jax.dmlp.features import FEATURE_NAMES, Normalizer
from stratum_jax.dmlp.model import DmlpConfig, init_params

FORMAT = "stratum-dmlp"
VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file."""


@dataclasses.dataclass
class DmlpCheckpoint:
    config: DmlpConfig
    params: dict
    normalizer: Normalizer
    extra: dict   # free-form provenance (time scale, seed, trace names, ...)


def save_checkpoint(path: str, ckpt: DmlpCheckpoint) -> None:
    """Raises CheckpointError, writing nothing, when `path` exists but is neither an empty directory nor a
    DMLP checkpoint: replacing it would delete whatever it holds."""
    path = os.path.abspath(path)
    if os.path.lexists(path) and not (os.path.isdir(path) and not os.path.islink(path) and (
            not os.listdir(path) or os.path.isfile(os.path.join(path, "meta.json")))):
        raise CheckpointError(f"{path}: exists and is not a DMLP checkpoint, so it would be lost; move it "
                              "away or choose another path")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(os.path.join(tmp, "params"), jax.device_get(ckpt.params))
        checkpointer.wait_until_finished()
        meta = {
            "format": FORMAT, "version": VERSION, "feature_names": list(FEATURE_NAMES),
            "num_inputs": ckpt.config.num_inputs, "horizons_ms": list(ckpt.config.horizons_ms),
            "hidden": list(ckpt.config.hidden), "normalizer": ckpt.normalizer.to_dict(), "extra": ckpt.extra,
        }
        with open(os.path.join(tmp, "meta.json"), "w") as fh:
            json.dump(meta, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        old = None
        if os.path.exists(path):
            old = f"{path}.old-{uuid.uuid4().hex[:8]}"
            os.rename(path, old)
        os.rename(tmp, path)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def latest_checkpoint(directory: str) -> str | None:
    """The newest `step-N` checkpoint under `directory` (as the online fine-tuner writes them), or None.
    Temporary directories of interrupted writes are hidden names and never match."""
    if not os.path.isdir(directory):
        return None
    steps = sorted(d for d in os.listdir(directory) if d.startswith("step-") and d[5:].isdigit())
    return os.path.join(directory, steps[-1]) if steps else None


def load_checkpoint(path: str) -> DmlpCheckpoint:
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path}: is a file; a DMLP checkpoint is a directory (train_dmlp --out DIR "
                              "writes DIR/checkpoint)")
    meta_path = os.path.join(path, "meta.json")
    try:
        with open(meta_path, encoding="utf-8") as fh:
            meta = json.load(fh)
    except FileNotFoundError:
        raise CheckpointError(f"{meta_path}: missing; {path} is not a DMLP checkpoint") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_path}:{e.lineno}: not valid JSON ({e.msg})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta_path}: cannot be read as JSON text ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_path}: must hold a JSON object, got {type(meta).__name__}")
    try:
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise CheckpointError(f"{meta_path}: format {meta.get('format')!r} version "
                                  f"{meta.get('version')!r}, expected {FORMAT!r} version {VERSION}")
        if meta["feature_names"] != list(FEATURE_NAMES):
            raise CheckpointError(f"{meta_path}: trained on features {meta['feature_names']}, this code "
                                  f"has {list(FEATURE_NAMES)}; retrain")
        # int() would read 24.9 as 24 and a "32" string as the widths (3, 2)
        if not _positive_int(meta["num_inputs"]):
            raise CheckpointError(f"{meta_path}: num_inputs must be a positive integer, got {meta['num_inputs']!r}")
        if not (isinstance(meta["hidden"], list) and all(map(_positive_int, meta["hidden"]))):
            raise CheckpointError(f"{meta_path}: hidden must be a list of positive integers, got {meta['hidden']!r}")
        if not (isinstance(meta["horizons_ms"], list) and all(
                isinstance(h, (int, float)) and not isinstance(h, bool) for h in meta["horizons_ms"])):
            raise CheckpointError(f"{meta_path}: horizons_ms must be a list of numbers, got {meta['horizons_ms']!r}")
        if not isinstance(meta.get("extra", {}), dict):
            raise CheckpointError(f"{meta_path}: extra must be an object, got {meta['extra']!r}")
        config = DmlpConfig(num_inputs=int(meta["num_inputs"]),
                            horizons_ms=tuple(float(h) for h in meta["horizons_ms"]),
                            hidden=tuple(int(w) for w in meta["hidden"]))
        normalizer = Normalizer.from_dict(meta["normalizer"])
        if not (np.isfinite(normalizer.mean).all() and np.isfinite(normalizer.std).all()
                and (normalizer.std > 0).all()):   # Normalizer.fit never writes these; predictions would be NaN
            raise CheckpointError(f"{meta_path}: normalizer has a mean that is not finite or a std that is not "
                                  "a positive finite number; restore this meta.json or retrain")
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{meta_path}: malformed metadata ({e!r})") from None
    params_path = os.path.join(os.path.abspath(path), "params")
    target = jax.device_get(init_params(config, 0))
    expected = {jax.tree_util.keystr(kp): np.shape(x) for kp, x in jax.tree_util.tree_leaves_with_path(target)}
    saved = _saved_shapes(params_path)
    if saved is not None and saved != expected:
        key = next(k for k in sorted(expected.keys() | saved.keys()) if expected.get(k) != saved.get(k))
        raise CheckpointError(f"{params_path}: {key} is {saved.get(key, 'absent')}, but {meta_path} (num_inputs, "
                              f"hidden, horizons_ms) implies {expected.get(key, 'no such parameter')}: the params and "
                              "meta.json are from different models; save them together again or retrain")
    try:
        params = ocp.StandardCheckpointer().restore(params_path, target)
    except Exception as e:   # orbax raises several types; all mean the same thing here
        detail = str(e).split(" [tensorstore_spec")[0]   # tensorstore appends kilobytes of its own spec
        raise CheckpointError(f"{params_path}: cannot restore parameters ({type(e).__name__}: {detail}); the "
                              "checkpoint is damaged or incomplete: save it again or retrain") from None
    for (kp, want), got in zip(jax.tree_util.tree_leaves_with_path(target), jax.tree_util.tree_leaves(params)):
        if np.shape(got) != np.shape(want):
            raise CheckpointError(f"{params_path}: {jax.tree_util.keystr(kp)} has shape {np.shape(got)}, "
                                  f"{meta_path} implies {np.shape(want)}")
    return DmlpCheckpoint(config=config, params=params, normalizer=normalizer, extra=meta.get("extra", {}))


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _saved_shapes(params_path: str) -> dict[str, tuple] | None:
    """The parameter shapes orbax recorded at save time ({keystr: shape}), or None when its metadata cannot
    be read (the restore then reports the problem)."""
    try:
        tree = ocp.StandardCheckpointer().metadata(params_path).item_metadata.tree
        return {jax.tree_util.keystr(kp): tuple(m.shape) for kp, m in
                jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))}
    except Exception:   # no or unreadable metadata: not an error by itself, the restore decides
        return None
