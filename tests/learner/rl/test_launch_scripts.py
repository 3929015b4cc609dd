"""verl launch scripts read as the shell runs them: the arguments of their ``python3 -m verl.trainer.main_ppo``
command are compared with what a real bash passes (``python3`` replaced by a function that prints its arguments),
on verl's own scripts (tests/fixtures/frameworks/verl/examples, README there) and on snippets of each shell form
the reader follows; then read as Hydra reads them."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

from learner.rl.framework_files import read_file
from learner.rl.launch_scripts import hydra_value, verl_arguments

VERL = pathlib.Path(__file__).parents[2] / "fixtures" / "frameworks" / "verl" / "examples"
# bash with python3 printing its arguments (NUL-separated) and stopping the script; $HOME is the text "$HOME", as
# the reader keeps a variable the script does not set.
STUB = 'python3() { printf "%s\\0" "$@"; exit 0; }\n'
SNIPPETS = {
    "quotes and continuations": "python3 -m verl.trainer.main_ppo \\\n  a.b='x y' \\\n  c.d=\"q'r\" e.f=g\\ h # c\n",
    "variables and defaults": 'N=5\nexport LR=1e-6\nT=${T:-0.7}\nU=${N:-9}\nE=${EMPTY:-}\nS=${N:+"-set"}${Z:+"-z"}\n'
                              "python3 -m verl.trainer.main_ppo x.n=$N x.lr=${LR} x.t=$T x.u=$U x.e=$E x.s=$S "
                              "x.home=$HOME/data\n",
    "arithmetic": "A=1024\nB=$((A * 2))\nC=$(((A + B) / 3 % 7))\npython3 -m verl.trainer.main_ppo x.b=$B x.c=$C "
                  "x.d=$((B - 3 * 2))\n",
    "arrays and arguments": 'ARR=(\n  x.a=1  # one\n  "x.b=two words"\n)\npython3 -m verl.trainer.main_ppo '
                            '"${ARR[@]}" x.c=3 $@ "$@" "${@:2}"\n',
    "blocks, prefixes and redirections": 'P=1\nif [ "$P" -eq 1 ]; then\n  Q=2\nfi\nR=3 true\n'
                                         "python3 -m verl.trainer.main_ppo x.p=$P x.r=${R:-none} 2>&1 | tee log\n",
    "field splitting": 'CFG="\n  x.a=1 \\\n  x.b=$((2 * 3))"\nQ="x.c=one two"\n'
                       'python3 -m verl.trainer.main_ppo $CFG "$Q"\n',
    "hydra prefixes": "python3 -m verl.trainer.main_ppo +x.new=1 ++x.any=2 x.list='[1, 2]' x.s=\"'0.5'\"\n",
}
FILES = ["grpo_trainer/run_qwen2-7b.sh", "grpo_trainer/run_qwen3-8b_npu.sh", "ppo_trainer/run_deepseek7b_llm.sh"]


def bash_arguments(script: str, tmp_path) -> list[str]:
    env = {"HOME": "$HOME", "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    result = subprocess.run(["bash", "-c", STUB + script], env=env, cwd=tmp_path, capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr
    arguments = result.stdout.decode().split("\0")[:-1]
    assert arguments[:2] == ["-m", "verl.trainer.main_ppo"]
    return arguments[2:]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash, the reference")
@pytest.mark.parametrize("source", [*SNIPPETS, *FILES])
def test_the_command_gets_the_arguments_bash_passes(source, tmp_path):
    """Each form (quoting, continuations, comments, ``$VAR``, ``${VAR:-default}``, ``${VAR:+alt}``,
    ``$((...))``, arrays, ``$@``, field splitting of an unquoted variable, assignments in if blocks or before a
    command, redirections) and verl's scripts give the arguments bash gives; a variable the script does not set
    stays as text (``${HOME}`` as written)."""
    script = SNIPPETS.get(source) or (VERL / source).read_text()
    ours = [argument.replace("${HOME}", "$HOME") for argument in verl_arguments(script)]
    assert ours == bash_arguments(script, tmp_path)


def test_what_the_reader_does_not_run_stays_one_word_of_text():
    """``$(command)`` is not run, arithmetic beyond the shell's 64 bits (or ``9**9**9``, which would not end) and
    a variable the script does not set stay as written, each one word (never split at its blanks)."""
    script = ("NOW=$(date +%Y %m)\nBIG=$((9**9**9))\npython3 -m verl.trainer.main_ppo trainer.experiment_name=run_$NOW "
              "x.p=$((2**70)) x.q=$BIG x.r=${UNSET} x.s=$(( 1 / 0 ))\n")
    assert verl_arguments(script) == ["trainer.experiment_name=run_$(date +%Y %m)", "x.p=$((2**70))",
                                      "x.q=$((9**9**9))", "x.r=${UNSET}", "x.s=$(( 1 / 0 ))"]


def test_values_are_read_as_hydra_reads_them():
    overrides = read_file(VERL / "grpo_trainer/run_qwen3-8b_npu.sh")
    actor = overrides["actor_rollout_ref"]["actor"]
    assert actor["optim"]["lr"] == 1e-6 and actor["use_kl_loss"] is True and actor["entropy_coeff"] == 0
    assert actor["entropy_from_logits_with_chunking"] is True  # ++key=value
    assert overrides["trainer"]["logger"] == ["console", "wandb"]
    assert overrides["trainer"]["default_local_dir"] == "${HOME}/verl/ckpts/GRPO-Qwen3/GRPO-Qwen3-8B-npu"
    assert overrides["data"]["truncation"] == "error" and overrides["data"]["train_batch_size"] == 256
    assert [hydra_value(text) for text in ("7", "-1", "1_000", "0.6", "1e-6", ".5", "inf", "False", "NULL", "'3'",
                                           "0.999_1.001", "low_var_kl", "{a: 1}")] == [
        7, -1, 1000, 0.6, 1e-6, 0.5, float("inf"), False, None, "3", "0.999_1.001", "low_var_kl", {"a": 1}]


def test_gspo_script_with_arrays_and_arithmetic():
    """verl's GSPO script sets its overrides in bash arrays, with lengths computed by ``$((1024 * 16))`` and
    ``+data.gen_batch_size``; one of its lengths divides by a variable set later (bash stops there with "division
    by 0"): that value stays as text, outside the mapping."""
    overrides = read_file(VERL / "gspo_trainer/run_qwen3_32b_gspo_npu.sh")
    assert overrides["data"]["max_response_length"] == 16384 and overrides["data"]["gen_batch_size"] == 256
    assert overrides["actor_rollout_ref"]["actor"]["ppo_max_token_len_per_gpu"] == \
        "$(((max_prompt_length + max_response_length) / sp_size))"
    assert overrides["trainer"]["nnodes"] == 4  # NNODES=${NNODES:-4}
    engine = overrides["actor_rollout_ref"]["rollout"]["engine_kwargs"]["vllm"]["compilation_config"]
    assert engine == {"cudagraph_capture_sizes": [8, 16, 32, 64, 128, 192, 256, 384],
                      "cudagraph_mode": "FULL_DECODE_ONLY"}


@pytest.mark.parametrize("script, message", [
    ("#!/bin/bash\necho training\n", r"no launch command found: a verl script runs python3 -m "
                                     r"verl\.trainer\.main_ppo with key=value overrides; a slime script"),
    ("python3 -m verl.trainer.main_ppo ~trainer.logger\n", r"'~trainer\.logger' deletes a key of verl's config"),
    ("python3 -m verl.trainer.main_ppo --config-name=my_grpo x.y=1\n",
     r"--config-name my_grpo is not one of verl's own configs .*--cfg job --resolve"),
    ("python3 -m verl.trainer.main_ppo x.y=1 stray\n",
     r"'stray' after verl\.trainer\.main_ppo is not a Hydra override"),
    ("python3 -m verl.trainer.main_ppo x.y='open\n", r"a single quote is not closed"),
])
def test_a_script_that_cannot_be_read_raises_naming_what_was_expected(tmp_path, script, message):
    """Never an empty result: what the reader looked for is named (a verl script of an empty result used to give
    verl's default loss silently)."""
    path = tmp_path / "run.sh"
    path.write_text(script)
    with pytest.raises(ValueError, match=rf"^{path}: {message}"):
        read_file(path)
