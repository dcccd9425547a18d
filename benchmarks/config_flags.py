"""`--configs` flags of the kernel benchmarks: a list of a kernel's frozen TuningConfig with some fields
overridden, written 'default;block_kv=128;num_stages=3,num_splits=2'. Shared by kernels.py and decode_gemm.py
(imported by its bare name, from beside them)."""
from __future__ import annotations

import dataclasses

_LITERALS = {"True": True, "False": False, "None": None}


def parse_overrides(spec: str, default) -> list:
    """';'-separated items, each 'default' or comma-separated field=value overrides of `default` (a dataclass
    instance); values are ints, True, False or None. SystemExit says what to fix: an unknown field, a value of
    another kind, or a value the config itself refuses (its __post_init__)."""
    fields = [f.name for f in dataclasses.fields(default)]
    out = []
    for item in spec.split(";"):
        kw = {}
        for pair in filter(None, item.strip().split(",")):
            if pair == "default":
                continue
            name, _, value = pair.partition("=")
            if name not in fields or not value:
                raise SystemExit(f"--configs: {pair!r} is not field=value with a {type(default).__name__} field "
                                 f"({', '.join(fields)})")
            if value in _LITERALS:
                kw[name] = _LITERALS[value]
                continue
            try:
                kw[name] = int(value)
            except ValueError:
                raise SystemExit(f"--configs: {pair!r}: the value must be an int, True, False or None") from None
        try:
            out.append(dataclasses.replace(default, **kw))
        except ValueError as e:
            raise SystemExit(f"--configs: {item!r}: {e}") from None
    return out
