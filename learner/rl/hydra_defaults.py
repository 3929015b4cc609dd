"""Hydra ``defaults`` lists left in a config block: the package each entry fills, and whether the front door can
take the block without the files they name.

A verl YAML as its users keep it (``yaml.safe_load`` of ``ppo_trainer.yaml``, or a file whose composition could
not read every entry) still holds ``defaults``. An entry that fills a block outside the loss is listed; a
framework's stock entry for a loss block carries the framework's defaults, which the front door fills in; any other
entry for a loss block is refused, naming the command that composes and resolves the config (a loss from a file
that was not read cannot be known). Composing the files is the file reader's (``learner.rl.framework_files``).
"""

from __future__ import annotations

import pathlib
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from corrections.frameworks._keys import UnknownKeyWarning

HYDRA_COMMANDS = {
    "verl": "python -m verl.trainer.main_ppo --config-path {folder} --config-name {name} --cfg job --resolve "
            "> resolved.yaml",
    # SkyRL's YAMLs are legacy (its configs are dataclasses since #1684): Hydra's own compose API resolves them.
    "skyrl": "python -c \"from hydra import compose, initialize_config_dir; from omegaconf import OmegaConf; "
             "initialize_config_dir('{folder}', version_base=None); "
             "print(OmegaConf.to_yaml(compose('{name}'), resolve=True))\" > resolved.yaml",
}


def hydra_command(framework: str, path: str = "DIR/NAME.yaml") -> str:
    """The command that composes and resolves a framework's Hydra config (what to run when a file's ``defaults``
    name files that were not read)."""
    path = pathlib.PurePath(path)
    template = HYDRA_COMMANDS.get(framework, HYDRA_COMMANDS["verl"])
    return template.format(folder=path.parent, name=path.stem)


def defaults_entry(entry: Any) -> tuple[str, str | None, str | None] | None:
    """A defaults entry as (group or config path, package or None, option or None); None for ``_self_``.

    >>> defaults_entry({"override actor@actor_rollout_ref.actor": "dp_actor"}), defaults_entry("_self_")
    (('actor', 'actor_rollout_ref.actor', 'dp_actor'), None)
    """
    if entry == "_self_":
        return None
    if isinstance(entry, str):
        name, _, package = entry.partition("@")
        return name, package or None, None
    if isinstance(entry, Mapping) and len(entry) == 1:
        ((key, option),) = entry.items()
        name, _, package = str(key).removeprefix("override ").partition("@")
        return name, package or None, None if option is None else str(option)
    raise ValueError(f"defaults: {entry!r} is not a Hydra defaults entry.")


def entry_package(entry: Any, package: str) -> str | None:
    """The package (dotted key) a defaults entry fills, inside a config at ``package``; None for ``_self_``.

    >>> entry_package({"actor@actor_rollout_ref.actor": "dp_actor"}, ""), entry_package("actor", "a.b")
    ('actor_rollout_ref.actor', 'a.b')
    >>> entry_package({"../optim@optim": "fsdp"}, "actor_rollout_ref.actor"), entry_package({"data": "x"}, "")
    ('actor_rollout_ref.actor.optim', 'data')
    """
    parsed = defaults_entry(entry)
    if parsed is None:
        return None
    name, own, option = parsed
    relative = own if own is not None else (name.rsplit("/", 1)[-1] if option is not None else "")
    return ".".join(part for part in (package, relative) if part)


def check_defaults(entries: Any, where: str, framework: str, stock: Iterable[str], loss_packages: Iterable[str],
                   package: str = "") -> None:
    """Hydra ``defaults`` left in a config (their files were not composed): an entry that fills a package outside
    the loss is listed; one that fills a loss package must be the framework's stock entry (whose values the front
    door takes as its defaults), else the composition is refused, naming the command that resolves it."""
    if not isinstance(entries, list):
        raise ValueError(f"{where}.defaults must be a Hydra defaults list, got {entries!r}.")
    stock = {repr(entry) for entry in stock}
    for entry in entries:
        target = entry_package(entry, package)
        if target is None or repr(entry) in stock:
            continue
        touches = [p for p in loss_packages if not target or p == target or p.startswith(f"{target}.")
                   or target.startswith(f"{p}.")]
        if touches:
            raise ValueError(f"{where}.defaults: {entry!r} composes {target or 'the whole config'} (which sets the "
                             f"loss) from a file that was not read; compose and resolve the config first: "
                             f"{hydra_command(framework)}")
        warnings.warn(UnknownKeyWarning(f"{where}.defaults", f"{entry!r} fills {target}, outside the loss; not used."),
                      stacklevel=2)
