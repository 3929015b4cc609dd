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
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.accelerator)


@pytest.fixture(autouse=True)
def needs_an_accelerator():
    """Skips on the CPU backend (checked when a test starts: collection starts no backend)."""
    if jax.default_backend() == "cpu" and not ON_CPU_ANYWAY:
        pytest.skip("needs an accelerator (JAX's default backend is the CPU)")
