"""Benchmarks a weight publish to the embedded reference server against one memcpy of the same bytes, in one run.

A publish is what a run does after each update (`learner.rl.run.Run`): the learner's parameters (here a randomly
initialised model on the default device) cast to the server's dtype on the device and copied to the host
(`learner.rl.trainer.host_arrays`), then `rollout_client.TetherEngine.publish` to a reference server process
(``python -m learner.serving``) on this host: pause, load, resume. Two transports, each against its own server:

- ``shared``: through a file in shared memory (`rollout_client.shared_weights`), what the embedded server uses;
- ``streamed``: rollout.v1 ``StreamWeights`` over gRPC, what a remote server gets.

The floor is one memcpy of the published bytes (numpy, between two preallocated buffers, best of 3), measured right
before each publish, so that each ratio holds under whatever load the machine has then; the steady figures are the
medians over the publishes after the first. Goals (issue 37): shared <= 5x the memcpy at
100m float32 on a CPU; <= 0.3 s at qwen2-0.5b bfloat16 on an H100/H200.

    python -m scripts.bench.publish [--model 100m] [--dtype float32] [--repeats 5] [--out bench_publish.json]
    python -m scripts.bench.publish --model qwen2-0.5b --dtype bfloat16    # on a GPU
"""

from __future__ import annotations

import argparse
import pathlib
import secrets
import statistics
import tempfile
import time

import numpy as np

from scripts.bench.common import write_json


class Memcpy:
    """One numpy copy of ``nbytes`` between two preallocated (and touched) buffers."""

    def __init__(self, nbytes: int):
        self.source, self.target = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)

    def seconds(self, repeats: int = 3) -> float:
        """The best of ``repeats`` copies."""
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            np.copyto(self.target, self.source)
            best = min(best, time.perf_counter() - started)
        return best


def launch_server(args, log_dir: pathlib.Path, shared: bool):
    """A reference server of ``args.model`` taking ``args.dtype`` weights, and a `TetherEngine` connected to it
    (publishing through shared memory when ``shared``)."""
    from rollout_client import ClientConfig, EngineProcess, TetherEngine
    from rollout_client.server.cli import AUTH_TOKEN_ENV
    from rollout_client.shared_weights import SharedWeightsFile, shared_memory_dir

    token = secrets.token_urlsafe(16)
    weights = SharedWeightsFile(shared_memory_dir()) if shared else None
    server_args = ["--model-config", args.model, "--dtype", args.dtype, "--weights-dtype", args.dtype,
                   "--max-batch-size", "1", "--max-seq-len", "64", "--decode-steps-per-call", "1"]
    if weights is not None:
        server_args += ["--weights-dir", str(weights.directory)]
    process = EngineProcess("learner.serving", server_args, log_dir / f"server_{'shared' if shared else 'streamed'}"
                            ".log", start_timeout_s=args.start_timeout_s, env={AUTH_TOKEN_ENV: token})
    return TetherEngine(ClientConfig(process.address, auth_token=token, control_deadline_s=600.0), process=process,
                        shared_weights=weights)


def time_publishes(engine, params, dtype: str, repeats: int, memcpy: Memcpy) -> list[tuple[float, float]]:
    """``(publish seconds, memcpy seconds)`` of versions 1..repeats, each publish (device cast and host copy
    included) right after its memcpy, so that the pair shares the machine's load."""
    from learner.rl.trainer import host_arrays

    pairs = []
    for version in range(1, repeats + 1):
        floor = memcpy.seconds()
        started = time.perf_counter()
        engine.publish(version, host_arrays(params, dtype))
        pairs.append((time.perf_counter() - started, floor))
    return pairs


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.publish", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="100m", help="learner.model.model_config name")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the server's dtype")
    parser.add_argument("--repeats", type=int, default=5, help="publishes per transport (the first is reported "
                                                                "apart: it maps the file and warms the copies)")
    parser.add_argument("--transports", default="shared,streamed")
    parser.add_argument("--start-timeout-s", type=float, default=600.0)
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args(argv)

    import jax
    from flax import nnx

    from learner.model import Transformer, count_params, model_config

    config = model_config(args.model)
    params = nnx.state(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param)
    nbytes = sum(leaf.size for leaf in jax.tree.leaves(params)) * np.dtype(args.dtype).itemsize
    memcpy = Memcpy(nbytes)
    floor = memcpy.seconds(5)
    result = {"model": args.model, "parameters": count_params(config), "dtype": args.dtype, "bytes": nbytes,
              "device": str(jax.devices()[0]), "memcpy_s": floor, "transports": {}}
    print(f"{args.model}: {count_params(config):,} parameters, {nbytes / 1e6:.0f} MB in {args.dtype} on "
          f"{jax.devices()[0]}; one memcpy {floor * 1e3:.1f} ms ({nbytes / floor / 1e9:.1f} GB/s)", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-publish-") as logs:
        for transport in args.transports.split(","):
            engine = launch_server(args, pathlib.Path(logs), shared=transport == "shared")
            try:
                pairs = time_publishes(engine, params, args.dtype, args.repeats, memcpy)
            finally:
                engine.close()
            steady = pairs[1:] or pairs
            seconds = statistics.median(publish for publish, _ in steady)
            ratio = statistics.median(publish / floor for publish, floor in steady)
            result["transports"][transport] = {"first_s": pairs[0][0], "steady_s": seconds, "steady_over_memcpy": ratio,
                                               "publish_and_memcpy_s": pairs}
            print(f"{transport:>8}: first {pairs[0][0] * 1e3:8.1f} ms, steady {seconds * 1e3:8.1f} ms = {ratio:5.1f}x "
                  f"the memcpy beside it ({nbytes / seconds / 1e9:.2f} GB/s)", flush=True)
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
