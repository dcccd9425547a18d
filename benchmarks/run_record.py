"""What every saved benchmark result starts with, and how it is written.

A figure in BENCHMARKS.md cites a JSON file under benchmarks/results/, and that file is the only record of the run:
it has to say which benchmark made it, on which device, with which jax, on which day and from which command line.
`provenance` gives those fields (a script adds its own after them) and `save_json` writes the result, creating the
folder. The scripts import this module by its bare name (it lies beside them). It imports jax only when asked
for the device, as some scripts defer jax until they have parsed their flags.
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import sys


def device_name() -> str:
    """The first jax device's kind ("NVIDIA H200"), or "cpu (N cores)" on the CPU backend, where the core count is
    what a timing depends on."""
    import jax

    device = jax.devices()[0]
    return f"cpu ({os.cpu_count()} cores)" if device.platform == "cpu" else device.device_kind


def provenance(benchmark: str, device: str | None = None) -> dict:
    """{benchmark, device, jax, date, command}; `device` defaults to `device_name()`."""
    import jax

    return dict(benchmark=benchmark, device=device_name() if device is None else device, jax=jax.__version__,
                date=datetime.date.today().isoformat(), command=" ".join(sys.argv))


def save_json(path: str | pathlib.Path, doc, *, indent: int | None = 1) -> pathlib.Path:
    """Writes `doc` as JSON (newline-terminated) to `path`, creating its folder; returns the path."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=indent) + "\n")
    return path
