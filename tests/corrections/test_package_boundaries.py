"""corrections stands alone, and only corrections reaches into its private modules.

The dependency runs one way (learner -> corrections): corrections imports neither learner nor rollout_client, and
other packages use its public faces (`corrections`, `corrections.frameworks`), never a `corrections._x` module.
"""

import ast
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


def imported_modules(path: pathlib.Path) -> list[str]:
    """Every module a source file imports: `import a.b` gives a.b, `from a import b` gives a.b and a."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def test_every_corrections_module_imports_without_learner_rollout_client_flax_or_grpc():
    result = subprocess.run([sys.executable, "-c", IMPORT_EVERY_MODULE], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "corrections.frameworks._verl" in result.stdout and "corrections._pipeline" in result.stdout


def test_no_module_outside_corrections_imports_a_private_corrections_module():
    offenders = []
    for folder in ("learner", "rollout_client", "scripts"):
        for path in (REPO_ROOT / folder).rglob("*.py"):
            private = [name for name in imported_modules(path)
                       if name.startswith("corrections.") and any(part.startswith("_") for part in name.split("."))]
            offenders += [f"{path.relative_to(REPO_ROOT)}: {name}" for name in private]
    assert offenders == []


def test_the_private_module_check_sees_a_private_import(tmp_path):
    source = tmp_path / "module.py"
    source.write_text("from corrections.frameworks import _slime\nimport corrections._files\n")
    assert imported_modules(source) == ["corrections.frameworks", "corrections.frameworks._slime",
                                        "corrections._files"]
