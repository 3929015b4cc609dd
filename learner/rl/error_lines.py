"""The command line's errors as one line each: a user error or a full disk is one ``error:`` line and exit 1, never a
traceback; Ctrl-C or SIGTERM is one line (the checkpoint it saved) and exit 130 or 143.
"""

from __future__ import annotations

import contextlib
import sys

from learner.reporting.disk_full import disk_full_cause
from learner.reporting.run_files import UnsafeRunDirError
from learner.rl.batch_assembly import NoUsableRolloutsError
from learner.rl.canary import CanaryMismatchError
from learner.rl.hooks import EvaluationError
from learner.rl.preflight import ConfigError
from learner.rl.run import NonFiniteUpdateError, ResumeConfigError
from learner.rl.run_lock import RunDirLockedError
from learner.rl.stop_signals import Interrupted
from rollout_client import (
    EngineCallError,
    EngineCapabilityError,
    EngineExitedError,
    EnginesDownError,
    ModelMismatchError,
    PolicyVersionError,
)

# Errors whose message names the cause and the fix: the CLI prints them as one ``error:`` line and exits 1, never
# with a traceback. Add a class here (not a new handler) to give another failure the same treatment.
USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, ResumeConfigError, RunDirLockedError, UnsafeRunDirError,
                                                EngineCapabilityError, NonFiniteUpdateError, NoUsableRolloutsError,
                                                EvaluationError, CanaryMismatchError, EngineCallError,
                                                ModelMismatchError, PolicyVersionError)


@contextlib.contextmanager
def errors_as_lines(*classes: type[BaseException], run_dir: str | None = None):
    """Turns an exception of ``classes`` (default `USER_ERRORS`), or one caused by a full disk (writing under
    ``run_dir``), into one ``error: <message>`` line on stderr and exit 1; Ctrl-C or SIGTERM into one line (the
    checkpoint the run saved) and exit 130 or 143."""
    try:
        yield
    except Interrupted as stop:  # SIGINT or SIGTERM, handled by the run (`learner.rl.stop_signals`)
        if stop.saved_step is None:
            print(f"interrupted ({stop}) before the first step: nothing trained to save; rerun the same command to "
                  "start again (a run that had a checkpoint resumes from it)", file=sys.stderr, flush=True)
        else:
            print(f"interrupted ({stop}): checkpoint {stop.saved_step} saved and verified; rerun the same command to "
                  f"resume from step {stop.saved_step}", file=sys.stderr, flush=True)
        raise SystemExit(stop.exit_code) from None
    except KeyboardInterrupt:
        print("interrupted: rerun the same command to resume from the latest checkpoint", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except (EngineExitedError, EnginesDownError) as error:  # its first line names the engine's log and exit code
        sys.exit(f"error: {str(error).splitlines()[0].rstrip(':')}")
    except classes or USER_ERRORS as error:  # noqa: B030
        sys.exit("error: " + " ".join(str(error).splitlines()))  # a listing (ModelMismatchError's) on one line
    except Exception as error:
        if cause := disk_full_cause(error):
            sys.exit(f"error: disk full writing under run_dir {run_dir} ({cause}). Committed checkpoints are intact "
                     "(a partial save is deleted at the next start): free space and rerun the same command to resume")
        raise


def drop_closed_loop_callbacks(unraisable) -> None:
    """``sys.unraisablehook``: after a failed save, tensorstore writes still pending complete into orbax's closed
    event loop, each reporting ``RuntimeError('Event loop is closed')``; the failure itself is reported once."""
    error = unraisable.exc_value
    if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
        sys.__unraisablehook__(unraisable)
