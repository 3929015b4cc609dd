"""Faults against real server processes: crashes, corrupt samples, auth, TLS."""

import shutil
import subprocess
import time

import grpc
import numpy as np
import pytest

from rollout_client import (
    ClientConfig,
    InvalidRolloutError,
    RolloutClient,
    RolloutRequest,
    SamplingParams,
    ValidationConfig,
)
from tests.rollout_client.conftest import SCRIPTED

PARAMS = SamplingParams(max_new_tokens=30, stop_token_ids=(), seed=9)


def test_server_killed_mid_stream_and_restarted_loses_and_duplicates_nothing(start_server):
    server = start_server(*SCRIPTED, "--step-delay-s", "0.005", "--max-batch-size", "2")
    request = RolloutRequest([5, 6], SamplingParams(max_new_tokens=200, stop_token_ids=(), seed=4), num_samples=4)
    with RolloutClient(ClientConfig(target=server.target, initial_backoff_s=0.2, max_attempts=20)) as client:
        future = client.submit(request)
        time.sleep(1.3)  # Samples 0 and 1 are done (~1 s), 2 and 3 are half way.
        server.kill()
        time.sleep(0.3)
        server.start()
        samples = future.result(timeout=30)
        assert client.metrics()["generate/retries"] >= 1
    with RolloutClient(ClientConfig(target=server.target)) as fresh_client:
        expected = fresh_client.generate(request)
    assert [s.sample_index for s in samples] == [0, 1, 2, 3]
    for got, want in zip(samples, expected, strict=True):
        np.testing.assert_array_equal(got.completion_token_ids, want.completion_token_ids)


@pytest.mark.parametrize("fault, problem", [
    ("nan_logprobs", "non_finite_logprobs"),
    ("length_mismatch", "length_mismatch"),
    ("odd_byte_length", "bad_byte_length"),
    ("out_of_vocab", "token_out_of_vocab"),
    ("empty", "empty_completion"),
])
def test_faulty_server_samples_are_dropped_and_counted_or_raise(start_server, fault, problem):
    server = start_server("--fault", fault, *SCRIPTED, module="tests.support.faulty_server")
    request = RolloutRequest([5], PARAMS, num_samples=3)
    with RolloutClient(ClientConfig(target=server.target)) as client:
        samples = client.generate(request)
        assert [s.sample_index for s in samples] == [1, 2]
        metrics = client.metrics()
        assert metrics[f"samples/dropped/{problem}"] == 1 and metrics["samples/accepted"] == 2
    strict = ClientConfig(target=server.target, validation=ValidationConfig(on_invalid="raise"))
    with RolloutClient(strict) as client:
        with pytest.raises(InvalidRolloutError, match=f"sample 0: {problem}"):
            client.generate(request)


def test_wrong_or_missing_auth_token_is_unauthenticated(start_server):
    server = start_server(*SCRIPTED, env={"TETHER_ROLLOUT_TOKEN": "s3cret"})
    for token in ("wrong", None):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            RolloutClient(ClientConfig(target=server.target, auth_token=token))  # Health is open, info is not.
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert caught.value.details().startswith("authorization:")
    with RolloutClient(ClientConfig(target=server.target, auth_token="s3cret")) as client:
        assert len(client.generate(RolloutRequest([5], PARAMS))) == 1


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make a certificate")
def test_tls_with_auth(start_server, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=30)
    server = start_server(*SCRIPTED, "--tls-cert", str(cert), "--tls-key", str(key),
                          env={"TETHER_ROLLOUT_TOKEN": "s3cret"})
    config = ClientConfig(target=server.target, auth_token="s3cret", tls_root_certificates=cert.read_bytes())
    with RolloutClient(config) as client:
        (sample,) = client.generate(RolloutRequest([5], PARAMS))
    assert sample.completion_token_ids.size == 30
    with pytest.raises(Exception, match="not SERVING"):  # A plaintext client cannot talk to it.
        RolloutClient(ClientConfig(target=server.target, auth_token="s3cret", ready_timeout_s=1.0))
