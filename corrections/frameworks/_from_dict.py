"""``config_from_dict`` that also reads verl, SkyRL, slime and AReaL config blocks verbatim.

A mapping goes to the front door of the framework it comes from: explicitly under one key ``verl``, ``skyrl``,
``slime`` or ``areal``, or recognised by its keys (each framework's section names and key names; slime's
``--dashed-flags``). Tether's own nested form (``mode``, ``objective``, ``importance``, ...) goes to the plain
parser. Keys that fit several frameworks equally (``eps_clip`` is slime's and AReaL's) raise, asking for the
explicit form.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from corrections import _config
from corrections.frameworks import _areal, _skyrl, _slime, _verl, _verl_keys
from corrections.frameworks._keys import nearest, nest

FRONT_DOORS: Mapping[str, Callable[..., _config.CorrectionConfig]] = {
    "verl": _verl.from_verl, "skyrl": _skyrl.from_skyrl, "slime": _slime.from_slime, "areal": _areal.from_areal,
}
# The top-level keys each front door reads (a dotted key is recognised by its first part).
TOP_LEVEL_KEYS = {
    "verl": {"algorithm", "actor_rollout_ref", "rollout_correction", "actor"} | set(_verl_keys.ROLLOUT_CORRECTION)
    | set(_verl_keys.ACTOR) | _verl_keys.ACTOR_IGNORED,
    "skyrl": {"trainer", "algorithm"} | set(_skyrl.ALGORITHM) | _skyrl.ALGORITHM_IGNORED,
    "slime": set(_slime.ARGUMENTS) | _slime.IGNORED,
    "areal": {"actor"} | set(_areal.ACTOR) | _areal.IGNORED,
}
NATIVE_KEYS = frozenset(field.name for field in dataclasses.fields(_config.CorrectionConfig))


def _top(key: str) -> str:
    return key.split(".", 1)[0]


def detect_framework(data: Mapping[str, Any]) -> str | None:
    """The framework a config mapping comes from, or None for Tether's own form.

    >>> detect_framework({"algorithm": {"rollout_correction": {"rollout_is": "token"}}})
    'verl'
    >>> detect_framework({"trainer": {"algorithm": {"policy_loss_type": "regular"}}})
    'skyrl'
    >>> detect_framework({"--use-tis": True}), detect_framework({"actor": {"use_decoupled_loss": True}})
    ('slime', 'areal')
    >>> detect_framework({"importance": {"level": "token"}}) is None
    True
    """
    keys = [_top(str(key)) for key in data]
    if all(key in NATIVE_KEYS for key in keys):
        return None
    if any(str(key).startswith("--") for key in data):
        return "slime"
    data = nest(data, "config")
    names = [key.replace("-", "_") for key in data]
    if "actor_rollout_ref" in names:  # verl's alone (its algorithm block may come from Hydra defaults)
        return "verl"
    if "actor" in names:  # verl's flat "actor" section and AReaL's: verl's actor has loss_agg_mode and clip_ratio*
        actor = data.get("actor")
        if not isinstance(actor, Mapping):
            return "areal"
        verl_like = any(k in _verl_keys.ACTOR or k in _verl_keys.ACTOR_IGNORED for k in actor)
        return "verl" if verl_like and not any(k in _areal.ACTOR for k in actor) else "areal"
    if "algorithm" in names:  # verl's algorithm holds rollout_correction; SkyRL's holds policy_loss_type & co
        algorithm = data.get("algorithm")
        if isinstance(algorithm, Mapping) and "rollout_correction" in algorithm:
            return "verl"
        return "skyrl"
    fits = [name for name, known in TOP_LEVEL_KEYS.items() if all(key in known for key in names)]
    if len(fits) > 1:
        raise ValueError(f"config: keys {', '.join(sorted(names))} fit {' and '.join(fits)}; wrap them as "
                         f"{{{fits[0]!r}: {{...}}}} to say which.")
    if fits:
        return fits[0]
    if any(key in NATIVE_KEYS for key in keys):
        return None  # Tether's own form with a wrong key: its parser names the field
    best = max(TOP_LEVEL_KEYS, key=lambda name: sum(key in TOP_LEVEL_KEYS[name] for key in names))
    return best if any(key in TOP_LEVEL_KEYS[best] for key in names) else None


def config_from_dict(data: Mapping[str, Any]) -> _config.CorrectionConfig:
    """Builds a validated ``CorrectionConfig`` from nested plain data: Tether's own form (see
    ``config_to_dict``), or a verl, SkyRL, slime or AReaL config block as that framework writes it (routed to
    ``from_verl``, ``from_skyrl``, ``from_slime``, ``from_areal``; give it under one key ``"verl"``, ``"skyrl"``,
    ``"slime"`` or ``"areal"`` to say which).

    >>> config_from_dict({"importance": {"level": "token", "high": 2.0}}).importance.high
    2.0
    >>> config_from_dict({"algorithm": {"rollout_correction": {"rollout_is": "token"}}}).denominator
    'kept'
    >>> config_from_dict({"slime": {"--use-tis": True}}).importance.high
    2.0
    >>> config_from_dict({"algorithm": {"policy_loss_typ": "regular"}})
    Traceback (most recent call last):
    ...
    ValueError: skyrl.trainer.algorithm: unknown key 'policy_loss_typ'; did you mean 'policy_loss_type'?
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"config must be a mapping of fields, got {type(data).__name__}.")
    if len(data) == 1 and next(iter(data)) in FRONT_DOORS:
        ((name, block),) = data.items()
        return FRONT_DOORS[name](block)
    framework = detect_framework(data)
    if framework is not None:
        return FRONT_DOORS[framework](data)
    try:
        return _config.config_from_dict(data)
    except ValueError as error:
        unknown = [_top(str(key)) for key in data if _top(str(key)) not in NATIVE_KEYS]
        known = NATIVE_KEYS.union(*TOP_LEVEL_KEYS.values())
        match = nearest(unknown[0], known) if unknown else None
        if match is None:
            raise
        owners = [name for name, keys in TOP_LEVEL_KEYS.items() if match in keys] or ["Tether"]
        raise ValueError(f"{error} For {unknown[0]!r}, did you mean {match!r} ({', '.join(owners)})?") from None
