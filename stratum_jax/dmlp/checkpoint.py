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
    path = os.path.abspath(path)
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
    meta_path = os.path.join(path, "meta.json")
    try:
        with open(meta_path) as fh:
            meta = json.load(fh)
    except FileNotFoundError:
        raise CheckpointError(f"{meta_path}: missing; {path} is not a DMLP checkpoint") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_path}:{e.lineno}: not valid JSON ({e.msg})") from None
    try:
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise CheckpointError(f"{meta_path}: format {meta.get('format')!r} version "
                                  f"{meta.get('version')!r}, expected {FORMAT!r} version {VERSION}")
        if meta["feature_names"] != list(FEATURE_NAMES):
            raise CheckpointError(f"{meta_path}: trained on features {meta['feature_names']}, this code "
                                  f"has {list(FEATURE_NAMES)}; retrain")
        config = DmlpConfig(num_inputs=int(meta["num_inputs"]),
                            horizons_ms=tuple(float(h) for h in meta["horizons_ms"]),
                            hidden=tuple(int(w) for w in meta["hidden"]))
        normalizer = Normalizer.from_dict(meta["normalizer"])
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{meta_path}: malformed metadata ({e!r})") from None
    params_path = os.path.join(os.path.abspath(path), "params")
    target = jax.device_get(init_params(config, 0))
    try:
        params = ocp.StandardCheckpointer().restore(params_path, target)
    except Exception as e:   # orbax raises several types; all mean the same thing here
        raise CheckpointError(f"{params_path}: cannot restore parameters ({type(e).__name__}: {e})") from None
    for (kp, want), got in zip(jax.tree_util.tree_leaves_with_path(target), jax.tree_util.tree_leaves(params)):
        if np.shape(got) != np.shape(want):
            raise CheckpointError(f"{params_path}: {jax.tree_util.keystr(kp)} has shape {np.shape(got)}, "
                                  f"{meta_path} implies {np.shape(want)}")
    return DmlpCheckpoint(config=config, params=params, normalizer=normalizer, extra=meta.get("extra", {}))
