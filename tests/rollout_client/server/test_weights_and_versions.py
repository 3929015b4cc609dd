"""Weight updates and policy-version stamping against a real scripted-engine server."""

import time

import grpc
import numpy as np
import pytest

from rollout_client import PauseMode, RolloutRequest, SamplingParams
from rollout_client.protocol import pb

PARAMS = SamplingParams(max_new_tokens=60, stop_token_ids=(), seed=5)


def scale_weights(scale: float) -> dict[str, np.ndarray]:
    return {"logprob_scale": np.asarray(scale, np.float32)}


def test_keep_pause_update_resume_mid_generation_gives_two_version_spans(client):
    request = RolloutRequest([5, 6], SamplingParams(max_new_tokens=400, stop_token_ids=(), seed=5))
    (reference,) = client.generate(request.__class__([5, 6], request.sampling))
    future = client.submit(request)
    time.sleep(0.2)
    assert client.publish_weights(1, weights=scale_weights(2.0), pause_mode=PauseMode.KEEP) == 1
    (sample,) = future.result(timeout=10)
    versions = sample.policy_versions
    switch = int(np.argmax(versions == 1))
    assert 0 < switch < 400 and versions[:switch].tolist() == [0] * switch and (versions[switch:] == 1).all()
    np.testing.assert_array_equal(sample.completion_token_ids, reference.completion_token_ids)
    np.testing.assert_allclose(sample.logprobs[:switch], reference.logprobs[:switch])
    np.testing.assert_allclose(sample.logprobs[switch:], 2.0 * reference.logprobs[switch:])


def test_wrong_shape_weights_are_invalid_argument_and_old_weights_keep_serving(client):
    (before,) = client.generate(RolloutRequest([5], PARAMS))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        client.publish_weights(1, weights={"logprob_scale": np.ones(3, np.float32)})
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "logprob_scale" in caught.value.details() and "shape" in caught.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        client.publish_weights(1, weights={"logprob_scale": np.ones((), np.float64)})
    assert "dtype" in caught.value.details()
    info = client.server_info()
    assert info.policy_version == 0 and not info.paused
    (after,) = client.generate(RolloutRequest([5], PARAMS))
    np.testing.assert_array_equal(after.logprobs, before.logprobs)


def test_policy_version_must_increase(client):
    client.publish_weights(3, weights=scale_weights(1.0))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        client.publish_weights(3, weights=scale_weights(1.0))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("policy_version:")
    (sample,) = client.generate(RolloutRequest([5], PARAMS, min_policy_version=3))
    assert (sample.policy_versions == 3).all()


def test_update_without_pause_is_failed_precondition(client):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        client.stream_weights(1, scale_weights(2.0))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_update_from_safetensors_path(client, tmp_path):
    import safetensors.numpy

    path = tmp_path / "weights.safetensors"
    safetensors.numpy.save_file(scale_weights(0.5), str(path))
    (before,) = client.generate(RolloutRequest([5], PARAMS))
    client.publish_weights(2, path=str(path), weights_format=pb.WEIGHTS_FORMAT_SAFETENSORS)
    (after,) = client.generate(RolloutRequest([5], PARAMS))
    np.testing.assert_allclose(after.logprobs, 0.5 * before.logprobs)
    assert (after.policy_versions == 2).all()


def test_update_from_missing_path_names_the_field(client):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        client.publish_weights(2, path="/nonexistent/weights.safetensors")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("path:")


def test_update_in_a_format_the_engine_cannot_read_is_invalid_argument(client, tmp_path):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        client.publish_weights(2, path=str(tmp_path), weights_format=pb.WEIGHTS_FORMAT_ORBAX)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == ("format: this engine reads WEIGHTS_FORMAT_SAFETENSORS, "
                                      "got WEIGHTS_FORMAT_ORBAX")
