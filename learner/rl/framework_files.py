"""A framework's config file as its users keep it: a verl, SkyRL or AReaL YAML, or a verl or slime launch script,
read into plain data for the front doors (``corrections.from_verl`` & co) and a run's mapping
(``learner.rl.framework_config``).

YAML files are read with PyYAML. Hydra's ``defaults`` list is composed against the file's own config folder (each
entry ``group@package: option`` or a plain config name, ``_self_`` where the file's own keys go); the entries whose
files are not in the folder are settled by ``learner.rl.hydra_defaults`` (outside the loss: listed and dropped;
the framework's stock entries of the loss blocks: dropped, the front door fills in their defaults; others:
refused, naming the command that composes the file), so that the front door gets plain data. ``${a.b}``,
``${.sibling}`` and ``${oc.select:a.b,default}`` interpolations are resolved; others (``${oc.env:HOME}``) stay
text. Dotted keys (``actor_rollout_ref.rollout.n: 5``) are nested, so that they mean what the nested keys mean. A
launch script (``.sh``) is read by ``learner.rl.launch_scripts``: a verl script's Hydra overrides, or a slime
script's arguments.

Files are read with limits, each refused with one error naming the file: at most ``MAX_FILE_BYTES``, at most
``MAX_VALUES`` values once YAML aliases are expanded (an alias bomb is tiny on disk), at most ``MAX_DEPTH`` levels,
and no recursive alias (a value that holds itself).
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Mapping
from typing import Any

from corrections.frameworks import merge, nest
from learner.rl.hydra_defaults import defaults_entry, entry_package, settle_defaults
from learner.rl.launch_scripts import read_launch_script

__all__ = ["MAX_DEPTH", "MAX_FILE_BYTES", "MAX_VALUES", "read_composed", "read_file", "resolve_interpolations"]

MAX_FILE_BYTES = 1 << 20  # verl's whole resolved config is 20 KB
MAX_VALUES = 100_000  # values of a file with its YAML aliases expanded (verl's resolved config: ~700)
MAX_DEPTH = 64  # nesting levels (verl's resolved config: 6)


def read_file(path: str | pathlib.Path, framework: str | None = None) -> Any:
    """The config in a file, as a front door takes it: ``read_composed``, with the Hydra ``defaults`` entries it
    could not compose settled (``learner.rl.hydra_defaults.settle_defaults``; ``framework``: whose rules, recognised
    from the keys when None).

    >>> import tempfile, os
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     _ = pathlib.Path(folder, "run.sh").write_text("ARGS=(\\n  --eps-clip 0.2  # PPO\\n  --use-tis\\n)\\n")
    ...     read_file(os.path.join(folder, "run.sh"))
    ['--eps-clip', '0.2', '--use-tis']
    """
    return settle_defaults(read_composed(path), framework)


def read_composed(path: str | pathlib.Path) -> Any:
    """The config in a file: a mapping for a YAML file (composed; the ``defaults`` entries whose files are not in its
    folder left in ``defaults``) or a verl launch script (its Hydra overrides), the argument tokens (a list) for a
    slime launch script. A file with nothing to read raises, naming what was expected."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file.")
    if path.suffix in (".sh", ".bash"):
        return read_launch_script(_text(path), path)
    if path.suffix not in (".yaml", ".yml"):
        raise ValueError(f"{path}: give a .yaml file (verl, SkyRL, AReaL) or a launch script (.sh: verl's "
                         "python3 -m verl.trainer.main_ppo command, or slime's).")
    data = resolve_interpolations(_compose(path, package="", seen=()))
    if not data:
        raise ValueError(f"{path}: holds no keys; give the framework's config (a YAML mapping of its keys).")
    return data


def _text(path: pathlib.Path) -> str:
    """The file's text, refused beyond ``MAX_FILE_BYTES`` (read no further) or when it is not UTF-8 text."""
    with open(path, "rb") as file:
        data = file.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"{path}: larger than {MAX_FILE_BYTES >> 10} KiB, the limit for a framework config "
                         "(verl's whole resolved config is 20 KiB).")
    try:
        return data.decode()
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not a UTF-8 text file ({error.reason} at byte {error.start}).") from None


