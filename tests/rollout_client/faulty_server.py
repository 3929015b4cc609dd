"""A deliberately faulty rollout server: the scripted engine, with final messages corrupted.

Run as ``python -m tests.rollout_client.faulty_server --fault FAULT [server args]``.
"""

import argparse
import asyncio

from rollout_client.server.__main__ import config_from_args
from rollout_client.server.__main__ import generator_from_args
from rollout_client.server.__main__ import parse_args
from rollout_client.server.app import serve
from rollout_client.server.service import RolloutServicer


def corrupt(message, fault: str, vocab_size: int) -> None:
    """Breaks one field of a final SampleResult in place."""
    if fault == "nan_logprobs":
        message.logprobs[0] = float("nan")
    elif fault == "length_mismatch":
        del message.logprobs[-1]
    elif fault == "out_of_vocab":
        message.token_ids[0] = vocab_size + 5
    elif fault == "empty":
        del message.token_ids[:]
        del message.logprobs[:]
        message.completion_tokens = 0
        del message.version_spans[:]


def faulty_servicer(fault: str):
    """A servicer class whose sample 0 of every request carries `fault`."""

    class FaultyServicer(RolloutServicer):
        def final_message(self, spec, output):
            message = super().final_message(spec, output)
            if spec.sample_index == 0:
                corrupt(message.final, fault, self._info.vocab_size)
            return message

    return FaultyServicer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", required=True, choices=("nan_logprobs", "length_mismatch", "out_of_vocab", "empty"))
    known, rest = parser.parse_known_args()
    args = parse_args(rest)
    asyncio.run(serve(config_from_args(args), generator_from_args(args), faulty_servicer(known.fault)))


if __name__ == "__main__":
    main()
