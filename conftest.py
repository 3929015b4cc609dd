"""Root conftest: doctests in the packages see the same 8-device CPU backend as tests/."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
