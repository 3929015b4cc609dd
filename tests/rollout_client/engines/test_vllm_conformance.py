"""vLLM backend, protocol conformance only: vLLM does not run on this CPU.

`rollout_client.VllmEngine` is driven against a gRPC server built from smg's own ``VllmEngineServicer`` base class
and an HTTP server with vLLM's pause / reload / resume endpoints (`tests.support.conformance_servers`).
What is
checked: the wire (every sampling field explicit, logprobs of the sampled token asked for, ``n``), stream assembly,
abort, the publish sequence, errors. What is not: that a real vLLM samples and reloads as its source says.
"""

import numpy as np
import pytest

from rollout_client import (
    ClientConfig,
    FinishReason,
    LogprobMode,
    PauseMode,
    RolloutRequest,
    SamplingParams,
    ValidationConfig,
)
from rollout_client.engines.http_control import ControlPlaneError, ControlPlaneUnavailableError
from rollout_client.engines.vllm import VllmEngine
from rollout_client.request_guards import RequestRefusedError
from tests.support.conformance_servers import VOCAB, logprob, token, vllm_servers, write_fake_checkpoint

PROMPT = [2, 7, 1, 8]


@pytest.fixture(scope="module")
def servers():
    servers = vllm_servers()
    yield servers
    servers.stop()


def start(servers, tmp_path, **kwargs) -> VllmEngine:
    servers.reset()
    return VllmEngine(ClientConfig(servers.target, ready_timeout_s=30.0, validation=ValidationConfig(vocab_size=VOCAB)),
                      servers.http.url, write_fake_checkpoint, tmp_path / "weights", **kwargs)


@pytest.fixture
def engine(servers, tmp_path):
    engine = start(servers, tmp_path)
    yield engine
    engine.close()


def expected_tokens(offset, index, length):
    return [token(sum(PROMPT), step, index, offset) for step in range(length)]


def test_generate_sends_every_sampling_field_explicitly_protocol_conformance(servers, engine):
    engine.publish(1, {"offset": np.array(3)})
    request = RolloutRequest(PROMPT, SamplingParams(temperature=0.9, top_k=5, top_p=0.8, min_p=0.05,
                                                    max_new_tokens=6, stop_token_ids=(40,)),
                             logprob_mode=LogprobMode.RAW)
    (sample,) = engine.submit(request).result(timeout=30)

    (sent,) = servers.engine.generate_requests
    params = sent.sampling_params
    assert (sent.request_id, list(sent.tokenized.input_ids), sent.stream) == (f"{request.request_id}/0", PROMPT, True)
    assert params.HasField("temperature") and params.temperature == np.float32(0.9)
    assert (params.top_k, params.top_p, params.min_p) == (5, np.float32(0.8), np.float32(0.05))
    assert (params.frequency_penalty, params.presence_penalty, params.repetition_penalty) == (0.0, 0.0, 1.0)
    assert params.HasField("max_tokens") and params.max_tokens == 6 and params.min_tokens == 0
    assert (list(params.stop_token_ids), params.ignore_eos) == ([40], True)  # exactly the request's stops
    assert params.HasField("logprobs") and params.logprobs == 0  # the sampled token's logprob only
    assert (params.skip_special_tokens, params.include_stop_str_in_output, params.n) == (False, False, 1)
    assert not params.HasField("seed") and not params.HasField("prompt_logprobs")

    # One chunk per token, then a complete repeating the last one: each token counted once.
    assert sample.completion_token_ids.tolist() == expected_tokens(3, 0, 6)
    np.testing.assert_array_equal(sample.logprobs, np.float32([logprob(step, 0) for step in range(6)]))
    assert (sample.finish_reason, sample.policy_versions.tolist()) == (FinishReason.LENGTH, [1] * 6)


def test_n_samples_in_one_engine_request_protocol_conformance(servers, engine):
    engine.publish(1, {"offset": np.array(0)})
    request = RolloutRequest(PROMPT, SamplingParams(max_new_tokens=3, stop_token_ids=()), num_samples=4,
                             logprob_mode=LogprobMode.RAW)
    samples = engine.submit(request).result(timeout=30)
    (sent,) = servers.engine.generate_requests
    assert sent.request_id == request.request_id and sent.sampling_params.n == 4
    assert [(s.sample_index, s.completion_token_ids.tolist()) for s in samples] == [
        (index, expected_tokens(0, index, 3)) for index in range(4)]


def test_abort_keeps_streamed_tokens_protocol_conformance(servers, engine):
    engine.publish(1, {"offset": np.array(0)})
    servers.engine.hold_after = 4
    request = RolloutRequest(PROMPT, SamplingParams(max_new_tokens=30, stop_token_ids=()), logprob_mode=LogprobMode.RAW)
    future = engine.submit(request)
    assert servers.engine.holding.wait(timeout=30)  # the engine streamed the tokens before the hold
    engine.client.abort([request.request_id])
    (sample,) = future.result(timeout=30)
    assert [list(a.request_ids) for a in servers.engine.abort_requests] == [[f"{request.request_id}/0"]]
    assert (sample.finish_reason, sample.completion_token_ids.tolist()) == (FinishReason.ABORT,
                                                                            expected_tokens(0, 0, 4))


