"""SGLang backend, protocol conformance only: SGLang does not run on this CPU.

`rollout_client.SGLangEngine` is driven against a gRPC server built from smg's own ``SglangSchedulerServicer``
base class and an HTTP server with SGLang's control endpoints (`tests.support.conformance_servers`). What
is checked:
what goes on the wire (every sampling field explicit, with the value meant), how the streamed answer is assembled
(the final message repeats the last chunk), ``n``, abort, the publish sequence, and errors. What is not: that a real
SGLang samples and loads as its source says.
"""

import functools
import json

import numpy as np
import pytest

from learner.checkpoints.peft_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, write_peft_adapter
from learner.model.lora import LoraConfig
from learner.model.transformer import model_config
from rollout_client import ClientConfig, FinishReason, LogprobMode, RolloutRequest, SamplingParams, ValidationConfig
from rollout_client.engines.http_control import ControlPlaneError, ControlPlaneUnavailableError
from rollout_client.engines.sglang import STREAM_INTERVAL, SGLangEngine
from rollout_client.errors import ServerNotReadyError
from rollout_client.request_guards import RequestRefusedError
from tests.support.conformance_servers import (
    EOS,
    VOCAB,
    logprob,
    sglang_servers,
    token,
    write_fake_checkpoint,
)

PROMPT = [3, 1, 4, 1, 5]


@pytest.fixture(scope="module")
def servers():
    servers = sglang_servers()
    yield servers
    servers.stop()


@pytest.fixture
def engine(servers, tmp_path):
    servers.reset()
    engine = SGLangEngine(ClientConfig(servers.target, ready_timeout_s=30.0,
                                       validation=ValidationConfig(vocab_size=VOCAB)),
                          servers.http.url, write_fake_checkpoint, tmp_path / "weights")
    yield engine
    engine.close()


def expected_tokens(offset, index, length, prompt=PROMPT):
    return [token(sum(prompt), step, index, offset) for step in range(length)]


def test_generate_sends_every_sampling_field_explicitly_protocol_conformance(servers, engine):
    engine.publish(1, {"offset": np.array(2)})
    request = RolloutRequest(PROMPT, SamplingParams(temperature=0.7, max_new_tokens=11, stop_token_ids=()))
    (sample,) = engine.submit(request).result(timeout=30)

    (sent,) = servers.engine.generate_requests
    params = sent.sampling_params
    assert (sent.request_id, list(sent.tokenized.input_ids), sent.stream) == (f"{request.request_id}/0", PROMPT, True)
    assert (sent.return_logprob, sent.logprob_start_len, sent.top_logprobs_num) == (True, -1, 0)
    assert params.temperature == np.float32(0.7)
    assert (params.top_p, params.top_k, params.min_p) == (1.0, -1, 0.0)  # off, not proto3's 0 (top_p 0: greedy)
    assert (params.frequency_penalty, params.presence_penalty, params.repetition_penalty) == (0.0, 0.0, 1.0)
    assert params.HasField("max_new_tokens") and params.max_new_tokens == 11
    assert (list(params.stop_token_ids), params.ignore_eos, params.min_new_tokens) == ([], True, 0)
    assert (params.skip_special_tokens, params.spaces_between_special_tokens, params.no_stop_trim) == (False, False,
                                                                                                       True)
    assert params.HasField("stream_interval") and params.stream_interval == STREAM_INTERVAL
    assert params.n == 1 and not params.HasField("constraint") and not params.logit_bias

    # 11 tokens come as chunks of 8 and 3, then a complete repeating the 3: each token counted once.
    assert sample.completion_token_ids.tolist() == expected_tokens(2, 0, 11)
    np.testing.assert_array_equal(sample.logprobs, np.float32([logprob(step, 0) for step in range(11)]))
    assert sample.finish_reason == FinishReason.LENGTH
    assert sample.policy_versions.tolist() == [1] * 11
    assert sample.logprob_mode == LogprobMode.PROCESSED


