"""A verl, SkyRL, slime or AReaL config file (a YAML file, a verl or slime launch script) as a Tether run
(``corrections.from_verl = "path.yaml"`` & co).

The loss comes from the framework's front door (``corrections.from_verl``, ...), unchanged. The settings that change
training and that Tether has elsewhere (epochs, mini-batches, optimizer and schedule, gradient clipping, samples per
prompt, temperature, top-p, top-k, batch and completion sizes) become run-config keys; settings that change training
but have no Tether equivalent are listed "not applied" with the reason; everything else "not used". Every key of the
file gets one row: their key, their value, Tether's key or what happened to it (`Migration.table`). The file is read
by ``learner.rl.framework_files``, and the tables of what each key becomes are ``learner.rl.framework_keys``'. A
mapped key the file leaves out takes the framework's default where the tables have it (verl, SkyRL), as the framework
would train; its row says so.

Precedence (``load_config``): the TOML file < the framework file (with its framework's defaults) < ``--set``. A value
Tether refuses names each run-config key involved and where it came from (``clash``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import pathlib
import re
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import corrections
from corrections.frameworks import TrainingKeysWarning, UnknownKeyWarning, merge, slime_arguments, whole
from learner.reporting.run_files import write_atomically
from learner.rl.framework_files import read_composed
from learner.rl.framework_keys import MAPS, Row, rows
from learner.rl.hydra_defaults import settle_defaults

FROM_KEYS = {"from_verl": "verl", "from_skyrl": "skyrl", "from_slime": "slime", "from_areal": "areal"}


@dataclasses.dataclass(frozen=True)
class Migration:
    """A framework file read for a run: the loss config, the run-config values, and one row per key."""

    framework: str
    path: str
    corrections: corrections.CorrectionConfig
    run: Mapping[str, Any]  # run-config key ("update.ppo_epochs") -> value
    rows: tuple[Row, ...]

    def table(self) -> str:
        """The mapping as a tab-separated table with a header (what the run prints and writes)."""
        lines = [f"# {self.framework} config {self.path}", "their key\ttheir value\tTether"]
        lines += [f"{row.key}\t{_show(row.value)}{DEFAULT_NOTE.format(self.framework) if row.default else ''}\t"
                  f"{row.tether}" for row in self.rows]
        return "\n".join(lines) + "\n"

    def source(self, run_key: str) -> Row | None:
        """The row of the file's key that set a run-config key (None: the file does not set it)."""
        return next((row for row in self.rows if row.tether == run_key), None)


DEFAULT_NOTE = " ({}'s default: not in the file)"


def _show(value) -> str:
    if isinstance(value, Mapping):
        return f"{{{len(value)} keys}}"
    return repr(value)


@functools.lru_cache(maxsize=16)
def migrate(framework: str, path: str) -> Migration:
    """Reads a framework's config file (as ``learner.rl.framework_files.read_file`` does) into a ``Migration``; the
    Hydra ``defaults`` entries left in it have one row.

    >>> import pathlib
    >>> root = pathlib.Path(__file__).parents[2] / "tests" / "fixtures" / "frameworks"
    >>> m = migrate("verl", str(root / "verl" / "_generated_ppo_trainer.yaml"))
    >>> m.run["optimizer.learning_rate"], m.run["update.num_minibatches"], m.corrections.denominator
    (1e-06, 4, 'kept')
    """
    if framework not in MAPS:
        raise ValueError(f"framework {framework!r}: use one of {', '.join(MAPS)}.")
    try:
        data = read_composed(path)
    except ValueError as error:  # no such file, not a config file, not valid YAML
        raise ValueError(f"corrections.from_{framework}={path!r}: {error}") from None
    if framework == "slime":
        if not isinstance(data, list):  # a YAML file or a verl launch script
            raise ValueError(f"corrections.from_slime={path!r}: not a slime launch script; give a YAML file or a verl "
                             "launch script to its own key (corrections.from_verl, ...).")
        data = slime_arguments(data)
    elif not isinstance(data, Mapping):
        raise ValueError(f"corrections.from_{framework}={path!r}: a slime launch script; use corrections.from_slime.")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnknownKeyWarning)
        warnings.simplefilter("ignore", TrainingKeysWarning)  # for direct calls: the run's rows say what they become
        try:
            config = getattr(corrections, f"from_{framework}")(settle_defaults(data, framework))
        except ValueError as error:
            raise ValueError(f"corrections.from_{framework}={path!r}: {error}") from None
    unknown = {w.message.path.split(".", 1)[1] for w in caught if isinstance(w.message, UnknownKeyWarning)}
    try:
        table, run = rows(framework, whole(framework, data), unknown, defaults=True)
    except ValueError as error:
        raise ValueError(f"corrections.from_{framework}={path!r}: {error}") from None
    return Migration(framework, str(path), config, run, tuple(table))


