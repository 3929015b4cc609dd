"""Benchmarks rollout.v1 transport, and the reference server's model decode speed.

Transport: a server process on 127.0.0.1 whose generation is replaced by a
precomputed stream (the scripted engine, 1024 tokens per step) and a client that
decodes every sample to numpy arrays (validated). Reports ns per token end to end,
for one request at a time and for 8 concurrent requests, samples/s, and the CPU time
per sample of the client and server processes (steadier than wall time when other
work shares the machine).

Floor: the same concurrency against a bare grpc.aio server process that answers
every Generate with one precomputed message of the same size, read by a bare stub:
what gRPC's per-call cost alone allows, measured under the same machine load.

smg transport: the same measurement through an smg engine proto (the MLX one, `rollout_client.engines.smg`): a server
process that streams precomputed tokens as the MLX servicer does (one message per token, with its logprob), read by
`AsyncSmgClient` (fan-out, every sample assembled and validated like rollout.v1's).

Engines end to end: the real MLX engine (`rollout_client.MlxEngine`, mlx-lm on the CPU) and Tether's reference server
(``python -m learner.serving --hf-path``) serving the same tiny checkpoint directory, 8 concurrent requests of 8
samples of ``--engine-tokens`` tokens each: samples/s and ns/token with the model's compute included. And the MLX
engine's publish (write a checkpoint directory, restart the engine on it) for the tiny and small models: seconds per
MB.

Decode: the model engine (default model "tiny", float32) in this process, decode
tokens/s with a full batch.

    python -m scripts.bench.rollout_transport [--tokens 1024] [--rounds 200] [--smg-rounds 10]
        [--engine-tokens 64] [--engine-rounds 10]
"""

import argparse
import asyncio
import contextlib
import os
import pathlib
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np
from smg_grpc_proto import mlx_engine_pb2, mlx_engine_pb2_grpc

from rollout_client import AsyncRolloutClient, ClientConfig, LogprobMode, RolloutRequest, SamplingParams
from rollout_client.protocol import CLIENT_OPTIONS, SERVER_OPTIONS, pb, pb_grpc
from scripts.bench.common import REPO_ROOT, checkout_env


@contextlib.contextmanager
def served(tokens: int, floor: bool = False, smg: bool = False) -> Iterator[tuple[int, str]]:
    """The reference server (scripted engine), or with `floor` this script's bare server, or with `smg` its scripted
    MLX-proto server, as a child process: its (pid, address), terminated on exit."""
    if floor or smg:
        argv = ["-m", "scripts.bench.rollout_transport", "--serve-floor" if floor else "--serve-smg", "--tokens",
                str(tokens)]
    else:
        argv = ["-m", "rollout_client.server", "--engine", "scripted", "--vocab-size", "32000",
                "--tokens-per-step", str(tokens), "--max-seq-len", str(4 * tokens), "--max-batch-size", "64"]
    process = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                               env=checkout_env())
    try:
        yield process.pid, re.search(r"listening on (\S+)", process.stdout.readline()).group(1)
    finally:
        process.terminate()
        process.wait(timeout=30)