def test_n_samples_in_one_engine_request_protocol_conformance(servers, engine):
    engine.publish(1, {"offset": np.array(0)})
    request = RolloutRequest(PROMPT, SamplingParams(max_new_tokens=4, stop_token_ids=()), num_samples=3)
    samples = engine.submit(request).result(timeout=30)

    (sent,) = servers.engine.generate_requests
    assert sent.request_id == request.request_id and sent.sampling_params.n == 3
    assert [s.sample_index for s in samples] == [0, 1, 2]
    for s in samples:
        assert s.completion_token_ids.tolist() == expected_tokens(0, s.sample_index, 4)
        np.testing.assert_array_equal(s.logprobs, np.float32([logprob(t, s.sample_index) for t in range(4)]))


def test_stop_at_eos_sends_eos_without_ignore_eos_protocol_conformance(servers, engine):
    engine.publish(1, {"offset": np.array(0)})
    stop = token(sum(PROMPT), 2, 0, 0)  # the third token the model samples
    (sample,) = engine.submit(RolloutRequest(PROMPT, SamplingParams(max_new_tokens=9, stop_token_ids=(stop, EOS)))
                              ).result(timeout=30)
    params = servers.engine.generate_requests[-1].sampling_params
    assert (list(params.stop_token_ids), params.ignore_eos) == ([stop, EOS], False)
    assert sample.completion_token_ids.tolist() == expected_tokens(0, 0, 3)
    assert sample.finish_reason == FinishReason.STOP


def test_abort_keeps_streamed_tokens_protocol_conformance(servers, engine):
    engine.publish(1, {"offset": np.array(0)})
    servers.engine.hold_after = 5
    request = RolloutRequest(PROMPT, SamplingParams(max_new_tokens=40, stop_token_ids=()))
    future = engine.submit(request)
    assert servers.engine.holding.wait(timeout=30)  # the engine streamed the tokens before the hold
    assert engine.client.abort([request.request_id]) == [request.request_id]
    (sample,) = future.result(timeout=30)

    assert [a.request_id for a in servers.engine.abort_requests] == [f"{request.request_id}/0"]
    assert sample.finish_reason == FinishReason.ABORT
    assert sample.completion_token_ids.tolist() == expected_tokens(0, 0, 5)


def test_publish_pauses_loads_continues_and_confirms_protocol_conformance(servers, engine, tmp_path):
    assert engine.publish(1, {"offset": np.array(4)}) == 1
    assert engine.publish(2, {"offset": np.array(9)}) == 2

    calls = [(method, path) for method, path, _, _ in servers.engine.http_calls]
    assert calls == 2 * [("POST", "/pause_generation"), ("POST", "/update_weights_from_disk"),
                         ("POST", "/continue_generation"), ("GET", "/model_info")]
    bodies = [body for _, path, _, body in servers.engine.http_calls if path != "/model_info"]
    assert bodies[:3] == [{"mode": "abort"},
                          {"model_path": str(tmp_path / "weights" / "v000000000001"), "load_format": "safetensors",
                           "weight_version": "1", "flush_cache": True, "abort_all_requests": False}, {}]
    assert servers.engine.weight_version == "2" and engine.info().policy_version == 2
    (sample,) = engine.submit(RolloutRequest(PROMPT, SamplingParams(max_new_tokens=3, stop_token_ids=()))
                              ).result(timeout=30)
    assert sample.completion_token_ids.tolist() == expected_tokens(9, 0, 3)  # the new weights sampled it
    assert sample.policy_versions.tolist() == [2, 2, 2]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v000000000001", "v000000000002"]


def test_weight_version_from_the_older_endpoint_protocol_conformance(servers, engine):
    servers.engine.legacy_version_endpoint = True
    assert engine.publish(3, {"offset": np.array(1)}) == 3
    assert [path for _, path, _, _ in servers.engine.http_calls][-2:] == ["/model_info", "/get_weight_version"]


