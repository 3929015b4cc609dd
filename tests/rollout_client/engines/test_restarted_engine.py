"""An SGLang or vLLM engine restarted by its operator (same address, start-up weights) is republished before the pool
takes it back: protocol conformance against the fake servers of `tests.support.conformance_servers`.

The engine object remembers the version it published before the restart; the restarted engine serves its start-up
weights (or, with LoRA adapters, holds no adapter). The pool must load the current version's directory again before
a request goes there, so that no sample is stamped with that version while other weights sample it.
"""

import concurrent.futures
import json
import time

import numpy as np
import pytest

from rollout_client import ClientConfig, RolloutRequest, SamplingParams, ValidationConfig
from rollout_client.engines.http_control import ControlPlaneUnavailableError
from rollout_client.engines.pool import EnginePool, Member, PoolConfig
from rollout_client.engines.sglang import SGLangEngine, adapter_name
from rollout_client.engines.vllm import VllmEngine
from rollout_client.engines.weight_dirs import version_dir
from tests.support.conformance_servers import (
    VOCAB,
    sglang_servers,
    token,
    vllm_servers,
    write_fake_checkpoint,
)

PROMPT = [3, 1, 4, 1, 5]
OFFSET = 4  # the published weights; the restarted engine's start-up weights have offset 0
CLIENT = dict(ready_timeout_s=30.0, initial_backoff_s=0.01, max_backoff_s=0.05,
              validation=ValidationConfig(vocab_size=VOCAB))


def write_adapter(directory, weights) -> None:
    """A checkpoint directory that is also a PEFT adapter directory as the fake engine checks it."""
    write_fake_checkpoint(directory, weights)
    (directory / "adapter_config.json").write_text(json.dumps({}))


def sglang(servers, weights_dir):
    return SGLangEngine(ClientConfig(servers.target, **CLIENT), servers.http.url, write_fake_checkpoint, weights_dir)


def sglang_adapters(servers, weights_dir):
    return SGLangEngine(ClientConfig(servers.target, **CLIENT), servers.http.url, write_adapter, weights_dir,
                        publish_adapters=True)


def vllm(servers, weights_dir):
    return VllmEngine(ClientConfig(servers.target, **CLIENT), servers.http.url, write_fake_checkpoint, weights_dir)


