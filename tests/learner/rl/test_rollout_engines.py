"""The engine plug-in point: capabilities, the run's requirements, and refusal before anything starts."""

import dataclasses
import importlib.util
import re
import sys
import types

import numpy as np
import pytest

from learner.checkpoints.safetensors_io import _parameter_shapes
from learner.model.transformer import model_config
from learner.rl import load_config
from learner.rl.rollout_engines import (
    ENGINES,
    build_engine_pool,
    check_identity,
    learner_identity,
    publishes_adapters,
    reference_server_args,
    requirements,
    untied,
    vllm_server_args,
)
from rollout_client import (
    EngineCapabilities,
    EngineCapabilityError,
    EngineInfo,
    LogprobMode,
    MlxEngine,
    ModelIdentity,
    ModelMismatchError,
    PauseMode,
    TetherEngine,
    VersionReporting,
    WeightTransport,
    check_capabilities,
)
from rollout_client.engines.process import EngineExitedError
from rollout_client.engines.sglang import SGLangEngine
from rollout_client.engines.vllm import VllmEngine

# What shared/reference/engines.md says of the MLX servicer: RAW only, its own sampler order, weights by restart,
# no versions, no n, seed not honoured.
MLX_LIKE = EngineCapabilities(frozenset({LogprobMode.RAW}), ("top_p", "min_p", "top_k", "temperature"), frozenset(),
                              WeightTransport.RESTART, VersionReporting.NONE, native_n=False, honours_seed=False)
# vLLM: both modes (a server flag), pause modes, engine-wide versions.
VLLM_LIKE = EngineCapabilities(frozenset(LogprobMode), ("temperature", "top_k", "top_p", "min_p"),
                               frozenset(PauseMode), WeightTransport.FROM_DISK, VersionReporting.ENGINE,
                               native_n=True, honours_seed=True)


@pytest.mark.parametrize("overrides, steps", [
    ([], ()),
    (["rollout.temperature=0.7"], ("temperature",)),
    (["rollout.top_k=5", "rollout.top_p=0.9", "rollout.min_p=0.05"], ("top_k", "top_p", "min_p")),
])
@pytest.mark.parametrize("partial, pause_mode", [(False, PauseMode.WAIT), (True, PauseMode.KEEP)])
def test_requirements_follow_the_rollout_section(overrides, steps, partial, pause_mode):
    needs = requirements(load_config(None, [*overrides, "rollout.max_staleness=2", f"rollout.partial={partial}"
                                            .lower()]))
    assert (needs.logprob_mode, needs.sampler_steps, needs.pause_mode, needs.max_staleness, needs.partial) == (
        LogprobMode.PROCESSED, steps, pause_mode, 2, partial)


@pytest.mark.parametrize("overrides", [
    [], ["rollout.temperature=0.6", "rollout.top_k=3", "rollout.top_p=0.8", "rollout.min_p=0.1"],
    ["rollout.logprob_mode='raw'", "rollout.top_p=0.9", "rollout.max_staleness=0"], ["rollout.max_staleness=4"],
])
def test_the_reference_server_honours_every_run(overrides):
    check_capabilities("tether", TetherEngine.capabilities, requirements(load_config(None, overrides)))


def test_an_engine_is_refused_naming_every_missing_capability_and_its_key():
    config = load_config(None, ["rollout.temperature=0.7", "rollout.top_p=0.9", "rollout.max_staleness=1"])
    with pytest.raises(EngineCapabilityError) as error:
        check_capabilities("mlx", MLX_LIKE, requirements(config))
    lines = str(error.value).splitlines()
    assert lines[0] == "engine 'mlx' cannot honour this run:"
    assert lines[1].startswith("- rollout.logprob_mode='processed': it returns only raw logprobs")
    assert lines[2].startswith("- rollout.max_staleness=1: requests kept running across a weight update need "
                               "per-token versions; this engine reports none")
    # What MLX can do: RAW logprobs, any sampler (replayed in its order, tests/learner/logprobs/test_sampler_order.py),
    # synchronous.
    check_capabilities("mlx", MLX_LIKE, requirements(load_config(
        None, ["rollout.logprob_mode='raw'", "rollout.temperature=0.7", "rollout.top_p=0.9", "rollout.top_k=5",
               "rollout.max_staleness=0"])))


