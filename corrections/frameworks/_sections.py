"""Where a framework's keys sit in its whole config: a flat block (one section's keys, as a front door also takes
them) nested where it belongs, so that a key reads the same given either way."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from corrections.frameworks._verl_keys import ROLLOUT_CORRECTION

# The top-level sections of each framework's whole config (slime's arguments are flat).
SECTIONS = {"verl": ("algorithm", "actor_rollout_ref", "data", "trainer"), "skyrl": ("trainer", "generator"),
            "slime": None, "areal": ("actor", "gconfig", "train_dataset")}


def _verl(data: Mapping[str, Any]) -> dict[str, Any]:
    return {"algorithm": {"rollout_correction": {k: v for k, v in data.items() if k in ROLLOUT_CORRECTION}},
            "actor_rollout_ref": {"actor": {k: v for k, v in data.items() if k not in ROLLOUT_CORRECTION}}}


NESTS: Mapping[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "verl": _verl, "skyrl": lambda data: {"trainer": {"algorithm": data}}, "areal": lambda data: {"actor": data},
}


def whole(framework: str, data: Mapping[str, Any]) -> Mapping[str, Any]:
    """``data`` as the framework's whole config: a flat block (one section's keys) nested where it belongs.

    >>> whole("verl", {"rollout_is": "token", "clip_ratio": 0.2})
    {'algorithm': {'rollout_correction': {'rollout_is': 'token'}}, 'actor_rollout_ref': {'actor': {'clip_ratio': 0.2}}}
    >>> whole("skyrl", {"trainer": {"epochs": 1}})
    {'trainer': {'epochs': 1}}
    """
    sections = SECTIONS[framework]
    if sections is None or any(section in data for section in sections):
        return data
    return NESTS[framework](dict(data))
