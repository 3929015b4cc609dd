"""A hostile rollout.v1 server: the scripted engine, with sample 0 of a request corrupted.

The fault is named by the request id, ``"<fault>/<anything>"`` (no fault for other ids), so one process serves
every fault. The server also advertises a vocabulary of `ADVERTISED_VOCAB_SIZE` while its engine draws tokens
from ``--vocab-size``, as a server for a larger model would.

Run as ``python -m tests.support.hostile_server [server args]``.
"""

import grpc
import numpy as np

from rollout_client.packed_arrays import LOGPROB_DTYPE, TOKEN_ID_DTYPE
from rollout_client.protocol import MAX_MESSAGE_BYTES, pb
from rollout_client.server.__main__ import add_scripted_arguments, scripted_engine
from rollout_client.server.cli import run, server_parser
from rollout_client.server.service import RolloutServicer

ADVERTISED_VOCAB_SIZE = 10_000
OUT_OF_LEARNER_VOCAB = 5000  # Below the advertised vocabulary, above the learner's.
STOP_TOKEN = 1  # The scripted engine never draws it, so only the fault puts it mid-completion.


def _set_first(field: str, dtype, value):
    """A fault that sets the first element of the final's packed `field` to `value`."""
    def fault(final: pb.SampleResult) -> None:
        values = np.frombuffer(getattr(final, field), dtype).copy()
        values[0] = value
        setattr(final, field, values.tobytes())
    return fault


def _set_logprob(value: float):
    return _set_first("logprobs", LOGPROB_DTYPE, value)


def _set_token(value: int):
    return _set_first("token_ids", TOKEN_ID_DTYPE, value)


def _echo(**fields):
    def fault(final: pb.SampleResult) -> None:
        for name, value in fields.items():
            if name == "stop_token_ids":
                final.sampling.stop_token_ids.token_ids[:] = value
            else:
                setattr(final.sampling, name, value)
    return fault


def _version_ahead(final: pb.SampleResult) -> None:
    for span in final.version_spans:
        span.policy_version = 1_000_000


def _abort(final: pb.SampleResult) -> None:
    final.finish_reason = pb.FINISH_REASON_ABORT


def _one_token_more(final: pb.SampleResult) -> None:
    final.token_ids += np.array([2], TOKEN_ID_DTYPE).tobytes()
    final.logprobs += np.array([-1.0], LOGPROB_DTYPE).tobytes()
    final.completion_tokens += 1
    final.version_spans[-1].end += 1


def _seed_plus_one(final: pb.SampleResult) -> None:
    final.sampling.seed += 1


FAULTS = {
    "logprob_plus_3": _set_logprob(3.0),
    "logprob_minus_1e30": _set_logprob(-1e30),
    "logprob_minus_3e38": _set_logprob(-3e38),
    "version_ahead": _version_ahead,
    "token_after_stop": _set_token(STOP_TOKEN),
    "abort": _abort,
    "echo_temperature": _echo(temperature=0.5),
    "echo_temperature_inf": _echo(temperature=float("inf")),
    "echo_top_k": _echo(top_k=3),
    "echo_top_p": _echo(top_p=0.5),
    "echo_min_p": _echo(min_p=0.1),
    "echo_max_new_tokens": _echo(max_new_tokens=31),
    "echo_stop_token_ids": _echo(stop_token_ids=[0]),
    "echo_seed": _seed_plus_one,
    "too_long": _one_token_more,
    "out_of_learner_vocab": _set_token(OUT_OF_LEARNER_VOCAB),
    "duplicate": None,  # Sample 0's final message is sent twice, the second with other tokens.
    # Faults of the reply (issue #49): the samples of the call are dropped, the run goes on.
    "missing_final": None,  # Sample 0's final message is never sent; the stream ends normally.
    "unknown_index": None,  # Sample 0's final message comes as sample_index 1000.
    "oversize": None,  # Sample 0's final message is over gRPC's size limit: the call ends RESOURCE_EXHAUSTED.
    "internal": None,  # The call ends with status INTERNAL before any message.
}


class HostileServicer(RolloutServicer):
    """Corrupts sample 0 of each request whose id names a fault."""

    async def Generate(self, request, context):
        fault = request.request_id.split("/")[0]
        if fault == "internal":
            await context.abort(grpc.StatusCode.INTERNAL, "tests.support.hostile_server: internal")
        async for message in super().Generate(request, context):
            if not (message.HasField("final") and message.sample_index == 0 and fault in FAULTS):
                yield message
            elif fault == "missing_final":
                continue
            elif fault == "unknown_index":
                message.sample_index = 1000
                yield message
            elif fault == "oversize":
                message.final.sampling.stop_strings.append("x" * MAX_MESSAGE_BYTES)
                yield message
            elif fault == "duplicate":
                yield message
                again = pb.GenerateResponse()
                again.CopyFrom(message)
                _set_token(3)(again.final)
                yield again
            else:
                FAULTS[fault](message.final)
                yield message

    async def GetServerInfo(self, request, context):
        reply = await super().GetServerInfo(request, context)
        reply.vocab_size = ADVERTISED_VOCAB_SIZE
        return reply


def main() -> None:
    parser = server_parser("python -m tests.support.hostile_server")
    add_scripted_arguments(parser)
    run(parser, {"scripted": scripted_engine}, None, HostileServicer)


if __name__ == "__main__":
    main()