def _load_yaml(path: pathlib.Path) -> dict:
    import yaml  # a dependency of the run config's framework files only

    class BoundedLoader(yaml.SafeLoader):
        """PyYAML's safe loader that checks the composed document (aliases not yet expanded) before building it."""

        def get_single_node(self):
            node = super().get_single_node()
            if node is not None:
                _check_node_graph(node, path)
            return node

    try:
        data = yaml.load(_text(path), Loader=BoundedLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML ({' '.join(str(error).split())})") from None
    except RecursionError:  # PyYAML's composer recurses per level, before the check sees the document
        raise ValueError(f"{path}: nested more than {MAX_DEPTH} levels.") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: the file holds {type(data).__name__}, not a mapping of keys.")
    return nest(data, str(path))


def _check_node_graph(root, path: pathlib.Path) -> None:
    """Refuses a composed YAML document whose aliases make it recursive or larger than ``MAX_VALUES`` values once
    expanded, or that is nested deeper than ``MAX_DEPTH``; each node is sized once (an alias reuses its anchor's
    node), so the check is linear in the file."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node, depth: int) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in open_nodes:
            raise ValueError(f"{path}: line {node.start_mark.line + 1}: a recursive YAML alias (a value that holds "
                             "itself).")
        if depth > MAX_DEPTH:
            raise ValueError(f"{path}: line {node.start_mark.line + 1}: nested more than {MAX_DEPTH} levels.")
        open_nodes.add(id(node))
        children = node.value if isinstance(node.value, list) else []
        total = 1 + sum(size(part, depth + 1) for child in children
                        for part in (child if isinstance(child, tuple) else (child,)))
        open_nodes.discard(id(node))
        if total > MAX_VALUES:
            raise ValueError(f"{path}: more than {MAX_VALUES} values once its YAML aliases are expanded (an alias "
                             "bomb?); a framework config has a few hundred.")
        sizes[id(node)] = total
        return total

    size(root, 0)


def _compose(path: pathlib.Path, package: str, seen: tuple) -> dict:
    """The file's keys with its ``defaults`` merged in, in Hydra's order; unresolved entries stay in ``defaults``."""
    if path in seen:
        raise ValueError(f"{path}: its defaults include itself.")
    own = _load_yaml(path)
    entries = own.pop("defaults", None) or []
    if not isinstance(entries, list):
        raise ValueError(f"{path}: defaults must be a list, got {entries!r}.")
    if "_self_" not in entries:
        entries = [*entries, "_self_"]
    out: dict = {}
    unresolved = []
    for entry in entries:
        parsed = defaults_entry(entry)
        if parsed is None:
            out = merge(out, _at(own, ""))
            continue
        name, _, option = parsed
        file = path.parent / (f"{name}/{option}.yaml" if option is not None else f"{name}.yaml")
        if not file.is_file():
            unresolved.append(entry)
            continue
        target = entry_package(entry, package)
        relative = target[len(package):].lstrip(".") if target.startswith(package) else target
        out = merge(out, _at(_compose(file, target, seen + (path,)), relative))
    if unresolved:
        out["defaults"] = unresolved
    return out


def _at(data: dict, package: str) -> dict:
    for part in reversed([p for p in package.split(".") if p]):
        data = {part: data}
    return data


_INTERPOLATION = re.compile(r"\$\{([^${}]*)\}")


def resolve_interpolations(data: dict) -> dict:
    """``data`` with ``${a.b}``, ``${.sibling}``, ``${..uncle}`` and ``${oc.select:a.b,default}`` replaced by the
    values they name (a whole-string interpolation keeps the value's type); others are left as text.

    >>> resolve_interpolations({"a": {"n": 4, "m": "${.n}"}, "b": "${oc.select:a.n,1}", "c": "${oc.select:x.y,7}"})
    {'a': {'n': 4, 'm': 4}, 'b': 4, 'c': 7}
    """

    def lookup(path: list[str], node_path: tuple[str, ...]):
        if path and path[0] == "":  # relative: ${.x} is a sibling, ${..x} the parent's
            depth = 0
            while path and path[0] == "":
                path, depth = path[1:], depth + 1
            path = list(node_path[:len(node_path) - depth + 1]) + path
        node: Any = data
        for part in path:
            if not isinstance(node, Mapping) or part not in node:
                raise KeyError(part)
            node = node[part]
        return node

    def value_of(expression: str, node_path: tuple[str, ...], depth: int):
        if expression.startswith("oc.select:"):
            target, _, default = expression.removeprefix("oc.select:").partition(",")
            try:
                return resolve(lookup(target.strip().split("."), node_path), node_path, depth + 1)
            except KeyError:
                return _scalar(default.strip()) if default else None
        if ":" in expression:
            raise KeyError(expression)  # a resolver this reader does not run (oc.env, ...)
        return resolve(lookup(expression.strip().split("."), node_path), node_path, depth + 1)

    def resolve(value, node_path: tuple[str, ...], depth: int = 0):
        if depth > 20:
            raise ValueError(f"{'.'.join(node_path)}: interpolations loop.")
        if isinstance(value, Mapping):
            return {k: resolve(v, node_path + (str(k),), depth) for k, v in value.items()}
        if isinstance(value, list):
            return [resolve(v, node_path, depth) for v in value]
        if not isinstance(value, str) or "${" not in value:
            return value
        parent = node_path[:-1]
        whole = _INTERPOLATION.fullmatch(value)
        try:
            if whole:
                return value_of(whole.group(1), parent, depth)
            return _INTERPOLATION.sub(lambda m: str(value_of(m.group(1), parent, depth)), value)
        except KeyError:
            return value

    return resolve(data, ())


def _scalar(text: str):
    """A Hydra default value as YAML reads it (``1`` -> 1, ``null`` -> None, ``false`` -> False)."""
    import yaml

    return yaml.safe_load(text)
