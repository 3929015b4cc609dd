"""Issue #49, item 5: every refusal of ``python -m learner.train`` is one ``error:`` line naming the key (or file)
and the fix, as early as it can be known: the engine address, the LoRA settings and the rewards before the
warm-up, and an external reference server's vocabulary; its policy version once weights are published; a resume
before any array is read (real subprocesses, real servers on 127.0.0.1)."""

import http.server
import json
import sys
import threading

import jax.numpy as jnp
import pytest

from learner.checkpoints.checkpointer import CheckpointConfig, Checkpointer
from learner.rl import load_config, to_dict
from tests.e2e.test_main_job import DEFAULT_CONFIG, train_command
from tests.faults.test_error_lines import error_line
from tests.rollout_client.conftest import ServerProcess


def _refusal(tmp_path, *overrides, resume: bool = False, before_warmup: bool = True) -> str:
    """The one error line of a run with ``overrides`` (2 warm-up steps); nothing was trained or saved (but the
    checkpoint resumed), and, ``before_warmup``, the warm-up never started."""
    stdout = []
    line = error_line(train_command(tmp_path / "run", *overrides), stdout=stdout)
    assert not before_warmup or "warm-up" not in stdout[0], stdout[0][-2000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    saved = sorted(path.name for path in checkpoints.iterdir() if path.name.isdigit()) if checkpoints.exists() else []
    assert saved == (["0"] if resume else [])
    return line


@pytest.fixture()
def http_listener():
    """A plain HTTP server (not gRPC) on 127.0.0.1: ``host:port``."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_unix_socket_that_is_not_there_is_refused_before_the_warm_up(tmp_path):
    line = _refusal(tmp_path, f'server.address="unix:{tmp_path}/nonexistent.sock"')
    assert line.startswith(f"error: server.address: no gRPC server answers at unix:{tmp_path}/nonexistent.sock "
                           "(UNAVAILABLE: "), line
    assert line.endswith("is an engine serving there (not an HTTP endpoint, and the socket path right)? Fix "
                         "server.address, or leave it out to launch the embedded server"), line


def test_an_http_listener_is_refused_before_the_warm_up(tmp_path, http_listener):
    line = _refusal(tmp_path, f'server.address="{http_listener}"')
    assert line.startswith(f"error: server.address: no gRPC server answers at {http_listener} (UNAVAILABLE: "), line
    assert "HTTP/2" in line, line  # grpc's own words: the listener did not speak HTTP/2


LORA_CASES = {
    "rank beyond the projections": (["model.lora.rank=1000000000"],
                                    "error: model.lora.rank=1000000000: above layers/0/attn/k_proj's 64 x 32 (a rank "
                                    "is at most the smaller side, here 32); lower model.lora.rank (8-64 is usual), "
                                    "or narrow model.lora.targets"),
    "targets matching nothing": (["model.lora.rank=4", 'model.lora.targets=["nomatch"]'],
                                 "error: model.lora.targets=['nomatch'] matches no projection; paths look like "
                                 "\"layers/0/attn/q_proj\" or \"layers/0/mlp/down_proj\"."),
    "the embedding": (["model.lora.rank=4", 'model.lora.targets=["embed"]'],
                      "error: model.lora.targets=['embed'] matches no projection; paths look like "
                      "\"layers/0/attn/q_proj\" or \"layers/0/mlp/down_proj\"."),
    "the output head": (["model.lora.rank=4", 'model.lora.targets=["lm_head"]'],
                        "error: model.lora.targets=['lm_head'] matches 'lm_head': only the attention and MLP "
                        "projections of the layers take adapters; anchor the patterns, e.g. \"/q_proj$\"."),
    "adapter publish to an engine without adapters": (
        ["model.lora.rank=4", 'model.lora.publish="adapter"'],
        "error: model.lora.publish='adapter': the tether engine cannot serve an adapter per request ("),
}


@pytest.mark.parametrize("case", LORA_CASES)
def test_lora_settings_that_cannot_work_are_refused_before_the_warm_up(tmp_path, case):
    overrides, expected = LORA_CASES[case]
    line = _refusal(tmp_path, *overrides)
    assert line.startswith(expected), line


def test_a_batched_reward_returning_too_few_scores_is_refused_before_the_warm_up(tmp_path):
    rows = [{"question": f"{a}+{b}", "answer": str(a + b)} for a in range(4) for b in range(4)]
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = (f'{{path = "{tmp_path / "sums.jsonl"}", prompt_column = "question", answer_column = "answer", '
            'demonstration_column = "answer", tokenizer = "char", max_completion_tokens = 3, '
            'rewards = ["tests.support.hanging_rewards:one_value"]}')
    line = _refusal(tmp_path, 'task.name="dataset"', f"task.args={args}")
    assert line == ("error: task.args.rewards: reward 'one_value': NotANumberError: returned 1 values for 2 samples "
                    "(called once on the first training prompts, before training); fix the reward function")


@pytest.fixture(scope="module")
def version_7_server(tmp_path_factory):
    """A scripted server of the tiny model's vocabulary that already serves policy version 7."""
    process = ServerProcess([sys.executable, "-m", "rollout_client.server", "--engine", "scripted", "--vocab-size",
                             "128", "--policy-version", "7"], tmp_path_factory.mktemp("version_7"))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def other_vocab_server(tmp_path_factory):
    process = ServerProcess([sys.executable, "-m", "rollout_client.server", "--engine", "scripted", "--vocab-size",
                             "1000"], tmp_path_factory.mktemp("other_vocab"))
    yield process
    process.stop()


def test_an_engine_serving_another_vocabulary_is_refused_before_the_warm_up(tmp_path, other_vocab_server):
    line = _refusal(tmp_path, f'server.address="{other_vocab_server.target}"')
    assert line == (f"error: the engine at {other_vocab_server.target} serves another model than the learner trains, "
                    "so its logprobs are not the policy's: - vocab_size: engine 1000, learner 128 Serve the "
                    "learner's model (model.name or model.hf_path), or point server.address at an engine that "
                    "serves it")


def test_an_engine_ahead_of_the_learners_version_is_one_line(tmp_path, version_7_server):
    line = _refusal(tmp_path, "warmup.steps=0", f'server.address="{version_7_server.target}"', before_warmup=False)
    assert line == ("error: the server already serves policy version 7, newer than the learner's 0: restart the "
                    "server (versions must increase)")


def _checkpoint(run_dir, *overrides, lora_base=None):
    """Step 0 of a run with ``overrides``, as a run saves it (its config; the LoRA base it records)."""
    saved = load_config(DEFAULT_CONFIG, [f'run_dir="{run_dir}"', *overrides])
    with Checkpointer(CheckpointConfig(str(run_dir / "checkpoints"))) as checkpointer:
        checkpointer.save(0, {"w": jnp.zeros(3)}, policy_version=0, config=to_dict(saved),
                          extra_metadata=None if lora_base is None else {"lora_base": lora_base})


@pytest.mark.slow  # two runs (the one resumed and the resume): 14-28 s in the default run
def test_resuming_lora_adapters_on_another_base_is_one_line(tmp_path):
    trained_on = {"path": None, "sha256": None, "model": "tiny", "seed": 5}
    _checkpoint(tmp_path / "run", "model.lora.rank=4", lora_base=trained_on)
    line = _refusal(tmp_path, "model.lora.rank=4", resume=True)
    assert line == (f"error: {tmp_path}/run/checkpoints step 0 holds LoRA adapters of the base {trained_on}, but "
                    "model.hf_path / model.name / loop.seed give the base {'path': None, 'sha256': None, 'model': "
                    "'tiny', 'seed': 0}: resume on the base the adapters were trained on, or use a new run_dir")


@pytest.mark.slow  # two runs (the one resumed and the resume): 14-28 s in the default run
def test_resuming_a_full_fine_tune_as_lora_is_one_line(tmp_path):
    _checkpoint(tmp_path / "run")
    line = _refusal(tmp_path, "model.lora.rank=4", resume=True)
    assert line == (f"error: {tmp_path}/run/checkpoints step 0 records no LoRA base (lora_base): it is not a LoRA "
                    "run's checkpoint; resume it with model.lora.rank = 0, or use a new run_dir")


@pytest.mark.slow  # two runs (the one resumed and the resume): 14-28 s in the default run
def test_resuming_another_model_shape_says_so_even_with_allow_config_change(tmp_path):
    _checkpoint(tmp_path / "run", 'model.name="small"')
    line = _refusal(tmp_path, "loop.allow_config_change=true", resume=True)
    assert line == (f"error: {tmp_path}/run/checkpoints holds step 0 of a model of another shape (model.name "
                    "changed): its arrays cannot load into this model, loop.allow_config_change or not. Use a new "
                    "run_dir, or resume with the checkpoint's model settings")
