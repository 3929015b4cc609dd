"""learner's lower layers load without the layers above them: `import learner.model` starts no RL loop and no gRPC."""

import ast
import pathlib
import subprocess
import sys

import learner

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]

LOADED_BY = """
import sys
import {module}
print(" ".join(sorted(name for name in sys.modules if name.split(".")[0] in ("learner", "grpc", "rollout_client"))))
"""


def loaded_by(module: str) -> set[str]:
    result = subprocess.run([sys.executable, "-c", LOADED_BY.format(module=module)], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


def test_importing_the_model_loads_neither_the_loop_nor_grpc():
    loaded = loaded_by("learner.model")
    assert "learner.model.transformer" in loaded
    assert not {name for name in loaded if name.split(".")[0] in ("grpc", "rollout_client")}
    assert not {name for name in loaded if name.startswith(("learner.rl", "learner.update", "learner.tasks"))}


def test_the_top_level_names_load_on_first_use():
    loaded = loaded_by("learner")
    assert loaded == {"learner"}
    result = subprocess.run([sys.executable, "-c", "import learner; print(learner.Run.__module__)"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["learner.rl.run"], result.stderr


def test_the_type_checking_imports_name_the_lazy_names_from_their_modules():
    """learner/__init__.py lists its public names twice: `_LAZY` loads them at run time, the `if TYPE_CHECKING:`
    imports show them to type checkers (which do not run `__getattr__`). The two must not drift apart."""
    tree = ast.parse((REPO_ROOT / "learner" / "__init__.py").read_text())
    (block,) = [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"]
    imports = [(alias.name, alias.asname, node.module) for node in block.body for alias in node.names]
    assert [(name, alias) for name, alias, _ in imports if alias != name] == []  # `X as X`: re-exported
    assert {name: module for name, _, module in imports} == learner._LAZY
    assert len(imports) == len(learner._LAZY)  # no name imported twice
