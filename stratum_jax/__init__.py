"""The runtime: everything a decode step needs (model, KV cache, scheduler, engine), no network code."""

__version__ = "0.1.0"
