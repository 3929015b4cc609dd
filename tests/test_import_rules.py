"""docs/architecture.md's import rules, checked on the source, and no import circle among the repo's modules.

Every import statement of every module counts, those inside functions and under ``if TYPE_CHECKING:`` included (a
circle for type checkers alone is still two modules that name each other), read with `ast`: nothing is imported, so
the whole check takes about a second. What importing a package loads at
run time is checked by tests/corrections/test_package_boundaries.py, tests/rollout_client/test_no_learner_imports.py
and tests/learner/test_package_layers.py.
"""

import ast
import pathlib
from collections.abc import Iterator

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("learner", "corrections", "rollout_client", "scripts", "tests")

# The parts of learner that each part may import: a layer imports only the layers below it. Every part of learner
# (a sub-package or a top-level module) is placed here; a new one fails the layer test until it is.
LOWER_LAYERS: dict[str, set[str]] = {
    "learner.model": set(),
    "learner.reporting": set(),
    "learner.distributed": set(),  # multi-host start
    "learner.reward_workers": set(),  # the standard library alone: a reward worker process starts fast
    "learner.tasks": {"learner.reward_workers"},
    "learner.logprobs": {"learner.model"},
    "learner.checkpoints": {"learner.model"},
    "learner.update": {"learner.logprobs", "learner.model"},
    "learner.serving": {"learner.checkpoints", "learner.logprobs", "learner.model", "learner.reporting"},
}
LOWER_LAYERS["learner.rl"] = set(LOWER_LAYERS)
# They may import any layer, and none imports them; learner.tools holds the product tools (issue 52's scripts split).
COMMAND_LINES = ("learner.train", "learner.export", "learner.show", "learner.tools")
for _command in COMMAND_LINES:
    LOWER_LAYERS[_command] = set(LOWER_LAYERS)
LOWER_LAYERS["learner"] = set(LOWER_LAYERS)  # the package's face: its names load on first use

# The parts of learner that may import corrections and rollout_client (and their sub-packages).
IMPORTED_BY = {
    "corrections": {"learner.update", "learner.rl", "learner.tools"},  # tools: recompute_diagnostics
    "corrections.frameworks": {"learner.rl"},
    "rollout_client": {"learner.rl", "learner.serving", "learner.update", "learner.logprobs"},
    "rollout_client.engines": {"learner.rl"},
    # learner.rl.rollout_engines reads the server's AUTH_TOKEN_ENV, the variable an engine child takes its token in.
    "rollout_client.server": {"learner.serving", "learner.rl"},
}

# What the two lower packages never import: corrections is pure JAX, rollout_client runs without the learner.
NEVER_IMPORTS = {
    "corrections": {"learner", "rollout_client", "flax", "grpc"},
    "rollout_client": {"learner", "flax"},
}


def module_files(root: pathlib.Path, packages: tuple[str, ...]) -> dict[str, pathlib.Path]:
    """Dotted module name -> source file, for every ``.py`` file under the packages (a package is its __init__)."""
    files = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def import_graph(root: pathlib.Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> what it imports, at any depth of its source. An import names the repo's module it loads (``from a
    import b``: ``a.b`` where that is a module, else ``a``; otherwise the nearest package above), or an outside
    package by its top-level name."""
    files = module_files(root, packages)

    def resolve(name: str) -> str:
        found = name
        while found and found not in files:
            found = found.rpartition(".")[0]
        return found or name.split(".")[0]

    graph = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [resolve(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else resolve(base)
                           for alias in node.names]
            else:
                continue
            edges.update(target for target in targets if target != module)
        graph[module] = edges
    return graph


def part(module: str) -> str:
    """The part of the tree a module belongs to, as docs/architecture.md names them: ``learner.rl``,
    ``corrections.frameworks``, ``rollout_client.server``, ``flax``, ..."""
    parts = module.split(".")
    if parts[0] == "learner" or module.startswith(("corrections.frameworks", "rollout_client.server",
                                                   "rollout_client.engines")):
        return ".".join(parts[:2])
    return parts[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles (strongly connected components of two or more modules), each sorted; Tarjan's
    algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module] & graph.keys():
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    return sorted(found)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(REPO_ROOT, PACKAGES)


def imports_of(graph: dict[str, set[str]], package: str) -> Iterator[tuple[str, str]]:
    """(module, what it imports) for every module of ``package``."""
    for module, edges in graph.items():
        if module.split(".")[0] == package:
            for target in edges:
                yield module, target


def test_every_part_of_learner_imports_only_the_layers_below_it(graph):
    unplaced = sorted({part(module) for module in graph if module.startswith("learner")} - set(LOWER_LAYERS))
    assert unplaced == [], "place these in LOWER_LAYERS and in docs/architecture.md"
    offenders = [f"{module} imports {target}" for module, target in imports_of(graph, "learner")
                 if target.startswith("learner.") and part(target) != part(module)
                 and part(target) not in LOWER_LAYERS[part(module)]]
    assert offenders == []


def test_corrections_and_rollout_client_import_nothing_above_them(graph):
    offenders = [f"{module} imports {target}" for package, never in NEVER_IMPORTS.items()
                 for module, target in imports_of(graph, package) if target.split(".")[0] in never]
    assert offenders == []


def test_learner_reaches_corrections_and_rollout_client_from_the_documented_layers_only(graph):
    offenders = [f"{module} imports {target}" for module, target in imports_of(graph, "learner")
                 if part(target) in IMPORTED_BY and part(module) not in IMPORTED_BY[part(target)]]
    assert offenders == []


def test_no_module_outside_corrections_imports_a_private_corrections_module(graph):
    offenders = [f"{module} imports {target}" for package in ("learner", "rollout_client", "scripts")
                 for module, target in imports_of(graph, package)
                 if target.startswith("corrections.") and any(name.startswith("_") for name in target.split("."))]
    assert offenders == []


def test_no_import_circles(graph):
    assert cycles(graph) == []


def test_the_graph_sees_imports_in_functions_relative_and_for_type_checking(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from . import b\n")
    (package / "a.py").write_text("import os\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                  "    from pkg.sub import c\n\n\ndef f():\n    from .sub.b import g\n    return g\n")
    (package / "sub" / "b.py").write_text("import flax.nnx\n\n\ndef g():\n    import pkg.a\n    return pkg.a\n")
    (package / "sub" / "c.py").write_text("from pkg import a\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph == {"pkg": set(), "pkg.a": {"os", "typing", "pkg.sub.c", "pkg.sub.b"}, "pkg.sub": {"pkg.sub.b"},
                     "pkg.sub.b": {"flax", "pkg.a"}, "pkg.sub.c": {"pkg.a"}}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.sub.c"]]


def test_part_names_the_layers_of_the_architecture():
    assert [part(name) for name in ("learner", "learner.rl.run", "learner.export", "corrections._config",
                                    "corrections.frameworks._verl", "rollout_client.server.cli", "flax.nnx")] == [
        "learner", "learner.rl", "learner.export", "corrections", "corrections.frameworks", "rollout_client.server",
        "flax"]
