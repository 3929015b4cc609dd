"""The update on the accelerator equals the CPU's: the update problem of tests/support/update_problem (decoupled PPO,
token TIS, KL to a reference, the proximal and reference passes, SGD with learning rate 1 so that the parameter
change IS minus the gradient), on one device, at the float32 default precision ("highest"), against the same
update computed by a CPU process (``JAX_PLATFORMS=cpu``).

Tolerance: the loss to a relative 1e-5, every parameter change to 1e-4 relative + 2e-6 absolute (the bound the CPU
meshes are held to against each other in tests/learner/update/test_update.py: only the order of float32 sums differs).
"""

import os
import pathlib
import subprocess
import sys

import jax
import numpy as np

from tests.support.cpu_update import one_update

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_update_on_the_accelerator_equals_the_cpus(tmp_path):
    cpu_file = tmp_path / "cpu.npz"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join([str(REPO_ROOT),
                                                                               os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-m", "tests.support.cpu_update", str(cpu_file)], check=True, env=env,
                   cwd=REPO_ROOT, timeout=600)
    cpu = dict(np.load(cpu_file))
    here = one_update("highest")
    assert here.keys() == cpu.keys()
    np.testing.assert_allclose(here["loss"], cpu["loss"], rtol=1e-5)
    assert abs(float(cpu["loss"][0])) > 1e-3
    worst = max(float(np.abs(here[name] - cpu[name]).max()) for name in cpu if name != "loss")
    print(f"max |parameter change difference| accelerator vs CPU: {worst:.2e} ({jax.devices()[0].device_kind})")
    for name in cpu:
        np.testing.assert_allclose(here[name], cpu[name], rtol=1e-4, atol=2e-6, err_msg=name)
