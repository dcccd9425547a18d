"""Schedulers that decide which requests run in the next engine step."""