def test_engine_wide_versions_refuse_requests_kept_across_an_update():
    with pytest.raises(EngineCapabilityError, match="max_staleness=2: .* reports one per engine"):
        check_capabilities("vllm", VLLM_LIKE, requirements(load_config(None, ["rollout.max_staleness=2"])))
    check_capabilities("vllm", VLLM_LIKE, requirements(load_config(None, ["rollout.max_staleness=0"])))


def test_partial_rollouts_need_an_engine_that_continues_a_request_across_an_update():
    partial = requirements(load_config(None, ["rollout.max_staleness=2", "rollout.partial=true"]))
    for engine in ("tether", "sglang", "vllm"):  # in the engine (rollout.v1), or continued from the tokens
        check_capabilities(engine, ENGINES[engine].capabilities, partial)
    with pytest.raises(EngineCapabilityError, match="rollout.partial=true: this engine cannot keep a request running "
                                                    "across a weight update"):
        check_capabilities("mlx", MLX_LIKE, partial)
    with pytest.raises(EngineCapabilityError, match=r"reports one per engine \(set rollout.max_staleness=0, or "
                                                    r"rollout.partial=true\)"):
        check_capabilities("sglang", ENGINES["sglang"].capabilities,
                           requirements(load_config(None, ["rollout.max_staleness=2"])))


def test_a_refused_engine_is_refused_before_any_process_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(TetherEngine, "capabilities", MLX_LIKE)
    with pytest.raises(EngineCapabilityError):
        build_engine_pool(load_config(None), trainer=None, eos_ids=(2,), run_dir=tmp_path, weights={})
    assert not (tmp_path / "server.log").exists()  # nothing was launched


def test_an_engine_with_another_vocabulary_is_refused():
    info = EngineInfo(policy_version=0, vocab_size=5000, eos_token_ids=(2,), max_seq_len=64, model_identity="x")
    # larger: it could sample ids the learner cannot embed; smaller: its softmax is over other rows
    for learner_vocab in (128, 8192):
        with pytest.raises(ModelMismatchError, match=f"- vocab_size: engine 5000, learner {learner_vocab}"):
            check_identity(info, vocab_size=learner_vocab, address="127.0.0.1:1")
    check_identity(info, vocab_size=int(np.int64(5000)), address="127.0.0.1:1")


def test_the_mlx_backend_declares_what_the_mlx_servicer_does():
    assert ENGINES["mlx"] is MlxEngine and MlxEngine.capabilities == MLX_LIKE


def test_the_mlx_config_is_honoured_and_the_default_run_is_refused_naming_its_keys():
    check_capabilities("mlx", MlxEngine.capabilities, requirements(load_config("configs/mlx_engine.toml")))
    with pytest.raises(EngineCapabilityError) as error:
        check_capabilities("mlx", MlxEngine.capabilities, requirements(load_config("configs/default.toml")))
    assert "rollout.logprob_mode='processed'" in str(error.value) and "rollout.max_staleness=1" in str(error.value)


def test_the_mlx_engine_is_launched_by_tether_never_reached_at_an_address(tmp_path):
    config = load_config("configs/mlx_engine.toml", ["server.address='127.0.0.1:50051'"])
    with pytest.raises(ValueError, match="server.address='127.0.0.1:50051': the mlx engine takes new weights by "
                                         "restart, so Tether launches it; unset server.address"):
        build_engine_pool(config, trainer=None, eos_ids=(2,), run_dir=tmp_path, weights={})
    assert not any(tmp_path.iterdir())  # nothing was written or launched


