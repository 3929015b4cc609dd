"""corrections stands alone: every module imports with learner, rollout_client, flax and gRPC refused.

The dependency runs one way (learner -> corrections). tests/test_import_rules.py checks the same on the source, with
the rule that other packages use its public faces (`corrections`, `corrections.frameworks`), never a
`corrections._x` module.
"""

import pathlib
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]

IMPORT_EVERY_MODULE = """
import importlib
import importlib.abc
import pkgutil
import sys

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("learner", "rollout_client", "flax", "grpc"):
            raise ImportError(f"corrections imported {name}")

sys.meta_path.insert(0, Refuse())
import corrections

names = [info.name for info in pkgutil.walk_packages(corrections.__path__, "corrections.")]
for name in names:
    importlib.import_module(name)
print(len(names), "modules:", " ".join(names))
"""


def test_every_corrections_module_imports_without_learner_rollout_client_flax_or_grpc():
    result = subprocess.run([sys.executable, "-c", IMPORT_EVERY_MODULE], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "corrections.frameworks._verl" in result.stdout and "corrections._pipeline" in result.stdout