def test_publish_pauses_reloads_resumes_protocol_conformance(servers, engine, tmp_path):
    assert engine.publish(1, {"offset": np.array(6)}) == 1
    calls = servers.engine.http_calls
    assert calls == [
        ("POST", "/pause", {"mode": "wait", "clear_cache": "true"}, {}),
        ("POST", "/collective_rpc", {}, {"method": "reload_weights",
                                         "kwargs": {"weights_path": str(tmp_path / "weights" / "v000000000001")}}),
        ("POST", "/resume", {}, {}),
        ("GET", "/is_paused", {}, {})]
    (sample,) = engine.submit(RolloutRequest(PROMPT, SamplingParams(max_new_tokens=2, stop_token_ids=()),
                                             logprob_mode=LogprobMode.RAW)).result(timeout=30)
    assert sample.completion_token_ids.tolist() == expected_tokens(6, 0, 2)  # the reloaded weights sampled it
    assert sample.policy_versions.tolist() == [1, 1] and engine.info().policy_version == 1
    with pytest.raises(ValueError, match="versions must increase"):
        engine.publish(0, {"offset": np.array(0)})


def test_abort_pause_mode_protocol_conformance(servers, tmp_path):
    engine = start(servers, tmp_path, pause_mode=PauseMode.ABORT)
    try:
        engine.publish(1, {"offset": np.array(0)})
        assert servers.engine.http_calls[0][2] == {"mode": "abort", "clear_cache": "true"}
    finally:
        engine.close()


def test_failed_reload_surfaces_the_engine_answer_and_resumes_protocol_conformance(servers, engine):
    servers.engine.fail["/collective_rpc"] = (500, {"error": "reload_weights failed: missing model.safetensors"})
    with pytest.raises(ControlPlaneError, match=rf"POST {servers.http.url}/collective_rpc: HTTP 500 .*"
                                                "missing model.safetensors"):
        engine.publish(1, {"offset": np.array(0)})
    assert [path for _, path, _, _ in servers.engine.http_calls] == ["/pause", "/collective_rpc", "/resume"]
    with pytest.raises(RequestRefusedError, match="publish first"):  # nothing of the learner's is served yet
        engine.submit(RolloutRequest(PROMPT, logprob_mode=LogprobMode.RAW))


def test_bad_pause_answer_and_still_paused_are_errors_protocol_conformance(servers, engine):
    servers.engine.fail["/pause"] = (400, {"error": "Invalid pause mode: later"})
    with pytest.raises(ControlPlaneError, match=r"POST .*/pause\?mode=wait&clear_cache=true: HTTP 400 .*later"):
        engine.publish(1, {"offset": np.array(0)})
    servers.engine.fail = {"/is_paused": (200, {"is_paused": True})}
    with pytest.raises(ControlPlaneError, match="still paused after /resume"):
        engine.publish(1, {"offset": np.array(0)})


def test_control_endpoint_down_names_the_address_protocol_conformance(servers, tmp_path):
    servers.reset()
    engine = VllmEngine(ClientConfig(servers.target, ready_timeout_s=30.0), "http://127.0.0.1:9",
                        write_fake_checkpoint, tmp_path / "weights")
    try:
        with pytest.raises(ControlPlaneUnavailableError, match=r"POST http://127.0.0.1:9/pause\?.*did not answer"):
            engine.publish(1, {"offset": np.array(0)})
    finally:
        engine.close()


def test_configuration_the_backend_refuses(servers, engine, tmp_path):
    engine.publish(1, {"offset": np.array(0)})
    with pytest.raises(RequestRefusedError, match="logprob_mode=processed: this vllm engine returns raw"):
        engine.submit(RolloutRequest(PROMPT))  # the request's default is PROCESSED; vLLM's default server is RAW
    with pytest.raises(ValueError, match="pause_mode=KEEP: requests kept running across a weight update"):
        VllmEngine(ClientConfig(servers.target), servers.http.url, write_fake_checkpoint, tmp_path / "w",
                   pause_mode=PauseMode.KEEP)
    assert servers.engine.generate_requests == []


def test_lora_adapters_load_and_unload_protocol_conformance(servers, engine, tmp_path):
    """``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` with vLLM 0.33.0's bodies and statuses (400 for a
    name taken without ``load_inplace``, 404 for a path without an adapter or an unknown name); a refused call names
    the endpoint and vLLM's message."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    engine.vllm.load_lora_adapter("policy-v1", str(adapter))
    assert servers.engine.lora_adapters == {"policy-v1": str(adapter)}
    with pytest.raises(ControlPlaneError, match=r"/v1/load_lora_adapter: HTTP 400.*already been loaded.*load_inplace"):
        engine.vllm.load_lora_adapter("policy-v1", str(adapter))
    with pytest.raises(ControlPlaneError, match=r"HTTP 404.*No adapter found"):
        engine.vllm.load_lora_adapter("policy-v2", str(tmp_path / "missing"))
    engine.vllm.unload_lora_adapter("policy-v1")
    with pytest.raises(ControlPlaneError, match=r"/v1/unload_lora_adapter: HTTP 404.*cannot be found"):
        engine.vllm.unload_lora_adapter("policy-v1")
    calls = [(method, path, body) for method, path, _, body in servers.engine.http_calls]
    assert calls[0] == ("POST", "/v1/load_lora_adapter", {"lora_name": "policy-v1", "lora_path": str(adapter)})
    assert calls[3] == ("POST", "/v1/unload_lora_adapter", {"lora_name": "policy-v1"})
