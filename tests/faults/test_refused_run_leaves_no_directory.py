"""A run refused at its start (here a task argument its task does not take) leaves no run directory holding only its
lock file; a directory that existed before is kept, as is anything else the start wrote."""

import json

import pytest

from learner.rl import Run, load_config
from learner.rl.preflight import ConfigError
from tests.e2e.test_main_job import DEFAULT_CONFIG


def _refused(run_dir) -> None:
    config = load_config(DEFAULT_CONFIG, [f"run_dir={json.dumps(str(run_dir))}", "task.args={n=1}"])
    with pytest.raises(ConfigError, match="task.args: addition_1digit"):
        with Run(config):
            pass


def test_a_refused_fresh_run_leaves_no_directory_and_an_existing_one_is_kept(tmp_path):
    _refused(tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()
    (tmp_path / "existing").mkdir()
    _refused(tmp_path / "existing")
    assert (tmp_path / "existing").is_dir()