def test_failed_update_surfaces_the_engine_answer_and_continues_protocol_conformance(servers, engine):
    engine.publish(1, {"offset": np.array(0)})
    servers.engine.fail["/update_weights_from_disk"] = (400, {"success": False, "message": "shape mismatch: q_proj",
                                                               "num_paused_requests": 0})
    with pytest.raises(ControlPlaneError, match=rf"POST {servers.http.url}/update_weights_from_disk: HTTP 400 .*"
                                                r"shape mismatch: q_proj"):
        engine.publish(2, {"offset": np.array(5)})
    assert [path for _, path, _, _ in servers.engine.http_calls][-1] == "/continue_generation"
    (sample,) = engine.submit(RolloutRequest(PROMPT, SamplingParams(max_new_tokens=2, stop_token_ids=()))
                              ).result(timeout=30)
    assert sample.policy_versions.tolist() == [1, 1]  # still the old version, as the engine still serves it


def test_wrong_version_after_load_is_an_error_protocol_conformance(servers, engine):
    servers.engine.fail["/model_info"] = (200, {"weight_version": "default"})
    with pytest.raises(ControlPlaneError, match="reports weight_version 'default' after loading policy version 1"):
        engine.publish(1, {"offset": np.array(0)})


def test_control_endpoint_down_names_the_address_protocol_conformance(servers, tmp_path):
    servers.reset()
    engine = SGLangEngine(ClientConfig(servers.target, ready_timeout_s=30.0), "http://127.0.0.1:9",
                          write_fake_checkpoint, tmp_path / "weights")
    try:
        with pytest.raises(ControlPlaneUnavailableError, match=r"POST http://127.0.0.1:9/pause_generation: .*"
                                                               "did not answer"):
            engine.publish(1, {"offset": np.array(0)})
    finally:
        engine.close()


def test_grpc_engine_down_protocol_conformance(tmp_path):
    with pytest.raises(ServerNotReadyError, match="127.0.0.1:9"):
        SGLangEngine(ClientConfig("127.0.0.1:9", ready_timeout_s=1.0), "http://127.0.0.1:9",
                     write_fake_checkpoint, tmp_path / "weights")


def test_requests_the_engine_cannot_honour_are_refused(servers, engine):
    with pytest.raises(RequestRefusedError, match="publish first"):
        engine.submit(RolloutRequest(PROMPT))
    engine.publish(1, {"offset": np.array(0)})
    with pytest.raises(RequestRefusedError, match="top_k, top_p with processed logprobs.*SGLANG_RETURN_ORIGINAL"):
        engine.submit(RolloutRequest(PROMPT, SamplingParams(top_k=5, top_p=0.9)))
    with pytest.raises(RequestRefusedError, match=rf"leaves out the engine's eos ids \[{EOS}\]"):
        engine.submit(RolloutRequest(PROMPT, SamplingParams(stop_token_ids=(7,))))
    with pytest.raises(RequestRefusedError, match="logprob_mode=raw: this sglang engine returns processed"):
        engine.submit(RolloutRequest(PROMPT, logprob_mode=LogprobMode.RAW))
    assert servers.engine.generate_requests == []


