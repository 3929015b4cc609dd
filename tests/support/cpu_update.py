"""``python -m tests.support.cpu_update OUT.npz [PRECISION]``: `tests.accelerator.test_update_matches_cpu`'s update
on whatever backend this process has (the test runs it with ``JAX_PLATFORMS=cpu``), saved for comparison."""

import sys

import numpy as np

from tests.accelerator.test_update_matches_cpu import one_update

if __name__ == "__main__":
    np.savez(sys.argv[1], **one_update(sys.argv[2] if len(sys.argv) > 2 else "highest"))
