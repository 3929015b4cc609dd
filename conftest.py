"""Root conftest: doctests in the packages see the same 8-device CPU backend as tests/, and the whole test run
shares one JAX persistent compilation cache."""

import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests compile the same programs (the tiny model's update under several tests, the main job's programs in
# every `python -m learner.train` subprocess): with one cache per test run, made by the first process (pytest, or
# xdist's controller) and inherited through the environment by the xdist workers and every subprocess, each
# compiles once. A size limit turns on JAX's file lock, so that concurrent writers and readers never see a partial
# entry. A cache directory set beforehand is used as it is and kept.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="tether-tests-jax-cache-")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
# XLA:CPU with LLVM at -O0, in this process and every subprocess: the tests' programs are tiny and take far longer
# to compile than to run (tests/learner/update/test_update.py + logprobs/test_sampling_transform.py: 142 s -> 99 s on
# 2 cores).
# Users' runs keep XLA's default level; the tests compare to tolerances where code generation may round differently.
_FAST_COMPILE = "--xla_backend_optimization_level=0"
if _FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_sessionfinish(session):
    """The run's cache goes with the run (xdist's controller ends its session after every worker's)."""
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
