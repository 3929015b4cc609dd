"""Hostile framework config files (``corrections.from_verl = "path"`` & co, ``read_file``) are refused
with one error naming the file and the limit: a YAML alias bomb (9 levels of 9 aliases: 9**9 values once expanded,
which ran for minutes), a recursive alias (a 2,980-line RecursionError), a file over the size cap, nesting deeper
than the cap. Real files; through ``python -m learner.train`` as one ``error:`` line (a real subprocess each)."""

from __future__ import annotations

import re
import sys

import pytest

from learner.rl.framework_files import MAX_DEPTH, MAX_FILE_BYTES, MAX_VALUES, read_file
from tests.e2e.test_main_job import DEFAULT_CONFIG
from tests.faults.test_error_lines import error_line


def alias_bomb() -> str:
    lines = ["a0: &a0 [" + ", ".join(["lol"] * 9) + "]"]
    lines += [f"a{level}: &a{level} [" + ", ".join([f"*a{level - 1}"] * 9) + "]" for level in range(1, 9)]
    return "\n".join(lines) + "\n"


FILES = {
    "alias bomb": (alias_bomb(), rf"more than {MAX_VALUES} values once its YAML aliases are expanded"),
    "recursive alias in a list": ("a: &a [1, *a]\n", r"line 1: a recursive YAML alias \(a value that holds itself\)"),
    "recursive alias in a mapping": ("actor_rollout_ref:\n  actor: &a\n    optim: *a\n",
                                     r"line 2: a recursive YAML alias"),
    "over the size cap": ("a: 1\n" + "#" * MAX_FILE_BYTES + "\n", rf"larger than {MAX_FILE_BYTES >> 10} KiB"),
    "nested past the cap": ("a: " + "[" * (MAX_DEPTH + 2) + "]" * (MAX_DEPTH + 2) + "\n",
                            rf"line 1: nested more than {MAX_DEPTH} levels"),
    "nested past the parser": ("a: " + "[" * 1000 + "]" * 1000 + "\n", rf"nested more than {MAX_DEPTH} levels"),
}


@pytest.mark.parametrize("case", FILES)
def test_a_hostile_file_is_one_error_naming_the_file(tmp_path, case):
    text, message = FILES[case]
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"^{path}: {message}"):
        read_file(path)


def test_a_launch_script_nested_past_the_parser_is_one_error(tmp_path):
    path = tmp_path / "run.sh"
    path.write_text('A="' + '$(echo "' * 5000 + 'x' + '")' * 5000 + '"\n')
    with pytest.raises(ValueError, match=rf"^{path}: quotes or \$\(\.\.\.\) nested too deeply to read"):
        read_file(path)


def test_a_huge_launch_script_is_refused_unread(tmp_path):
    path = tmp_path / "run.sh"
    path.write_text("python3 -m verl.trainer.main_ppo \\\n" + "  a.b=1 \\\n" * (MAX_FILE_BYTES // 8))
    with pytest.raises(ValueError, match=rf"^{path}: larger than {MAX_FILE_BYTES >> 10} KiB"):
        read_file(path)


# The CLI's path is the same for every limit (a ValueError naming the file: one error line); the bomb runs by
# default, the other limits in the slow suite (a subprocess each, ~5 s on a loaded 2-core machine).
@pytest.mark.parametrize("case", ["alias bomb", pytest.param("recursive alias in a mapping", marks=pytest.mark.slow),
                                  pytest.param("over the size cap", marks=pytest.mark.slow)])
def test_the_cli_prints_one_error_line(tmp_path, case):
    text, message = FILES[case]
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    line = error_line([sys.executable, "-m", "learner.train", "--config", str(DEFAULT_CONFIG),
                       "--set", f'run_dir="{tmp_path}/run"', "--set", f"corrections.from_verl='{path}'"])
    assert line.startswith(f"error: corrections.from_verl='{path}': {path}: "), line
    assert re.search(message, line), line
