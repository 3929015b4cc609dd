"""Benchmarks and studies, each run with ``python -m scripts.bench.NAME`` from the repository root (``--help`` says
what it measures); `scripts.bench.common` holds what they share. docs/benchmarks.md has the results."""
