"""Two JAX processes (gloo collectives on 127.0.0.1, 4 simulated CPU devices each) make the same update as one."""

import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np

from learner.distributed import initialize
from learner.model.sharding import make_mesh
from tests.support.update_problem import FAST_COMPILE, run_update

WORKER = "tests.support.multiprocess_worker"
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_processes_make_the_same_update_as_one(tmp_path: pathlib.Path):
    out = tmp_path / "update.npz"
    port = _free_port()
    fast_compile = " ".join(f"--{name}={str(value).lower()}" for name, value in FAST_COMPILE.items())
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {fast_compile}", "PYTHONPATH": str(REPO_ROOT)}
    logs = [tmp_path / f"worker{i}.log" for i in range(2)]
    workers = [subprocess.Popen([sys.executable, "-m", WORKER, str(port), "2", str(i), str(out)], env=env,
                                cwd=REPO_ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
               for i, log in enumerate(logs)]
    try:
        before, after, metrics = run_update(make_mesh(1, 1, 1, devices=jax.devices()[:1]))
        for worker in workers:
            worker.wait(timeout=TIMEOUT_S)
    finally:
        for worker in workers:
            worker.kill()
    assert [worker.returncode for worker in workers] == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)

    got = np.load(out)
    delta = jax.tree.map(np.subtract, after, before)
    for path, want in jax.tree_util.tree_leaves_with_path(delta):
        np.testing.assert_allclose(got[jax.tree_util.keystr(path)], want, rtol=1e-4, atol=2e-6)
    for name, want in metrics.items():
        np.testing.assert_allclose(got[f"metric:{name}"], want, rtol=1e-4, atol=1e-5, err_msg=name)
    assert abs(float(metrics["actor/pg_loss"][0])) > 1e-3


def test_initialize_is_a_no_op_for_a_single_process(monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_MCA_orte_hnp_uri"):
        monkeypatch.delenv(name, raising=False)
    assert initialize() is False
    assert initialize("127.0.0.1:1", num_processes=1, process_id=0) is False
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert initialize() is False
    assert not jax.distributed.is_initialized()
