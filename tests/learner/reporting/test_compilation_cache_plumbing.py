"""`enable_compilation_cache`'s plumbing, checked on the CPU (XLA's GPU autotuning itself needs a GPU: what is checked
here is that the option reaching XLA's compiler names the directory beside the cached programs, and that every
program, however quick to compile, is cached). A fresh subprocess: JAX's cache is set up once per process."""

import json
import os
import pathlib
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]

PROBE = """
import json, jax
from jax._src import compiler
from learner.reporting.compiles import compile_stats, count_compiles, enable_compilation_cache
directory = enable_compilation_cache()
count_compiles()
jax.jit(lambda x: x * 2 + 1)(jax.numpy.arange(3.0)).block_until_ready()  # compiles in milliseconds
options = compiler.get_compile_options(num_replicas=1, num_partitions=1)  # kept alive: its debug options live in it
autotune_dir = str(options.executable_build_options.debug_options.xla_gpu_per_fusion_autotune_cache_dir)
print(json.dumps({"directory": str(directory), "stats": compile_stats(), "autotune_dir": autotune_dir}))
"""


def probe(tmp_path, **environment):
    env = {key: value for key, value in os.environ.items() if not key.startswith("JAX_PERSISTENT_CACHE")}
    env |= {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax"), "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])} | environment
    result = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600,
                            check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def cached_programs(directory: pathlib.Path) -> list[pathlib.Path]:
    return [path for path in directory.iterdir() if path.is_file() and path.name.startswith("jit_")]


def test_cpu_plumbing_autotune_results_go_beside_the_cache_and_every_program_is_cached(tmp_path):
    report = probe(tmp_path)
    assert report["directory"] == str(tmp_path / "jax")
    assert report["autotune_dir"] == str(tmp_path / "jax" / "xla_gpu_per_fusion_autotune_cache_dir")
    assert len(cached_programs(tmp_path / "jax")) >= 1  # JAX's default (>= 1 s of compile) would cache none
    assert report["stats"]["compile/trace_seconds"] > 0 and report["stats"]["compile/lower_seconds"] > 0
    again = probe(tmp_path)  # a second process loads the program instead of compiling it
    assert again["stats"]["compile/cache_hits"] >= 1


def test_cpu_plumbing_the_environment_overrides_both_settings(tmp_path):
    report = probe(tmp_path, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="1000",
                   JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES="none")
    assert report["autotune_dir"] == ""
    assert cached_programs(tmp_path / "jax") == []