async def serve_on_loopback(add_servicer: Callable[[grpc.aio.Server], None]) -> None:
    """A grpc.aio server with ``add_servicer``'s servicer on a free loopback port, announced on stdout (`served` reads
    the line), until terminated."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    add_servicer(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"listening on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc): steadier than wall time on a shared machine."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(one, server_pid: int, tokens: int, rounds: int, concurrency: int, samples_per_call: int) -> str:
    """Runs `rounds` of `concurrency` concurrent `one()` calls after a warm-up; the result as a line."""
    for _ in range(20):
        await one()
    client_cpu, server_cpu, start = time.process_time(), cpu_seconds(server_pid), time.perf_counter()
    for _ in range(rounds):
        await asyncio.gather(*(one() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    samples = rounds * concurrency * samples_per_call
    client_us = (time.process_time() - client_cpu) / samples * 1e6
    server_us = (cpu_seconds(server_pid) - server_cpu) / samples * 1e6
    return (f"{elapsed / (samples * tokens) * 1e9:.0f} ns/token end to end, {samples / elapsed:.0f} samples/s, "
            f"CPU per sample: client {client_us:.0f} us, server {server_us:.0f} us")


async def transport(target: str, server_pid: int, tokens: int, rounds: int, concurrency: int,
                    samples_per_request: int) -> str:
    """The rollout client against the reference server: every sample decoded and validated."""
    client = AsyncRolloutClient(ClientConfig(target=target))
    await client.connect()
    params = SamplingParams(max_new_tokens=tokens, stop_token_ids=(), seed=0)

    async def one():
        samples = await client.generate(RolloutRequest([1, 2, 3], params, num_samples=samples_per_request))
        assert sum(sample.completion_token_ids.size for sample in samples) == tokens * samples_per_request

    try:
        return await measure(one, server_pid, tokens, rounds, concurrency, samples_per_request)
    finally:
        await client.close()


async def serve_floor(tokens: int) -> None:
    """A Generate that yields one precomputed final message of `tokens` tokens, nothing else."""
    message = pb.GenerateResponse(final=pb.SampleResult(
        token_ids=bytes(4 * tokens), logprobs=bytes(4 * tokens), version_spans=[pb.VersionSpan(end=tokens)],
        finish_reason=pb.FINISH_REASON_LENGTH, completion_tokens=tokens))

    class FloorServicer(pb_grpc.RolloutServiceServicer):
        async def Generate(self, request, context):
            yield message

    await serve_on_loopback(lambda server: pb_grpc.add_RolloutServiceServicer_to_server(FloorServicer(), server))


async def floor_transport(target: str, server_pid: int, tokens: int, rounds: int, concurrency: int) -> str:
    """A bare stub against `serve_floor`: one message per call, nothing decoded."""
    channel = grpc.aio.insecure_channel(target, options=CLIENT_OPTIONS)
    stub = pb_grpc.RolloutServiceStub(channel)
    request = RolloutRequest([1, 2, 3], SamplingParams(max_new_tokens=tokens, seed=0)).to_proto()

    async def one():
        async for _ in stub.Generate(request, timeout=30):
            pass

    try:
        return await measure(one, server_pid, tokens, rounds, concurrency, 1)
    finally:
        await channel.close()


async def serve_smg(tokens: int) -> None:
    """The MLX proto's Generate as the MLX servicer streams it: one chunk per token (with its logprob), then an empty
    complete message; precomputed, so only the transport is measured."""
    chunks = [mlx_engine_pb2.GenerateResponse(chunk=mlx_engine_pb2.GenerateStreamChunk(
        token_ids=[7], completion_tokens=i + 1, output_logprobs=mlx_engine_pb2.OutputLogProbs(
            token_logprobs=[-1.0], token_ids=[7], top_logprobs=[mlx_engine_pb2.TopLogProbs(values=[-1.0],
                                                                                            token_ids=[7])])))
              for i in range(tokens)]
    complete = mlx_engine_pb2.GenerateResponse(complete=mlx_engine_pb2.GenerateComplete(
        finish_reason="length", completion_tokens=tokens))

    class ScriptedMlx(mlx_engine_pb2_grpc.MlxEngineServicer):
        async def Generate(self, request, context):
            for chunk in chunks:
                yield chunk
            yield complete

        async def HealthCheck(self, request, context):
            return mlx_engine_pb2.HealthCheckResponse(healthy=True)

        async def GetModelInfo(self, request, context):
            return mlx_engine_pb2.GetModelInfoResponse(vocab_size=32000, max_context_length=4 * tokens)

    await serve_on_loopback(lambda server: mlx_engine_pb2_grpc.add_MlxEngineServicer_to_server(ScriptedMlx(), server))


async def smg_transport(target: str, server_pid: int, tokens: int, rounds: int, concurrency: int,
                        samples_per_request: int) -> str:
    """`AsyncSmgClient` (MLX dialect) against `serve_smg`: fanned out, every sample decoded and validated."""
    from rollout_client.engines.smg import MLX, AsyncSmgClient

    client = AsyncSmgClient(ClientConfig(target=target), MLX)
    await client.connect()
    params = SamplingParams(max_new_tokens=tokens, stop_token_ids=(), seed=0)

    async def one():
        samples = await client.generate(RolloutRequest([1, 2, 3], params, num_samples=samples_per_request,
                                                       logprob_mode=LogprobMode.RAW))
        assert sum(sample.completion_token_ids.size for sample in samples) == tokens * samples_per_request

    try:
        return await measure(one, server_pid, tokens, rounds, concurrency, samples_per_request)
    finally:
        await client.close()


def engines_end_to_end(tokens: int, rounds: int, concurrency: int = 8, samples_per_request: int = 8) -> list[str]:
    """The real MLX engine and the reference server on the same tiny checkpoint: samples/s and ns/token."""
    import functools
    import tempfile

    from flax import nnx

    from learner.checkpoints.hf_checkpoint import write_hf_checkpoint
    from learner.model.param_paths import named_leaves
    from learner.model.transformer import Transformer, model_config
    from learner.tasks import CharTokenizer
    from rollout_client import EngineProcess, MlxEngine, RolloutClient

    config = model_config("tiny", max_seq_len=4 * tokens)
    weights = {path: np.asarray(leaf) for path, leaf in
               named_leaves(nnx.state(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param)).items()}
    writer = functools.partial(write_hf_checkpoint, config=config, tokenizer=CharTokenizer(), eos_token_ids=(2,),
                               overwrite=True)
    params = SamplingParams(max_new_tokens=tokens, stop_token_ids=())
    lines = []
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as scratch:
        scratch = pathlib.Path(scratch)
        mlx = MlxEngine(ClientConfig("127.0.0.1:0", ready_timeout_s=300), writer, scratch / "weights", 0, weights,
                        log_path=scratch / "mlx.log", max_batch_size=64)
        reference = EngineProcess("learner.serving", ["--hf-path", str(mlx.served_dir), "--max-batch-size", "64",
                                                      "--max-seq-len", str(4 * tokens)], scratch / "reference.log")
        client = RolloutClient(ClientConfig(reference.address, ready_timeout_s=300))
        try:
            for name, submit, mode in (("mlx engine (smg MLX proto)", mlx.submit, LogprobMode.RAW),
                                       ("reference server (rollout.v1)", client.submit, LogprobMode.PROCESSED)):
                def round_trip():
                    futures = [submit(RolloutRequest([1, 2, 3], params, num_samples=samples_per_request,  # noqa: B023
                                                     logprob_mode=mode)) for _ in range(concurrency)]  # noqa: B023
                    samples = [sample for future in futures for sample in future.result()]
                    assert sum(s.completion_token_ids.size for s in samples) == tokens * concurrency * (
                        samples_per_request)

                round_trip()  # warm-up (compiles)
                start = time.perf_counter()
                for _ in range(rounds):
                    round_trip()
                elapsed = time.perf_counter() - start
                samples = rounds * concurrency * samples_per_request
                lines.append(f"{name}, tiny model, {concurrency} concurrent requests of {samples_per_request} samples "
                             f"of {tokens} tokens: {elapsed / (samples * tokens) * 1e9:.0f} ns/token, "
                             f"{samples / elapsed:.0f} samples/s")
        finally:
            client.close()
            reference.stop()
            mlx.close()
    return lines


def mlx_publish_costs(model_names=("tiny", "small"), publishes: int = 3) -> list[str]:
    """`MlxEngine.publish` (write a checkpoint directory, restart the engine on it): seconds and seconds per MB."""
    import functools
    import tempfile

    from flax import nnx

    from learner.checkpoints.hf_checkpoint import write_hf_checkpoint
    from learner.model.param_paths import named_leaves
    from learner.model.transformer import Transformer, model_config
    from learner.tasks import CharTokenizer
    from rollout_client import MlxEngine

    lines = []
    for name in model_names:
        config = model_config(name)
        weights = {path: np.asarray(leaf) for path, leaf in
                   named_leaves(nnx.state(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param)).items()}
        writer = functools.partial(write_hf_checkpoint, config=config, tokenizer=CharTokenizer(), eos_token_ids=(2,),
                                   overwrite=True)
        with tempfile.TemporaryDirectory(prefix="bench-publish-") as scratch:
            scratch = pathlib.Path(scratch)
            engine = MlxEngine(ClientConfig("127.0.0.1:0", ready_timeout_s=300), writer, scratch / "weights", 0,
                               weights, log_path=scratch / "mlx.log")
            try:
                runs = []
                for version in range(1, publishes + 1):
                    engine.publish(version, weights)
                    runs.append(engine.metrics())
            finally:
                engine.close()
        megabytes = runs[0]["publish/megabytes"]
        write_s = np.median([run["publish/write_s"] for run in runs])
        restart_s = np.median([run["publish/restart_s"] for run in runs])
        lines.append(f"mlx publish ({name}, float32, {megabytes:.1f} MB, median of {publishes}): write {write_s:.2f} s "
                     f"({write_s / megabytes * 1e3:.1f} ms/MB), restart until healthy {restart_s:.2f} s, total "
                     f"{(write_s + restart_s) / megabytes:.3f} s/MB")
    return lines


def decode_tokens_per_second(batch_size: int = 16, steps: int = 8, calls: int = 20) -> float:
    from flax import nnx

    from learner.model.transformer import Transformer, model_config
    from learner.serving import ModelGenerator
    from rollout_client.sampling_params import LogprobMode
    from rollout_client.server.generator import ResolvedSampling, SequenceSpec

    generator = ModelGenerator(Transformer(model_config("tiny"), rngs=nnx.Rngs(0)), max_batch_size=batch_size,
                               decode_steps_per_call=steps)
    sampling = ResolvedSampling(1.0, 0, 1.0, 0.0, 200, (), 0)
    for i in range(batch_size):
        generator.add(i, SequenceSpec(np.arange(1, 9, dtype=np.int32), sampling, i, LogprobMode.RAW))
    generator.step()
    start = time.perf_counter()
    for _ in range(calls):
        generator.step()
    return batch_size * steps * calls / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.rollout_transport",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--smg-rounds", type=int, default=10, help="rounds of the smg transport (per-token messages "
                        "make a round ~30x slower than rollout.v1's)")
    parser.add_argument("--engine-tokens", type=int, default=64, help="tokens per sample of the real engines")
    parser.add_argument("--engine-rounds", type=int, default=10)
    parser.add_argument("--serve-floor", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-smg", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_floor or args.serve_smg:
        asyncio.run((serve_floor if args.serve_floor else serve_smg)(args.tokens))
        return
    with served(args.tokens) as (pid, target):
        for concurrency, samples_per_request in ((1, 1), (8, 1), (8, 8)):
            result = asyncio.run(transport(target, pid, args.tokens, args.rounds, concurrency, samples_per_request))
            print(f"transport {args.tokens} tokens/sample, {concurrency} concurrent requests of "
                  f"{samples_per_request} samples: {result}")
    with served(args.tokens, smg=True) as (pid, target):
        for concurrency, samples_per_request in ((1, 1), (8, 1), (8, 8)):
            result = asyncio.run(smg_transport(target, pid, args.tokens, args.smg_rounds, concurrency,
                                               samples_per_request))
            print(f"smg transport (MLX proto, one message per token) {args.tokens} tokens/sample, {concurrency} "
                  f"concurrent requests of {samples_per_request} samples: {result}")
    with served(args.tokens, floor=True) as (pid, target):
        for concurrency in (1, 8):
            result = asyncio.run(floor_transport(target, pid, args.tokens, args.rounds, concurrency))
            print(f"floor (bare grpc.aio stub and server) {args.tokens} tokens/sample, {concurrency} concurrent "
                  f"requests of 1 sample: {result}")
    for line in [*engines_end_to_end(args.engine_tokens, args.engine_rounds), *mlx_publish_costs()]:
        print(line, flush=True)
    print(f"model decode (tiny, float32, batch 16, CPU): {decode_tokens_per_second():.0f} tokens/s")


if __name__ == "__main__":
    main()