def test_lora_adapters_load_under_caller_minted_ids_over_grpc_protocol_conformance(servers, tmp_path):
    """smg's ``LoadLoRAAdapter`` / ``UnloadLoRAAdapter`` / ``ListLoadedLoRAAdapters`` with the proto's fields: the id
    is the caller's and requests name it; ``success: false`` raises with the engine's message; an engine that answers
    UNIMPLEMENTED (smg-grpc-servicer 0.14.1) is refused when adapter publish is asked for, naming the fix."""
    servers.reset()
    engine = SGLangEngine(ClientConfig(servers.target, ready_timeout_s=30.0,
                                       validation=ValidationConfig(vocab_size=VOCAB)),
                          servers.http.url, write_fake_checkpoint, tmp_path / "weights", publish_adapters=True)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    try:
        engine.adapters.load("policy", str(adapter), "id-7")
        assert engine.adapters.loaded() == {"id-7": "policy"}
        with pytest.raises(ControlPlaneError, match=r"LoadLoRAAdapter 'policy' at the SGLang engine .*already loaded"):
            engine.adapters.load("policy", str(adapter), "id-8")
        with pytest.raises(ControlPlaneError, match=r"LoadLoRAAdapter 'other'.*No adapter found"):
            engine.adapters.load("other", str(tmp_path / "missing"), "id-9")
        with pytest.raises(ControlPlaneError, match=r"UnloadLoRAAdapter 'policy'.*under id 'id-8'"):
            engine.adapters.unload("policy", "id-8")
        engine.adapters.unload("policy", "id-7")
        assert engine.adapters.loaded() == {}
    finally:
        engine.close()
    load = next(request for name, request in servers.engine.lora_calls if name == "LoadLoRAAdapter")
    assert (load.lora_name, load.lora_path, load.pinned, load.lora_id) == ("policy", str(adapter), False, "id-7")
    unload = [request for name, request in servers.engine.lora_calls if name == "UnloadLoRAAdapter"][-1]
    assert (unload.lora_name, unload.lora_id) == ("policy", "id-7")
    assert servers.engine.http_calls == []  # not over HTTP: SGLang's /load_lora_adapter mints ids no request knows

    servers.reset()
    servers.engine.lora_rpcs = False
    with pytest.raises(ControlPlaneError, match=r"ListLoadedLoRAAdapters at the SGLang engine .*UNIMPLEMENTED.*"
                                                r"model.lora.publish='merged'"):
        SGLangEngine(ClientConfig(servers.target, ready_timeout_s=30.0, validation=ValidationConfig(vocab_size=VOCAB)),
                     servers.http.url, write_fake_checkpoint, tmp_path / "weights", publish_adapters=True)
    SGLangEngine(ClientConfig(servers.target, ready_timeout_s=30.0, validation=ValidationConfig(vocab_size=VOCAB)),
                 servers.http.url, write_fake_checkpoint, tmp_path / "weights").close()  # merged weights need none


def test_adapter_publish_loads_the_versioned_adapter_and_requests_name_it_protocol_conformance(servers, tmp_path):
    """``publish_adapters``: each publish writes the PEFT adapter as ``weights_dir/v<version>``, then pause ->
    ``LoadLoRAAdapter`` (name and id ``tether-v<version>``) -> continue -> ``UnloadLoRAAdapter`` of the previous
    version; no ``/update_weights_from_disk``; every request names the id of its version in
    ``GenerateRequest.lora_id``. A restarted learner publishing a version the engine still holds replaces it."""
    servers.reset()
    lora = LoraConfig(rank=2, alpha=4.0)
    config = model_config("tiny")
    rng = np.random.default_rng(0)
    writer = functools.partial(write_peft_adapter, lora=lora, config=config, overwrite=True)

    def start():
        return SGLangEngine(ClientConfig(servers.target, ready_timeout_s=30.0,
                                         validation=ValidationConfig(vocab_size=VOCAB)),
                            servers.http.url, writer, tmp_path / "weights", publish_adapters=True)

    adapters = {"layers/0/attn/q_proj/lora/a": rng.normal(size=(64, 2)).astype(np.float32),
                "layers/0/attn/q_proj/lora/b": rng.normal(size=(2, 4, 16)).astype(np.float32)}
    samples = []
    engine = start()
    try:
        for version in (1, 2):
            assert engine.publish(version, adapters) == version
            (sample,) = engine.submit(RolloutRequest(PROMPT, SamplingParams(max_new_tokens=3, stop_token_ids=()))
                                      ).result(timeout=30)
            samples.append(sample)
    finally:
        engine.close()
    first, second = (tmp_path / "weights" / name for name in ("v000000000001", "v000000000002"))
    calls = [(method, path, body) for method, path, _, body in servers.engine.http_calls]
    assert calls == [("POST", "/pause_generation", {"mode": "abort"}), ("POST", "/continue_generation", {}),
                     ("POST", "/pause_generation", {"mode": "abort"}), ("POST", "/continue_generation", {})]
    rpcs = [(name, request.lora_name, request.lora_id, getattr(request, "lora_path", None))
            for name, request in servers.engine.lora_calls if name != "ListLoadedLoRAAdapters"]
    assert rpcs == [("LoadLoRAAdapter", "tether-v1", "tether-v1", str(first)),
                    ("LoadLoRAAdapter", "tether-v2", "tether-v2", str(second)),
                    ("UnloadLoRAAdapter", "tether-v1", "tether-v1", None)]
    assert servers.engine.lora_ids == {"tether-v2": "tether-v2"}
    for directory in (first, second):
        assert sorted(path.name for path in directory.iterdir()) == sorted([ADAPTER_CONFIG, ADAPTER_WEIGHTS])
        assert json.loads((directory / ADAPTER_CONFIG).read_text())["r"] == 2
    assert [request.lora_id for request in servers.engine.generate_requests] == ["tether-v1", "tether-v2"]
    assert [sample.policy_versions.tolist() for sample in samples] == [[1, 1, 1], [2, 2, 2]]

    del servers.engine.lora_calls[:]
    engine = start()  # the learner restarts and publishes version 2 again: the engine's tether-v2 is replaced
    try:
        assert engine.publish(2, adapters) == 2
    finally:
        engine.close()
    assert [(name, request.lora_id) for name, request in servers.engine.lora_calls if name != "ListLoadedLoRAAdapters"
            ] == [("UnloadLoRAAdapter", "tether-v2"), ("LoadLoRAAdapter", "tether-v2")]
    assert servers.engine.lora_ids == {"tether-v2": "tether-v2"}


