"""The engine plug-in point: capabilities, the run's requirements, and refusal before anything starts."""

import numpy as np
import pytest

from learner.rl import load_config
from learner.rl.engines import build_engine, check_identity, requirements
from rollout_client import (EngineCapabilities, EngineCapabilityError, EngineInfo, LogprobMode, PauseMode,
                            TetherEngine, VersionReporting, WeightTransport, check_capabilities)

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
def test_requirements_follow_the_rollout_section(overrides, steps):
    needs = requirements(load_config(None, [*overrides, "rollout.max_staleness=2"]))
    assert (needs.logprob_mode, needs.sampler_steps, needs.pause_mode, needs.max_staleness) == (
        LogprobMode.PROCESSED, steps, PauseMode.KEEP, 2)


@pytest.mark.parametrize("overrides", [
    [], ["rollout.temperature=0.6", "rollout.top_k=3", "rollout.top_p=0.8", "rollout.min_p=0.1"],
    ["rollout.logprob_mode='raw'", "rollout.top_p=0.9"], ["rollout.max_staleness=4"],
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
    assert lines[2].startswith("- rollout.temperature with rollout.top_p: it applies them in the order top_p, "
                               "temperature")
    assert lines[3].startswith("- rollout.max_staleness=1: requests kept running across a weight update need "
                               "per-token versions; this engine reports none")
    # What MLX can do: RAW logprobs, temperature alone (the order of one step does not matter), synchronous.
    check_capabilities("mlx", MLX_LIKE, requirements(load_config(
        None, ["rollout.logprob_mode='raw'", "rollout.temperature=0.7", "rollout.max_staleness=0"])))


def test_engine_wide_versions_refuse_requests_kept_across_an_update():
    with pytest.raises(EngineCapabilityError, match="max_staleness=2: .* reports one per engine"):
        check_capabilities("vllm", VLLM_LIKE, requirements(load_config(None, ["rollout.max_staleness=2"])))
    check_capabilities("vllm", VLLM_LIKE, requirements(load_config(None, ["rollout.max_staleness=0"])))


def test_a_refused_engine_is_refused_before_any_process_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(TetherEngine, "capabilities", MLX_LIKE)
    with pytest.raises(EngineCapabilityError):
        build_engine(load_config(None), trainer=None, eos_ids=(2,), run_dir=tmp_path)
    assert not (tmp_path / "server.log").exists()  # nothing was launched


def test_an_engine_that_can_sample_ids_the_learner_cannot_embed_is_refused():
    info = EngineInfo(policy_version=0, vocab_size=5000, eos_token_ids=(2,), max_seq_len=64, model_identity="x")
    with pytest.raises(ValueError, match="vocabulary of 5000 tokens, the learner's model 128"):
        check_identity(info, vocab_size=128, address="127.0.0.1:1")
    check_identity(info, vocab_size=int(np.int64(5000)), address="127.0.0.1:1")
