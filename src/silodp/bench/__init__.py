"""Benchmarks printed as ratios measured side by side in one run (``silodp bench ...``)."""
