"""tests/accelerator/: checks that need a GPU or TPU (issue 28), run by scripts/gpu_check.sh.

Every test here is marked ``accelerator`` and skipped when JAX's default backend is the CPU, so CI's CPU run skips
them. ``TETHER_ACCELERATOR_TESTS_ON_CPU=1`` runs them on the CPU anyway (``scripts/gpu_check.sh --cpu``: a dry run of
everything but the accelerator itself).
"""

import os

import jax
import pytest

ON_CPU_ANYWAY = os.environ.get("TETHER_ACCELERATOR_TESTS_ON_CPU") == "1"


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason="needs an accelerator (JAX's default backend is the CPU)")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.accelerator)
            if jax.default_backend() == "cpu" and not ON_CPU_ANYWAY:
                item.add_marker(skip)
