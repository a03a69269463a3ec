"""Benchmarks behind `unisleep bench`: each prints a side-by-side table and writes JSON."""
