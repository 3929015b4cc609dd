"""The scripted reference server, except that its engine fails at its Nth step, as a device out of memory would.

Run as ``python -m tests.support.failing_engine_server --fail-at-step N [rollout_client.server args]``.
"""

from rollout_client.server.__main__ import add_scripted_arguments
from rollout_client.server.cli import run, server_parser
from rollout_client.server.scripted import ScriptedGenerator

FAILURE = "CUDA_ERROR_OUT_OF_MEMORY: out of memory (simulated by tests.support.failing_engine_server)"


class FailingGenerator(ScriptedGenerator):
    """Steps normally ``fail_at_step - 1`` times, then raises `FAILURE`."""

    def __init__(self, fail_at_step: int, **kwargs):
        super().__init__(**kwargs)
        self._steps_left = fail_at_step

    def step(self):
        self._steps_left -= 1
        if self._steps_left <= 0:
            raise RuntimeError(FAILURE)
        return super().step()


def main() -> None:
    parser = server_parser("python -m tests.support.failing_engine_server")
    add_scripted_arguments(parser)
    parser.add_argument("--fail-at-step", type=int, default=1)

    run(parser, {"failing": lambda args: FailingGenerator(args.fail_at_step, vocab_size=args.vocab_size,
                                                          step_delay_s=args.step_delay_s,
                                                          max_seq_len=args.max_seq_len,
                                                          max_batch_size=args.max_batch_size)})


if __name__ == "__main__":
    main()