def wait_until(condition, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def loads(servers) -> list[str]:
    """The checkpoint directories the engine was asked to load, in order (whichever way its kind loads them)."""
    engine = servers.engine
    paths = [body["model_path"] for _, path, _, body in engine.http_calls if path == "/update_weights_from_disk"]
    paths += [body["kwargs"]["weights_path"] for _, path, _, body in engine.http_calls if path == "/collective_rpc"]
    return paths + [request.lora_path for name, request in engine.lora_calls if name == "LoadLoRAAdapter"]


@pytest.mark.parametrize("start, servers_of", [(sglang, sglang_servers), (sglang_adapters, sglang_servers),
                                               (vllm, vllm_servers)], ids=["sglang", "sglang-adapters", "vllm"])
def test_restarted_engine_is_republished_before_it_is_taken_back_protocol_conformance(start, servers_of, tmp_path):
    servers = servers_of()
    engine = start(servers, tmp_path / "weights")
    pool = EnginePool([Member(servers.target, engine)], PoolConfig(probe_interval_s=0.05, give_up_after_s=600))
    (mode,) = engine.capabilities.logprob_modes
    request = RolloutRequest(PROMPT, SamplingParams(max_new_tokens=6, stop_token_ids=()), logprob_mode=mode)
    offset = 0 if start is sglang_adapters else OFFSET  # the fake's adapters leave the tokens alone
    expected = [token(sum(PROMPT), step, 0, offset) for step in range(6)]
    try:
        assert pool.publish(1, {"offset": np.array(OFFSET)}) == 1
        (before,) = pool.submit(request).result(timeout=60)
        assert before.completion_token_ids.tolist() == expected

        servers.stop()  # the operator stops it: a request fails, the engine is taken out
        waiting = pool.submit(request)
        member = pool.members[0]
        assert wait_until(lambda: not member.healthy)
        servers = servers.started_again()  # and starts it again, on its start-up weights
        (after,) = waiting.result(timeout=60)  # the pool probed it, took it back, then sent the request
        metrics = pool.metrics()
    finally:
        pool.close()
        engine.close()
        servers.stop()

    assert metrics["engines/taken_out"] == 1 and metrics["engines/taken_back"] == 1
    assert loads(servers) == [str(version_dir(tmp_path / "weights",
                                              1))]  # the current version's directory, loaded again
    if start is sglang_adapters:  # the request named tether-v1, which the restarted engine holds again
        assert list(servers.engine.lora_ids.values()) == [adapter_name(1)]
        assert [sent.lora_id for sent in servers.engine.generate_requests] == [adapter_name(1)]
    # Merged weights: sampled by version 1's (offset 4), not the start-up weights (offset 0); stamped 1.
    assert after.completion_token_ids.tolist() == expected
    assert after.policy_versions.tolist() == [1] * 6


def test_restarted_engine_that_fails_to_load_stays_out_protocol_conformance(tmp_path):
    """SGLang (merged weights) restarted: while its load of the current version fails, it is not taken back and no
    request reaches it; once a load succeeds, it serves that version's weights."""
    servers = sglang_servers()
    engine = sglang(servers, tmp_path / "weights")
    pool = EnginePool([Member(servers.target, engine)], PoolConfig(probe_interval_s=0.05, give_up_after_s=600))
    request = RolloutRequest(PROMPT, SamplingParams(max_new_tokens=6, stop_token_ids=()))
    refusal = (400, {"success": False, "message": "Failed to update weights: out of memory", "num_paused_requests": 0})
    try:
        pool.publish(1, {"offset": np.array(OFFSET)})
        servers.stop()
        waiting = pool.submit(request)
        member = pool.members[0]
        assert wait_until(lambda: not member.healthy)
        servers = servers.started_again(fail={"/update_weights_from_disk": refusal})
        assert wait_until(lambda: len(loads(servers)) >= 3)  # probed, and refused, three times
        assert not member.healthy and not waiting.done() and servers.engine.generate_requests == []
        assert member.last_failure.startswith("republishing the weights failed: ControlPlaneError: POST ")
        servers.engine.fail.clear()
        (after,) = waiting.result(timeout=60)
    finally:
        pool.close()
        engine.close()
        servers.stop()
    assert after.completion_token_ids.tolist() == [token(sum(PROMPT), step, 0, OFFSET) for step in range(6)]
    assert after.policy_versions.tolist() == [1] * 6


def test_control_endpoint_down_during_a_publish_takes_the_engine_out_until_it_is_back_protocol_conformance(tmp_path):
    """SGLang (merged weights) stopped by its operator while a publish runs: the publish's unreachable control
    endpoint takes the engine out (the run goes on) and the publish returns once the engine is back with the new
    version loaded. A control endpoint that never answered is a wrong address: the first publish fails at once."""
    servers = sglang_servers()
    engine = sglang(servers, tmp_path / "weights")
    pool = EnginePool([Member(servers.target, engine)], PoolConfig(probe_interval_s=0.05, give_up_after_s=600))
    member = pool.members[0]
    try:
        pool.publish(1, {"offset": np.array(OFFSET)})
        servers.stop()
        publishing = concurrent.futures.ThreadPoolExecutor(1).submit(pool.publish, 2, {"offset": np.array(OFFSET)})
        assert wait_until(lambda: not member.healthy)
        assert "ControlPlaneUnavailableError" in member.last_failure and not publishing.done()
        servers = servers.started_again()
        assert publishing.result(timeout=60) == 2
    finally:
        pool.close()
        engine.close()
        servers.stop()
    assert loads(servers) == [str(version_dir(tmp_path / "weights", 2))]

    unreachable = sglang_servers()
    # its gRPC address serves, its control URL is the stopped servers' (nothing listens there)
    wrong = SGLangEngine(ClientConfig(unreachable.target, **CLIENT), servers.http.url, write_fake_checkpoint,
                         tmp_path / "other")
    pool = EnginePool([Member(unreachable.target, wrong)], PoolConfig(probe_interval_s=0.05, give_up_after_s=600))
    try:
        with pytest.raises(ControlPlaneUnavailableError):
            pool.publish(1, {"offset": np.array(OFFSET)})
    finally:
        pool.close()
        wrong.close()
        unreachable.stop()
