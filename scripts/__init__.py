"""The repository's scripts: benchmarks and studies (`scripts.bench`, run with ``python -m scripts.bench.NAME`` from
the repository root) and a few maintenance files. Not installed with the package."""
