"""Subprocess for the kill-mid-save test: saves checkpoint 1, then starts checkpoint 2 and stalls before committing it.

Usage: ``python tests/support/save_until_killed.py DIRECTORY MARKER``. Checkpoint ``k`` holds ``{"w": full((256,
256), k), "step": k}``. Orbax commits a checkpoint by renaming its temporary directory; the commit of checkpoint 2
is hooked to create the file MARKER and sleep, so the parent can SIGKILL this process at a known point mid-save
(arrays written, nothing committed).
"""

import asyncio
import pathlib
import sys

import jax.numpy as jnp
from orbax.checkpoint._src.path import atomicity

from learner.checkpoints.checkpointer import CheckpointConfig, Checkpointer


def _state(step: int) -> dict:
    return {"w": jnp.full((256, 256), step, jnp.float32), "step": jnp.asarray(step, jnp.int32)}


def main(directory: str, marker: str) -> None:
    async def stall_commit(self):
        del self
        pathlib.Path(marker).touch()
        await asyncio.sleep(600)

    checkpointer = Checkpointer(CheckpointConfig(directory, keep_last=5))
    checkpointer.save(1, _state(1), policy_version=1)
    checkpointer.wait_until_finished()
    atomicity.AtomicRenameTemporaryPath.finalize = stall_commit
    checkpointer.save(2, _state(2), policy_version=2)
    checkpointer.wait_until_finished()  # never returns: killed by the parent


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
