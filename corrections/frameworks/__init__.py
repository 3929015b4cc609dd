"""The frameworks' own configs: readers of verl, SkyRL, slime and AReaL config blocks and files, and their key tables.

``from_verl``, ``from_skyrl``, ``from_slime`` and ``from_areal`` (and ``config_from_dict``) turn a framework's config
block into a `corrections.CorrectionConfig`; ``read_file`` reads their config files (a YAML file with its Hydra
composition, a verl or slime launch script). The training tables (``MAPS``, ``rows``, ...) say what each training
key of a file becomes in a Tether run: ``learner.rl.framework_config`` builds the run mapping from them.
"""

from corrections.frameworks._areal import from_areal
from corrections.frameworks._files import merge
from corrections.frameworks._files import read_file
from corrections.frameworks._from_dict import config_from_dict
from corrections.frameworks._keys import UnknownKeyWarning
from corrections.frameworks._skyrl import from_skyrl
from corrections.frameworks._slime import from_slime
from corrections.frameworks._slime import slime_arguments
from corrections.frameworks._training import BETAS
from corrections.frameworks._training import GRPO
from corrections.frameworks._training import MAPS
from corrections.frameworks._training import Row
from corrections.frameworks._training import TrainingKeysWarning
from corrections.frameworks._training import rows
from corrections.frameworks._training import whole
from corrections.frameworks._verl import from_verl
from corrections.frameworks._verl import verl_importance
from corrections.frameworks._verl import verl_rejection_rules

__all__ = [
    "BETAS",
    "GRPO",
    "MAPS",
    "Row",
    "TrainingKeysWarning",
    "UnknownKeyWarning",
    "config_from_dict",
    "from_areal",
    "from_skyrl",
    "from_slime",
    "from_verl",
    "merge",
    "read_file",
    "rows",
    "slime_arguments",
    "verl_importance",
    "verl_rejection_rules",
    "whole",
]
