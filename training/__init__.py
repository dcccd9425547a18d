"""Trace formats, the cache simulator that makes labels, the offline DMLP trainer and online fine-tuning."""
