"""Reading another framework's configuration: dotted keys nested, every key checked against that framework's own
key names, an unknown key named with its nearest match, an unsupported value named with the reason.

A key the framework's reader does not know is an error in a block that sets the loss, and where it is close to a
key that sets the loss (a misspelt loss key would silently keep the default); elsewhere (a newer framework's key, a
section outside the loss) it is listed with an ``UnknownKeyWarning`` and not used.

A key the framework has that does not set the loss (batch sizes, optimizer, engine, advantages) is accepted and
not applied; a front door lists those its input gives in one ``TrainingKeysWarning`` per call.

Shared by the front doors ``from_verl``, ``from_skyrl``, ``from_slime`` and ``from_areal``.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

TYPO = 0.8  # difflib ratio above which an unknown key is taken for a misspelt loss key (clip_ratio_hgh: 0.97)


class UnknownKeyWarning(UserWarning):
    """A key a front door does not know and does not need for the loss: listed, not used. ``path``: the key with
    its block (``"verl.critic"``, ``"verl.actor_rollout_ref.actor.sum_pi_squared_checkpointing"``)."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path


class TrainingKeysWarning(UserWarning):
    """Keys of the framework's config that do not set the loss (batch sizes, optimizer, engine, advantages, ...),
    given to a front door, which returns the loss only: accepted and not applied. ``settings``: each key as the
    framework names it, dotted with its block (``actor_rollout_ref.actor.ppo_epochs``, slime's ``--lr``) -> its
    value."""

    def __init__(self, framework: str, settings: Mapping[str, Any]):
        super().__init__(f"{framework}: keys outside the loss are accepted and not applied (the config returned holds "
                         f"the loss only): {', '.join(settings)}.")
        self.framework = framework
        self.settings = dict(settings)


def ignored(block: Mapping[str, Any], keys: Iterable[str], prefix: str) -> dict[str, Any]:
    """The keys of ``block`` that are in ``keys`` (a front door's keys outside the loss), dotted under ``prefix``."""
    keys = set(keys)
    return {f"{prefix}{key}": value for key, value in block.items() if key in keys}


def warn_ignored(framework: str, settings: Mapping[str, Any]) -> None:
    """One ``TrainingKeysWarning`` listing ``settings`` (for the front door's caller); nothing when it is empty."""
    if settings:
        warnings.warn(TrainingKeysWarning(framework, settings), stacklevel=3)


def nearest(key: str, known: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The known key closest to ``key`` (difflib ratio >= ``cutoff``), or None when nothing is close.

    >>> nearest("clip_ratio_hgh", ["clip_ratio_high", "clip_ratio_low", "loss_agg_mode"])
    'clip_ratio_high'
    """
    matches = difflib.get_close_matches(key, sorted(known), n=1, cutoff=cutoff)
    return matches[0] if matches else None


def unknown_key(where: str, key: str, known: Iterable[str]) -> ValueError:
    """The error for a key that ``where`` does not have, naming the nearest match."""
    match = nearest(key, known)
    hint = f"did you mean {match!r}?" if match else f"known keys: {', '.join(sorted(known))}."
    return ValueError(f"{where}: unknown key {key!r}; {hint}")


def unsupported(where: str, key: str, value: Any, why: str) -> ValueError:
    """The error for a setting that has no Tether equivalent (yet)."""
    return ValueError(f"{where}.{key}={value!r} is not supported: {why}")


def nest(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``data`` with dotted keys (``"algorithm.rollout_correction.rollout_is"``, as on a Hydra command line)
    expanded into nested dicts; nested mappings are copied, and a key given twice is an error.

    >>> nest({"a.b": 1, "a": {"c": 2}}, "config")
    {'a': {'b': 1, 'c': 2}}
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a mapping of keys, got {type(data).__name__}.")
    out: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise ValueError(f"{where}: keys must be strings, got {key!r}.")
        *parents, leaf = key.split(".")
        node, path = out, where
        for part in parents:
            path = f"{path}.{part}"
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"{path} is given both as a value and as a section.")
        if isinstance(value, Mapping):
            value = nest(value, f"{path}.{leaf}")
            if isinstance(node.get(leaf), dict):
                value = merge_disjoint(node[leaf], value, f"{path}.{leaf}")
        elif leaf in node:
            raise ValueError(f"{path}.{leaf} is given twice.")
        node[leaf] = value
    return out


def merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Hydra's (and the presets') merge: mappings merge key by key, anything else replaces; the inputs are not
    changed (their values are shared, not copied).

    >>> merge({"a": {"b": 1, "c": 2}, "d": 3}, {"a": {"b": 4}, "d": {"e": 5}})
    {'a': {'b': 4, 'c': 2}, 'd': {'e': 5}}
    """
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def merge_disjoint(first: Mapping[str, Any], second: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The union of two nested dicts that must not set the same leaf."""
    out = dict(first)
    for key, value in second.items():
        if key in out and isinstance(out[key], dict) and isinstance(value, dict):
            out[key] = merge_disjoint(out[key], value, f"{where}.{key}")
        elif key in out:
            raise ValueError(f"{where}.{key} is given twice.")
        else:
            out[key] = value
    return out


def check_keys(block: Mapping[str, Any], known: Iterable[str], where: str, read: Iterable[str] | None = None) -> None:
    """Checks the keys of ``block`` against ``known`` (Hydra's ``_target_`` is always allowed). ``read``: the keys
    that set the loss; an unknown key raises when ``read`` is None (the whole block sets the loss) or the key is
    close to one of them, and is otherwise listed (``UnknownKeyWarning``)."""
    known = set(known) | {"_target_"}
    for key in block:
        if key not in known:
            unknown(where, key, known - {"_target_"}, read)


def unknown(where: str, key: str, known: Iterable[str], read: Iterable[str] | None) -> None:
    """Raises for an unknown key that may set the loss (see ``check_keys``); warns for any other."""
    if read is None or nearest(key, read, cutoff=TYPO) is not None:
        raise unknown_key(where, key, known)
    warnings.warn(UnknownKeyWarning(f"{where}.{key}", "not a key this reader knows; not used."), stacklevel=3)


def defaults_refused(where: str) -> ValueError:
    """The error for a Hydra ``defaults`` list in a block: files to compose, which a front door (plain data) does
    not read."""
    return ValueError(f"{where}.defaults: a Hydra defaults list (files to compose) is not read here; read the file "
                      "with learner.rl.framework_files.read_file (which composes its files and checks the entries "
                      "left), or pass the resolved config.")


def section(value: Any, where: str) -> dict[str, Any]:
    """A nested block that must be a mapping (None, as YAML writes an empty block, reads as {})."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a mapping of keys, got {value!r}.")
    return dict(value)


def choice(where: str, key: str, value: Any, mapping: Mapping[Any, T], why: Mapping[Any, str] | None = None) -> T:
    """``mapping[value]``; a value with a reason in ``why`` is unsupported, any other value unknown."""
    if value in mapping:
        return mapping[value]
    if why and value in why:
        raise unsupported(where, key, value, why[value])
    options = ", ".join(repr(option) for option in mapping)
    raise ValueError(f"{where}.{key}={value!r} is not an option; use one of {options}.")