def clash(message: str, framework: str, path: str, sections: Iterable[str]) -> str:
    """A run-config error once the framework file's values are in, naming where each run-config key in it comes
    from: the file's key (or the framework's default) that set it, or the run config (the TOML file, ``--set``)."""
    migration = migrate(framework, path)
    named = {key: migration.source(key) for key in re.findall(rf"\b(?:{'|'.join(sections)})(?:\.\w+)+", message)}
    from_file = [f"{key} from {row.key}={row.value!r}" + (f" ({framework}'s default)" if row.default else "")
                 for key, row in named.items() if row is not None]
    if not from_file:
        return (f"{message} (with corrections.from_{framework}={path!r}, which sets {', '.join(migration.run)}; --set "
                "a key to replace its value)")
    from_run_config = [key for key, row in named.items() if row is None]
    also = f"; the run config sets {', '.join(from_run_config)}" if from_run_config else ""
    return (f"{message} (corrections.from_{framework}={path!r} sets {', '.join(from_file)}{also}; --set a key to "
            "replace its value)")


def framework_file(section: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(framework, path)`` of the ``corrections`` section's ``from_<framework>`` key (plain data or the section);
    None without one; two of them are an error."""
    get = section.get if isinstance(section, Mapping) else lambda key: getattr(section, key, None)
    given = [(framework, get(key)) for key, framework in FROM_KEYS.items() if get(key) is not None]
    if len(given) > 1:
        raise ValueError(f"corrections: {' and '.join(f'from_{name}' for name, _ in given)} are both set; give one "
                         "framework config.")
    if given and not isinstance(given[0][1], str):
        raise ValueError(f"corrections.from_{given[0][0]}={given[0][1]!r}: give the path of the config file.")
    return given[0] if given else None


def corrections_name(section) -> str:
    """What the run's loss is, for its summary: the preset's name, or ``from_<framework>=<path>``."""
    given = framework_file(section)
    return section.preset if given is None else f"from_{given[0]}={given[1]}"


def with_framework_file(data: dict, framework: str, path: str) -> dict:
    """The run config's plain data with a framework file's run settings written over it; the file's loss replaces
    the data's ``corrections.preset`` and ``overrides`` (``--set`` given afterwards still wins)."""
    out = copy.deepcopy(data)
    section = out.setdefault("corrections", {})
    section.pop("preset", None)
    section.pop("overrides", None)
    for key, value in migrate(framework, str(path)).run.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def correction_config(section) -> corrections.CorrectionConfig:
    """The loss of the section's framework file, with the section's ``overrides`` merged as a preset's are."""
    framework, path = framework_file(section)
    config = migrate(framework, str(path)).corrections
    if not section.overrides:
        return config
    return corrections.config_from_dict(merge(corrections.config_to_dict(config), section.overrides))


def _flat(data: Mapping, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``{dotted key: leaf}`` (a mapping of no keys is a leaf)."""
    out = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _fields(target: str) -> list[str]:
    """The CorrectionConfig fields a table's target names: ``objective.clip_low/high`` -> ``objective.clip_low``,
    ``objective.clip_high``; ``rejection (bounds)`` -> ``rejection``."""
    head, _, names = target.split(" ")[0].rpartition(".")
    first, *others = names.split("/")
    stem = first.rpartition("_")[0]
    return [f"{head}.{name}" if head else name for name in (first, *(f"{stem}_{o}" if stem else o for o in others))]


def _source(field: str, migration: Migration, overridden: Iterable[str]) -> str:
    """Where one field of the loss came from: ``corrections.overrides``, the file's key(s), the framework's default
    (a loss key the file leaves out), or the front door's own value (a field no key of the framework sets, such as
    verl's ``denominator = "kept"``)."""
    if any(field == key or field.startswith(f"{key}.") for key in overridden):
        return "corrections.overrides (the run config)"

    def covering(target: str) -> int:  # how specifically the target names the field (0: not at all); a field that
        # is a whole block left unset (importance: none) is named by the targets inside it
        names = _fields(target)
        inside = len(field) if any(name.startswith(f"{field}.") for name in names) else 0
        return max([len(name) for name in names if field == name or field.startswith(f"{name}.")] + [inside])

    rows = [(covering(row.tether.removeprefix("corrections.")), row) for row in migration.rows
            if row.tether.startswith("corrections.")]
    best = max((score for score, _ in rows), default=0)
    if best:
        return ", ".join(f"{row.key}" + (f" ({migration.framework}'s default)" if row.default else "")
                         for score, row in rows if score == best)
    theirs = [(covering(target), key) for key, target in MAPS[migration.framework].loss.items()]
    best = max((score for score, _ in theirs), default=0)
    if best:
        keys = ", ".join(key for score, key in theirs if score == best)
        return f"{migration.framework}'s default ({keys}: not in the file)"
    return f"from_{migration.framework}'s value (no {migration.framework} key sets it)"


def loss_table(section) -> str:
    """The loss the run built (`correction_config`: the file's, with ``corrections.overrides``) as a tab-separated
    table: every ``CorrectionConfig`` field, its value and where it came from."""
    framework, path = framework_file(section)
    migration = migrate(framework, str(path))
    overridden = list(_flat(dict(section.overrides or {})))
    lines = ["# the loss this run built (corrections.CorrectionConfig)", "field\tvalue\tsource"]
    for field, value in _flat(corrections.config_to_dict(correction_config(section))).items():
        lines.append(f"{field}\t{'none' if value in (None, [], {}) else _show(value)}\t"
                     f"{_source(field, migration, overridden)}")
    return "\n".join(lines) + "\n"


MAPPING_FILE = "framework_config.tsv"


def _run_target(framework: str, key: str) -> str | None:
    """The run-config key a framework key maps to (None: it maps to none)."""
    entry = MAPS[framework].run.get(key.removeprefix("--").replace("-", "_") if framework == "slime" else key)
    return entry[0] if isinstance(entry, tuple) else entry


def _run_value(config, key: str):
    section, _, field = key.partition(".")
    return getattr(getattr(config, section), field)


def report(section, run_dir, config=None) -> None:
    """Prints the mapping of the section's framework file and the loss it built, and writes both to
    ``run_dir/framework_config.tsv``; nothing without one. With the run's ``config``, a run-config key whose file
    value was not applied is listed with the value the run uses."""
    given = framework_file(section)
    if given is None:
        return
    migration = migrate(*given)
    table = migration.table() + loss_table(section)
    if config is not None:
        table += "".join(f"# {row.key} not applied: the run uses {key} = {_run_value(config, key)!r}\n"
                         for row in migration.rows if row.tether.startswith("not applied")
                         for key in [_run_target(migration.framework, row.key)] if key)
    print(table, end="", flush=True)
    write_atomically(pathlib.Path(run_dir) / MAPPING_FILE, table)