def test_the_learners_identity_is_the_config_json_it_exports():
    assert learner_identity(model_config("tiny")) == ModelIdentity(
        vocab_size=128, model_type="qwen2", architectures=("Qwen2ForCausalLM",),
        shapes={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": False})


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_sglang_and_vllm_need_an_address_a_control_url_and_a_shared_weights_dir(tmp_path, engine):
    no_address = [] if engine == "vllm" else [  # vllm without an address is launched (next test)
        ["server.control_url='http://127.0.0.1:30010'", f"server.weights_dir='{tmp_path}'"]]
    for missing in (["server.address='127.0.0.1:30000'", "server.control_url='http://127.0.0.1:30010'"],
                    *no_address,
                    ["server.address=['a:1', 'b:2']", "server.control_url='http://127.0.0.1:30010'",
                     f"server.weights_dir='{tmp_path}'"]):
        config = load_config(None, [f"server.engine='{engine}'", "rollout.max_staleness=0", *missing])
        with pytest.raises(ValueError, match=f"server.engine='{engine}': set server.address \\(one gRPC host:port, "
                                             "or a gateway\\), server.control_url"):
            build_engine_pool(config, trainer=None, eos_ids=(2,), run_dir=tmp_path, weights={})
    assert ENGINES["sglang"] is SGLangEngine and ENGINES["vllm"] is VllmEngine


def test_reference_server_is_built_from_the_hf_checkpoint_when_there_is_one():
    trainer = types.SimpleNamespace(length=96)
    named = reference_server_args(load_config(None), trainer, (2,))
    assert named[:2] == ["--model-config", "tiny"] and "--hf-path" not in named
    from_checkpoint = reference_server_args(load_config(None, ["model.hf_path='/ckpt'",
                                                               "model.param_dtype='bfloat16'"]), trainer, (2, 7))
    assert from_checkpoint[:4] == ["--hf-path", "/ckpt", "--param-dtype", "bfloat16"]
    assert "--model-config" not in from_checkpoint and from_checkpoint[from_checkpoint.index("--eos-ids") + 1:][:2] == [
        "2", "7"]


def test_a_partial_run_has_its_server_compile_the_cache_recompute_programs_too():
    """Partial rollouts that recompute the kept sequences' cache at a publish ask the server for those programs
    before it serves (``--partial``); keeping the cache as it is needs none."""
    trainer = types.SimpleNamespace(length=96)
    partial = ["rollout.partial=true", "rollout.max_staleness=1"]
    assert "--partial" in reference_server_args(load_config(None, partial), trainer, (2,))
    assert "--partial" not in reference_server_args(load_config(None, [*partial, "rollout.partial_kv='keep'"]),
                                                    trainer, (2,))
    assert "--partial" not in reference_server_args(load_config(None), trainer, (2,))


def test_adapter_publish_only_where_a_request_can_name_the_adapter():
    """vLLM's smg ``GenerateRequest`` has no LoRA field: a LoRA run asking it for adapter publish is refused, by key,
    citing the proto and its version; SGLang publishes the adapter when asked; "auto" publishes merged weights
    everywhere (stock SGLang's smg servicer does not implement the LoRA RPCs)."""
    lora = ["model.lora.rank=4"]
    with pytest.raises(ValueError, match=r"model.lora.publish='adapter': the vllm engine cannot serve an adapter "
                                         r"per request \(smg-grpc-proto 0.4.28's vllm_engine.proto GenerateRequest"):
        publishes_adapters(load_config(None, [*lora, "model.lora.publish=adapter", "server.engine=vllm"]))
    with pytest.raises(ValueError, match=r"model.lora.publish='adapter': the tether engine"):
        publishes_adapters(load_config(None, [*lora, "model.lora.publish=adapter"]))
    assert not publishes_adapters(load_config(None, [*lora, "server.engine=vllm"]))
    assert not publishes_adapters(load_config(None, [*lora, "server.engine=sglang"]))
    assert publishes_adapters(load_config(None, [*lora, "model.lora.publish=adapter", "server.engine=sglang"]))
    assert not publishes_adapters(load_config(None, [*lora, "model.lora.publish=merged", "server.engine=sglang"]))
    assert not publishes_adapters(load_config(None, ["model.lora.publish=adapter", "server.engine=vllm"]))  # no LoRA


def _tied_trainer(length: int = 96):
    return types.SimpleNamespace(length=length,
                                 model_config=dataclasses.replace(model_config("tiny"), tie_embeddings=True))


def test_a_launched_vllm_starts_untied_on_the_hf_checkpoint_with_the_runs_settings_and_the_users_flags_last():
    config = load_config("configs/vllm_engine.toml", ["model.hf_path='/ckpt'", "rollout.logprob_mode='raw'",
                                                      "server.engine_args=['--enforce-eager', '--seed', '7']"])
    args = vllm_server_args(config, _tied_trainer())
    flags = dict(zip(args[:-3:2], args[1:-3:2]))
    assert flags == {"--model": "/ckpt", "--dtype": "float32", "--max-model-len": "96",
                     "--logprobs-mode": "raw_logprobs", "--max-num-seqs": "128", "--seed": "0",
                     "--hf-overrides": '{"tie_word_embeddings": false}'}
    assert args[-3:] == ["--enforce-eager", "--seed", "7"]  # the user's flags win (argparse: the last one)
    tied = vllm_server_args(load_config("configs/vllm_engine.toml", ["server.untie_embeddings=false"]),
                            _tied_trainer())
    assert "--hf-overrides" not in tied  # the workaround switched off: vLLM ties, and keeps its start-up head


def test_a_launched_vllm_refuses_a_missing_checkpoint_bad_flags_and_a_missing_python_naming_the_key(tmp_path):
    for overrides, message in (
            (["model.hf_path=''"], "set model.hf_path"),
            (["server.engine_args=['--enforce-eager', 3]"], "server.engine_args=['--enforce-eager', 3]: must be a "
                                                            "list of strings"),
            ([f"server.python='{tmp_path / 'nowhere' / 'python'}'"], f"server.python='{tmp_path}/nowhere/python': "
                                                                     "no such executable")):
        config = load_config("configs/vllm_engine.toml", overrides)
        with pytest.raises(ValueError, match=re.escape(message)):
            build_engine_pool(config, trainer=_tied_trainer(), eos_ids=(2,), run_dir=tmp_path, weights={})
    assert not any(tmp_path.iterdir())  # nothing was written or launched


def test_untied_weights_write_the_embedding_as_an_explicit_lm_head(tmp_path):
    """What a publish to vLLM carries for a tied model (server.untie_embeddings): the same logits, with lm_head.weight
    in the safetensors and tie_word_embeddings false in config.json."""
    from learner.checkpoints.safetensors_io import hf_tensors

    config = dataclasses.replace(model_config("tiny"), tie_embeddings=True)
    rng = np.random.default_rng(0)
    weights = {path: rng.normal(size=shape).astype(np.float32) for path, shape in _parameter_shapes(config).items()}
    untied_weights, untied_config = untied(weights, config)
    assert not untied_config.tie_embeddings and dataclasses.replace(untied_config, tie_embeddings=True) == config
    tensors = hf_tensors(untied_weights, untied_config)
    assert set(tensors) == set(hf_tensors(weights, config)) | {"lm_head.weight"}
    np.testing.assert_array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="this Python has vLLM: it would start")
def test_a_launched_vllm_whose_python_lacks_vllm_stops_the_run_with_one_line_naming_the_fix_and_the_log(tmp_path):
    """The launcher really runs (here under this Python, which has no vLLM) and exits at once; the error's first line,
    the one a run prints, says why and names the log."""
    config = load_config("configs/vllm_engine.toml", [f"model.hf_path='{tmp_path}'",
                                                      f"server.python='{sys.executable}'"])
    trainer = _tied_trainer()
    trainer.task, trainer.lora = types.SimpleNamespace(tokenizer=None), None
    with pytest.raises(EngineExitedError) as error:
        build_engine_pool(config, trainer=trainer, eos_ids=(2,), run_dir=tmp_path, weights={})
    first = str(error.value).splitlines()[0]
    assert "cannot import vLLM and smg-grpc-servicer" in first and "set server.python" in first
    assert f"end of its log {tmp_path / 'server.log'}" in first and "exit code 1" in first
