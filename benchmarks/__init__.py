"""Benchmarks of attention_dispatch against the anchor kernels (see bench.py, overhead.py)."""