def test_adapter_publish_confirms_the_engine_holds_the_new_adapter_protocol_conformance(servers, tmp_path):
    """After the load the engine must list the new id (``ListLoadedLoRAAdapters``), else the publish fails and
    requests keep the previous version; a previous adapter the engine no longer holds (it restarted) is not
    unloaded."""
    engine = _adapter_engine(servers, tmp_path)
    try:
        engine.publish(1, {})
        servers.engine.lora_ids.clear()  # the engine restarted and lost tether-v1
        servers.engine.lora_adapters.clear()
        assert engine.publish(2, {}) == 2
        assert [name for name, _ in servers.engine.lora_calls].count("UnloadLoRAAdapter") == 0
        servers.engine.fail["ListLoadedLoRAAdapters"] = True  # the engine answers success but holds nothing new
        with pytest.raises(ControlPlaneError, match=r"does not list LoRA adapter 'tether-v3' after loading it"):
            engine.publish(3, {})
        assert engine.policy_version == 2
        (sample,) = engine.submit(RolloutRequest(PROMPT, SamplingParams(max_new_tokens=2, stop_token_ids=()))
                                  ).result(timeout=30)
    finally:
        engine.close()
    assert servers.engine.generate_requests[-1].lora_id == "tether-v2"
    assert sample.policy_versions.tolist() == [2, 2]


def test_adapter_publish_unloads_every_older_version_the_engine_holds_protocol_conformance(servers, tmp_path):
    """An engine taken back without a restart (`may_have_restarted`: the version forgotten) still holds the adapter
    of the version it served: the next publish unloads it too, so no adapter slot leaks; others' adapters stay."""
    engine = _adapter_engine(servers, tmp_path)
    try:
        engine.publish(1, {})
        servers.engine.lora_adapters["someone-else"] = "/adapters/someone-else"  # not ours: never unloaded
        servers.engine.lora_ids["someone-else"] = "someone-else"
        engine.may_have_restarted()  # down, then back: it still holds tether-v1
        assert engine.publish(2, {}) == 2
    finally:
        engine.close()
    assert servers.engine.lora_ids == {"tether-v2": "tether-v2", "someone-else": "someone-else"}


def _adapter_engine(servers, tmp_path) -> SGLangEngine:
    """An adapter-publishing engine on freshly reset fake servers."""
    servers.reset()
    config = ClientConfig(servers.target, ready_timeout_s=30.0, validation=ValidationConfig(vocab_size=VOCAB))
    return SGLangEngine(config, servers.http.url, _adapter_writer, tmp_path / "weights", publish_adapters=True)


def _adapter_writer(directory, weights) -> None:
    """A PEFT adapter directory as the fake engine checks it (``adapter_config.json``)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ADAPTER_CONFIG).write_text("{}")
