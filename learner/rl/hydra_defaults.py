"""Hydra ``defaults`` lists: the entries' files, the package each entry fills, and the entries a composed config
still holds (their files were not in its folder), settled before the config goes to a front door.

A verl or SkyRL YAML as its users keep it names other files in ``defaults``; ``learner.rl.framework_files`` composes
those it finds. An entry left over that fills a block outside the loss is listed (``UnknownKeyWarning``) and
dropped; verl's stock entry for a loss block carries verl's defaults, which the front door fills in, and is dropped;
any other entry for a loss block is refused, naming the command that composes and resolves the config (a loss from
a file that was not read cannot be known). The front doors (``corrections.from_verl`` & co) take plain data and
refuse a ``defaults`` key.
"""

from __future__ import annotations

import pathlib
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from corrections.frameworks import UnknownKeyWarning, detect_framework, merge, nest

__all__ = ["HYDRA_COMMANDS", "LOSS_PACKAGES", "STOCK_DEFAULTS", "check_defaults", "defaults_entry", "entry_package",
           "hydra_command", "settle_defaults"]

HYDRA_COMMANDS = {
    "verl": "python -m verl.trainer.main_ppo --config-path {folder} --config-name {name} --cfg job --resolve "
            "> resolved.yaml",
    # SkyRL's YAMLs are legacy (its configs are dataclasses since #1684): Hydra's own compose API resolves them.
    "skyrl": "python -c \"from hydra import compose, initialize_config_dir; from omegaconf import OmegaConf; "
             "initialize_config_dir('{folder}', version_base=None); "
             "print(OmegaConf.to_yaml(compose('{name}'), resolve=True))\" > resolved.yaml",
}
# Entries of the frameworks' own config folders that fill the loss blocks: their values are the front door's
# defaults (verl 1dda039b; SkyRL's loss block is trainer.algorithm, filled by no entry of its own).
STOCK_DEFAULTS = {"verl": ({"actor@actor_rollout_ref.actor": "dp_actor"},
                           {"actor@actor_rollout_ref.actor": "megatron_actor"},
                           {"algorithm@algorithm.rollout_correction": "rollout_correction"}, "actor"),
                  "skyrl": ()}
# The packages that set the loss (verl's actor keys too: an entry filling actor_rollout_ref.actor touches its
# policy_loss).
LOSS_PACKAGES = {"verl": ("algorithm.rollout_correction", "actor_rollout_ref.actor.policy_loss"),
                 "skyrl": ("trainer.algorithm",)}
# Where a defaults list may be left in each framework's config: its dotted place -> (the package its entries fill
# relative to, the block named in messages).
PLACES = {"verl": {"defaults": ("", "verl"),
                   "actor_rollout_ref.actor.defaults": ("actor_rollout_ref.actor", "verl.actor_rollout_ref.actor"),
                   "actor.defaults": ("actor_rollout_ref.actor", "verl.actor_rollout_ref.actor")},
          "skyrl": {"defaults": ("", "skyrl")}}


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


def settle_defaults(data: Any, framework: str | None = None) -> Any:
    """``data`` (a composed config) without the ``defaults`` lists left in it, once each entry is checked
    (``check_defaults``); ``framework``: whose rules apply, recognised when None from the keys and the blocks the
    entries fill (``actor@actor_rollout_ref.actor`` is verl's). A framework without Hydra defaults (slime, AReaL),
    or data that is not a mapping, is returned as it is.

    >>> settle_defaults({"defaults": [{"actor@actor_rollout_ref.actor": "dp_actor"}, "_self_"],
    ...                  "actor_rollout_ref": {"actor": {"clip_ratio": 0.2}}})
    {'actor_rollout_ref': {'actor': {'clip_ratio': 0.2}}}
    """
    if not isinstance(data, Mapping) or not _holds_defaults(data):
        return data
    out = nest(data, framework or "config")  # a dotted key means the nested keys, as in the front doors
    framework = framework or detect_framework(merge(_filled(out.get("defaults")), out))
    for place, (package, where) in PLACES.get(framework, {}).items():
        *parents, leaf = place.split(".")
        parent = _block(out, parents)
        if parent is not None and leaf in parent:
            out, entries = _without(out, [*parents, leaf])
            check_defaults(entries, where, framework, STOCK_DEFAULTS[framework], LOSS_PACKAGES[framework], package)
    return out


def _holds_defaults(data: Mapping) -> bool:
    """Whether a ``defaults`` key is anywhere in ``data`` (dotted or nested)."""
    return any(str(key).rsplit(".", 1)[-1] == "defaults" or isinstance(value, Mapping) and _holds_defaults(value)
               for key, value in data.items())


def _filled(entries: Any) -> dict:
    """The blocks a top-level defaults list fills, empty (what they tell of the framework)."""
    if not isinstance(entries, list):
        return {}
    targets = (entry_package(entry, "") for entry in entries)
    return nest({target: {} for target in targets if target}, "defaults")


def _block(data: Mapping, parts: list[str]) -> Mapping | None:
    """The block at ``parts`` (None: not a block there)."""
    for part in parts:
        data = data.get(part)
        if not isinstance(data, Mapping):
            return None
    return data


def _without(data: Mapping, parts: list[str]) -> tuple[dict, Any]:
    """``data`` without the key at ``parts`` (the blocks on the way copied, ``data`` unchanged), and its value."""
    head, *rest = parts
    if not rest:
        return {key: value for key, value in data.items() if key != head}, data[head]
    inner, value = _without(data[head], rest)
    return {**data, head: inner}, value


def check_defaults(entries: Any, where: str, framework: str, stock: Iterable[Any], loss_packages: Iterable[str],
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
                      stacklevel=4)
