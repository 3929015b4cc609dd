"""A deliberately faulty rollout server: the scripted engine, with final messages corrupted.

Run as ``python -m tests.support.faulty_server --fault FAULT [server args]``.
"""

import argparse

import numpy as np

from rollout_client.packed_arrays import LOGPROB_DTYPE, TOKEN_ID_DTYPE
from rollout_client.server.__main__ import add_scripted_arguments, scripted_engine
from rollout_client.server.cli import run, server_parser
from rollout_client.server.service import RolloutServicer

FAULTS = ("nan_logprobs", "length_mismatch", "odd_byte_length", "out_of_vocab", "empty")


def corrupt(message, fault: str, vocab_size: int) -> None:
    """Breaks one field of a final SampleResult in place."""
    tokens = np.frombuffer(message.token_ids, TOKEN_ID_DTYPE).copy()
    logprobs = np.frombuffer(message.logprobs, LOGPROB_DTYPE).copy()
    if fault == "nan_logprobs":
        logprobs[0] = np.nan
        message.logprobs = logprobs.tobytes()
    elif fault == "length_mismatch":
        message.logprobs = logprobs[:-1].tobytes()
    elif fault == "odd_byte_length":
        message.token_ids = message.token_ids[:-1]
    elif fault == "out_of_vocab":
        tokens[0] = vocab_size + 5
        message.token_ids = tokens.tobytes()
    elif fault == "empty":
        message.token_ids = b""
        message.logprobs = b""
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
    parser.add_argument("--fault", required=True, choices=FAULTS)
    known, rest = parser.parse_known_args()
    server = server_parser("python -m tests.support.faulty_server")
    add_scripted_arguments(server)
    run(server, {"scripted": scripted_engine}, rest, faulty_servicer(known.fault))


if __name__ == "__main__":
    main()
