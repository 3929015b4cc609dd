"""One local client must not be able to exhaust, block or read through the reference server.

Each test runs a real server process on 127.0.0.1 and speaks to it through raw gRPC stubs where the client library
would refuse the request itself. Memory is read from the server's /proc/PID/status (VmRSS).
"""

import math
import os
import pathlib
import signal
import sys

import grpc
import numpy as np
import pytest

from rollout_client import ClientConfig, PauseMode, RolloutClient, RolloutRequest, SamplingParams
from rollout_client.packed_arrays import TOKEN_ID_DTYPE, pack
from rollout_client.protocol import MAX_POLICY_VERSION, bearer, pb, pb_grpc
from rollout_client.server.cli import AUTH_TOKEN_ENV
from tests.rollout_client.conftest import ServerProcess

SCRIPTED = ("-m", "rollout_client.server", "--engine", "scripted", "--vocab-size", "1000")
TOKEN = "test-token"
RSS_SLACK_BYTES = 100 * 1024 * 1024
BIG_BYTES = 200 * 1024 * 1024
SCALE = "logprob_scale"  # The scripted engine's one weight: a float32 scalar.


@pytest.fixture
def start(tmp_path):
    """Factory: start(*args, env=...) -> ServerProcess, killed at teardown."""
    servers = []

    def start_server(*args: str, env: dict | None = None) -> ServerProcess:
        workdir = tmp_path / f"server{len(servers)}"
        workdir.mkdir()
        servers.append(ServerProcess([sys.executable, *args], workdir, env))
        return servers[-1]

    yield start_server
    for server in servers:
        server.stop(signal.SIGKILL)


def rss_bytes(server: ServerProcess) -> int:
    """The server's resident memory."""
    status = pathlib.Path(f"/proc/{server.process.pid}/status").read_text()
    (line,) = [line for line in status.splitlines() if line.startswith("VmRSS:")]
    return int(line.split()[1]) * 1024


def stub(server: ServerProcess) -> pb_grpc.RolloutServiceStub:
    """A stub to ``server`` after one small call: the server's first call allocates its handler machinery (tens of
    MB, more or less depending on the machine's load), which must not count against the refused message."""
    channel = grpc.insecure_channel(server.target, options=[("grpc.max_send_message_length", 2 * BIG_BYTES)])
    grpc.channel_ready_future(channel).result(timeout=60)
    rpc = pb_grpc.RolloutServiceStub(channel)
    try:
        rpc.GetServerInfo(pb.GetServerInfoRequest(), timeout=60)
    except grpc.RpcError:
        pass  # refused without a token: the call still went through the server's handler path
    return rpc


def client(server: ServerProcess, token: str | None = None) -> RolloutClient:
    return RolloutClient(ClientConfig(target=server.target, auth_token=token, ready_timeout_s=60))


def call_code(call) -> grpc.RpcError:
    """The error `call()` fails with."""
    with pytest.raises(grpc.RpcError) as caught:
        result = call()
        list(result) if hasattr(result, "__iter__") else result
    return caught.value


def generate_request(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id="r", prompt_token_ids=pack(np.array([5, 6]), TOKEN_ID_DTYPE),
                              logprob_mode=pb.LOGPROB_MODE_RAW, **fields)


