"""The reference model server, except that every sample's first logprob is NaN (a broken kernel, say).

Run as ``python -m tests.support.nan_server [learner.serving args]``.
"""

import numpy as np

from learner.serving.__main__ import add_model_arguments, build_model_generator
from rollout_client.packed_arrays import LOGPROB_DTYPE
from rollout_client.server.cli import run, server_parser
from rollout_client.server.service import RolloutServicer


class NanServicer(RolloutServicer):
    def final_message(self, spec, output):
        message = super().final_message(spec, output)
        logprobs = np.frombuffer(message.final.logprobs, LOGPROB_DTYPE).copy()
        logprobs[0] = np.nan
        message.final.logprobs = logprobs.tobytes()
        return message


def main() -> None:
    parser = server_parser("python -m tests.support.nan_server")
    add_model_arguments(parser)
    run(parser, {"model": build_model_generator}, servicer_class=NanServicer)


if __name__ == "__main__":
    main()
