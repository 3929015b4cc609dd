"""The frameworks' own config blocks: verl, SkyRL, slime and AReaL settings read into a loss config.

``from_verl``, ``from_skyrl``, ``from_slime`` and ``from_areal`` (and ``config_from_dict``) turn a framework's
config block (plain data: a mapping, dotted keys, slime's command line) into a `corrections.CorrectionConfig`,
checking every key against the framework's own names; ``detect_framework`` says which framework a block is.
Reading their files (YAML with its Hydra composition and ``defaults`` lists, launch scripts) and what their
training keys become in a Tether run are the learner's: ``learner.rl.framework_files``,
``learner.rl.hydra_defaults``, ``learner.rl.framework_keys``; a front door refuses a block that still holds a
Hydra ``defaults`` list. ``nest``, ``merge`` and ``whole`` are the block helpers those share with the front doors.
"""

from corrections.frameworks._areal import from_areal
from corrections.frameworks._from_dict import config_from_dict
from corrections.frameworks._from_dict import detect_framework
from corrections.frameworks._keys import TrainingKeysWarning
from corrections.frameworks._keys import UnknownKeyWarning
from corrections.frameworks._keys import merge
from corrections.frameworks._keys import nest
from corrections.frameworks._sections import whole
from corrections.frameworks._skyrl import from_skyrl
from corrections.frameworks._slime import from_slime
from corrections.frameworks._slime import slime_arguments
from corrections.frameworks._verl import from_verl
from corrections.frameworks._verl import verl_importance
from corrections.frameworks._verl import verl_rejection_rules

__all__ = [
    "TrainingKeysWarning",
    "UnknownKeyWarning",
    "config_from_dict",
    "detect_framework",
    "from_areal",
    "from_skyrl",
    "from_slime",
    "from_verl",
    "merge",
    "nest",
    "slime_arguments",
    "verl_importance",
    "verl_rejection_rules",
    "whole",
]