def test_huge_num_samples_is_refused_without_allocating(start):
    server = start(*SCRIPTED)
    rpc = stub(server)
    before = rss_bytes(server)
    error = call_code(lambda: rpc.Generate(generate_request(num_samples=2**26)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("num_samples:")
    assert rss_bytes(server) - before < RSS_SLACK_BYTES


@pytest.mark.parametrize("size", [BIG_BYTES, 7 * 1024 * 1024])
def test_unauthenticated_large_message_is_refused_unread(start, size):
    server = start(*SCRIPTED, env={AUTH_TOKEN_ENV: TOKEN})
    rpc = stub(server)
    before = rss_bytes(server)
    request = generate_request()
    request.prompt_token_ids = bytes(size)
    error = call_code(lambda: rpc.Generate(request))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert rss_bytes(server) - before < RSS_SLACK_BYTES


def weight_chunks(version: int, count: int, chunk_bytes: int = 4 * 1024 * 1024):
    """A header and `count` chunks of `chunk_bytes` for the scripted engine's 4-byte weight."""
    yield pb.WeightsChunk(header=pb.WeightsHeader(policy_version=version, num_tensors=1))
    for index in range(count):
        yield pb.WeightsChunk(tensor=pb.TensorChunk(name=SCALE, dtype="float32", offset=index * chunk_bytes,
                                                    data=bytes(chunk_bytes)))


def test_stream_weights_while_not_paused_keeps_no_byte(start):
    server = start(*SCRIPTED)
    rpc = stub(server)
    before = rss_bytes(server)
    error = call_code(lambda: rpc.StreamWeights(weight_chunks(1, 50)))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert rss_bytes(server) - before < RSS_SLACK_BYTES


def test_stream_weights_beyond_the_engines_weight_bytes_is_refused(start):
    server = start(*SCRIPTED)
    rpc = stub(server)
    rpc.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_KEEP))
    before = rss_bytes(server)
    error = call_code(lambda: rpc.StreamWeights(weight_chunks(1, 50)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("tensor.data:")
    assert rss_bytes(server) - before < RSS_SLACK_BYTES


def test_stream_weights_with_a_too_large_version_is_refused_at_the_header(start):
    server = start(*SCRIPTED)
    rpc = stub(server)
    rpc.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_KEEP))
    error = call_code(lambda: rpc.StreamWeights(weight_chunks(2**63 - 1, 0)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("policy_version:")


@pytest.mark.parametrize("version", [2**63 - 1, MAX_POLICY_VERSION + 1])
def test_too_large_version_is_refused_and_later_updates_still_work(start, version):
    server = start(*SCRIPTED)
    weights = {SCALE: np.asarray(2.0, np.float32)}
    with client(server) as rollout:
        with pytest.raises(grpc.RpcError) as caught:
            rollout.publish_weights(version, weights=weights)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert rollout.publish_weights(MAX_POLICY_VERSION, weights=weights) == MAX_POLICY_VERSION


def test_infinite_temperature_is_refused(start):
    server = start(*SCRIPTED)
    request = generate_request(sampling=pb.SamplingParams(temperature=math.inf))
    error = call_code(lambda: stub(server).Generate(request))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("sampling.temperature:")


def test_unknown_method_is_unimplemented_or_unauthenticated(start):
    open_server, guarded = start(*SCRIPTED), start(*SCRIPTED, env={AUTH_TOKEN_ENV: TOKEN})

    def unknown(server, method, metadata=()):
        channel = grpc.insecure_channel(server.target)
        return call_code(lambda: channel.unary_unary(method)(b"", metadata=metadata, timeout=60)).code()

    assert unknown(open_server, "/rollout.v1.RolloutService/Nope") == grpc.StatusCode.UNIMPLEMENTED
    assert unknown(guarded, "/rollout.v1.RolloutService/Nope") == grpc.StatusCode.UNAUTHENTICATED
    assert unknown(guarded, "/other.Service/Nope") == grpc.StatusCode.UNAUTHENTICATED
    assert unknown(guarded, "/rollout.v1.RolloutService/Nope", bearer(TOKEN)) == grpc.StatusCode.UNIMPLEMENTED


def save_scale(path: pathlib.Path, scale: float) -> None:
    import safetensors.numpy

    safetensors.numpy.save_file({SCALE: np.asarray(scale, np.float32)}, str(path))


def test_weights_paths_stay_inside_the_weights_dir(start, tmp_path):
    weights_dir, outside = tmp_path / "weights", tmp_path / "outside.safetensors"
    weights_dir.mkdir()
    save_scale(outside, 0.5)
    save_scale(weights_dir / "good.safetensors", 0.5)
    os.mkfifo(weights_dir / "fifo")
    (weights_dir / "escape").symlink_to(outside)
    server = start(*SCRIPTED, "--weights-dir", str(weights_dir))
    refused = [str(outside), "../outside.safetensors", "escape", "fifo", "missing.safetensors"]
    with client(server) as rollout:
        for version, path in enumerate(refused, start=1):
            with pytest.raises(grpc.RpcError) as caught:
                rollout.publish_weights(version, path=path)
            details = caught.value.details()
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("path:"), details
            assert str(tmp_path) not in details and str(server.process.pid) not in details, details
        assert rollout.publish_weights(1, path="good.safetensors") == 1  # The FIFO blocked nothing.
        (sample,) = rollout.generate(RolloutRequest([5], SamplingParams(max_new_tokens=4, stop_token_ids=())))
        assert (sample.policy_versions == 1).all()


def test_weights_paths_are_refused_without_a_weights_dir(start, tmp_path):
    save_scale(tmp_path / "good.safetensors", 0.5)
    server = start(*SCRIPTED)
    with client(server) as rollout, pytest.raises(grpc.RpcError) as caught:
        rollout.publish_weights(1, path=str(tmp_path / "good.safetensors"))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert str(tmp_path) not in caught.value.details()


def final_logprobs(rpc: pb_grpc.RolloutServiceStub) -> np.ndarray:
    """Logprobs of one 8-token sample, as the server sent them (no client-side validation)."""
    request = generate_request(sampling=pb.SamplingParams(max_new_tokens=8, seed=1))
    (message,) = [message for message in rpc.Generate(request, timeout=600) if message.HasField("final")]
    return np.frombuffer(message.final.logprobs, "<f4")


def test_nan_weights_do_not_outlive_the_next_good_update(start):
    import jax
    from flax import nnx

    from learner.model.param_paths import parameter_names
    from learner.model.transformer import Transformer, model_config

    state = nnx.state(Transformer(model_config("tiny"), rngs=nnx.Rngs(0)), nnx.Param)
    names, _ = parameter_names(state)
    good = {name: np.asarray(leaf) for name, leaf in zip(names, jax.tree.leaves(state))}
    nan = {name: np.full_like(array, np.nan) for name, array in good.items()}
    server = start("-m", "learner.serving", "--max-batch-size", "1", "--max-seq-len", "32")
    rpc = stub(server)
    with client(server) as rollout:
        rollout.publish_weights(1, weights=nan)
        assert np.isnan(final_logprobs(rpc)).all()
        rollout.publish_weights(2, weights=good, pause_mode=PauseMode.WAIT)
    for _ in range(2):
        assert np.isfinite(final_logprobs(rpc)).all()
