"""Benchmarks rollout.v1 transport, and the reference server's model decode speed.

Transport: a server process on 127.0.0.1 whose generation is replaced by a
precomputed stream (the scripted engine, 1024 tokens per step) and a client that
decodes every sample to numpy arrays (validated). Reports ns per token end to end,
for one request at a time and for 8 concurrent requests, and samples/s.

Decode: the model engine (default model "tiny", float32) in this process, decode
tokens/s with a full batch.

    python scripts/bench_rollout_transport.py [--tokens 1024] [--rounds 200]
"""

import argparse
import asyncio
import re
import subprocess
import sys
import time

import numpy as np

from rollout_client import AsyncRolloutClient
from rollout_client import ClientConfig
from rollout_client import RolloutRequest
from rollout_client import SamplingParams


def start_server(tokens: int) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "rollout_client.server", "--engine", "scripted", "--vocab-size", "32000",
         "--tokens-per-step", str(tokens), "--max-seq-len", str(4 * tokens), "--max-batch-size", "64"],
        stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    return process, re.search(r"listening on (\S+)", line).group(1)


async def transport(target: str, tokens: int, rounds: int, concurrency: int, samples_per_request: int,
                    ) -> tuple[float, float]:
    """Returns (ns per token, samples per second)."""
    client = AsyncRolloutClient(ClientConfig(target=target))
    await client.connect()
    params = SamplingParams(max_new_tokens=tokens, stop_token_ids=(), seed=0)

    async def one():
        samples = await client.generate(RolloutRequest([1, 2, 3], params, num_samples=samples_per_request))
        assert sum(sample.completion_token_ids.size for sample in samples) == tokens * samples_per_request

    for _ in range(20):
        await one()
    start = time.perf_counter()
    for _ in range(rounds):
        await asyncio.gather(*(one() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    await client.close()
    samples = rounds * concurrency * samples_per_request
    return elapsed / (samples * tokens) * 1e9, samples / elapsed


def decode_tokens_per_second(batch_size: int = 16, steps: int = 8, calls: int = 20) -> float:
    from flax import nnx

    from learner.model import Transformer
    from learner.model import model_config
    from rollout_client.sampling_params import LogprobMode
    from rollout_client.server.generator import ResolvedSampling
    from rollout_client.server.generator import SequenceSpec
    from rollout_client.server.model_generator import ModelGenerator

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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    process, target = start_server(args.tokens)
    try:
        for concurrency, samples_per_request in ((1, 1), (8, 1), (8, 8)):
            ns, rate = asyncio.run(transport(target, args.tokens, args.rounds, concurrency, samples_per_request))
            print(f"transport {args.tokens} tokens/sample, {concurrency} concurrent requests of "
                  f"{samples_per_request} samples: {ns:.0f} ns/token end to end, {rate:.0f} samples/s")
    finally:
        process.terminate()
        process.wait(timeout=30)
    print(f"model decode (tiny, float32, batch 16, CPU): {decode_tokens_per_second():.0f} tokens/s")


if __name__ == "__main__":
    main()
