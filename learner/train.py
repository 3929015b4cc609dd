"""The main job: RL training of a policy against a separate inference engine, from one command.

    python -m learner.train --config configs/default.toml [--set section.field=value ...]

The loop itself is the library `learner.rl` (`Run`, its steps and hooks); this module parses the command line, sets
up JAX (CPU device count, collectives, the distributed system, the persistent compilation cache) and runs it.
Rerunning the same command resumes from the run directory's latest checkpoint; a run that already finished says so
and exits 0.

Compiled programs are cached on disk (`enable_compilation_cache`): a rerun, a resumed run or another run of the same
shapes loads them instead of compiling. ``JAX_COMPILATION_CACHE_DIR`` picks the directory (default
``~/.cache/tether/jax``, under ``XDG_CACHE_HOME`` when set); ``JAX_ENABLE_COMPILATION_CACHE=false`` turns it off.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax

from learner.distributed import initialize, process_index_before_backends
from learner.reporting.compiles import count_compiles, enable_compilation_cache
from learner.reporting.disk_full import quiet_disk_full_logs
from learner.rl import Run, RunConfig, load_config
from learner.rl.devices import configure_learner
from learner.rl.error_lines import drop_closed_loop_callbacks, errors_as_lines
from learner.rl.preflight import check_paths_and_names


def parse_args(argv=None) -> tuple[pathlib.Path | None, list[str]]:
    """The config path and the overrides (``--set`` plus the multi-host flags, as overrides)."""
    parser = argparse.ArgumentParser(prog="python -m learner.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=pathlib.Path, help="TOML run config (default: built-in defaults)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one config field (repeatable), e.g. --set loop.steps=50")
    parser.add_argument("--run-dir", help="same as --set run_dir=...")
    parser.add_argument("--coordinator", help="multi-host: host:port of process 0")
    parser.add_argument("--num-processes", type=int, help="multi-host: number of processes")
    parser.add_argument("--process-id", type=int, help="multi-host: this process's index")
    args = parser.parse_args(argv)
    overrides = list(args.set) + ([f"run_dir={json.dumps(args.run_dir)}"] if args.run_dir else [])
    for name in ("coordinator", "num_processes", "process_id"):
        if getattr(args, name) is not None:
            overrides.append(f"distributed.{name}={json.dumps(getattr(args, name))}")
    return args.config, overrides


def setup_jax(config: RunConfig) -> None:
    """CPU device count, CPU collectives and the distributed system: before any other JAX call."""
    if config.mesh.cpu_devices:
        jax.config.update("jax_num_cpu_devices", config.mesh.cpu_devices)
    if (config.distributed.num_processes or 1) > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    initialize(config.distributed.coordinator, config.distributed.num_processes, config.distributed.process_id)


def main(argv=None) -> None:
    config_path, overrides = parse_args(argv)
    if config_path is not None and not config_path.is_file():
        sys.exit(f"error: --config {config_path}: no such file")
    with errors_as_lines(ValueError):
        config = load_config(config_path, overrides)
        check_paths_and_names(config)
    enable_compilation_cache()
    count_compiles()
    quiet_disk_full_logs()  # orbax's threads and tasks: reported once, below
    sys.unraisablehook = drop_closed_loop_callbacks
    setup_jax(config)
    # The memory budget and visible GPUs: before JAX starts its backends, once the process index is known.
    with errors_as_lines(ValueError):
        configure_learner(config, process_index=process_index_before_backends())
    with errors_as_lines(run_dir=config.run_dir):
        with Run(config) as run:
            run.train()


if __name__ == "__main__":
    main()
