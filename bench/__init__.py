"""Benchmarks: one script per area, each writing bench/results/<area>-<gpu>.json."""
