"""rollout_client stands alone: every module imports, and the scripted server serves, with flax and learner refused.

The dependency runs one way (learner -> rollout_client): the model generator lives in `learner.serving`.
"""

import signal
import subprocess
import sys

from rollout_client import ClientConfig, RolloutClient, RolloutRequest, SamplingParams
from tests.rollout_client.conftest import REPO_ROOT, ServerProcess

# Run first in a fresh interpreter: any later import of flax or learner (or a submodule) raises ImportError.
REFUSE_FLAX_AND_LEARNER = """
import importlib.abc
import sys

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("flax", "learner"):
            raise ImportError(f"rollout_client imported {name}")

sys.meta_path.insert(0, Refuse())
"""

IMPORT_EVERY_MODULE = REFUSE_FLAX_AND_LEARNER + """
import importlib
import pkgutil

import rollout_client

names = [info.name for info in pkgutil.walk_packages(rollout_client.__path__, "rollout_client.")]
for name in names:
    importlib.import_module(name)
print(len(names), "modules:", " ".join(names))
"""

RUN_SERVER = REFUSE_FLAX_AND_LEARNER + """
import runpy

runpy.run_module("rollout_client.server", run_name="__main__", alter_sys=True)
"""


def test_every_module_imports_without_flax_or_learner():
    result = subprocess.run([sys.executable, "-c", IMPORT_EVERY_MODULE], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "rollout_client.server.__main__" in result.stdout and "rollout_client.engines.process" in result.stdout


def test_scripted_server_serves_without_flax_or_learner(tmp_path):
    server = ServerProcess([sys.executable, "-c", RUN_SERVER, "--engine", "scripted", "--vocab-size", "50"], tmp_path)
    try:
        with RolloutClient(ClientConfig(target=server.target, ready_timeout_s=30)) as client:
            (sample,) = client.generate(RolloutRequest([3, 4], SamplingParams(max_new_tokens=5, stop_token_ids=())))
        assert sample.completion_token_ids.size == 5
    finally:
        exit_code = server.stop(signal.SIGTERM)
    assert exit_code == 0, server.output()
