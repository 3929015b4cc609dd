"""The model generator (``python -m learner.serving``) against the learner's own logprobs, as a real server process."""

import pathlib
import signal
import sys

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from learner.logprobs.sampling_transform import processed_logprobs
from learner.model.param_paths import parameter_names
from learner.model.transformer import Transformer, model_config
from rollout_client import ClientConfig, LogprobMode, RolloutClient, RolloutRequest, SamplingParams, collate
from rollout_client.protocol import pb
from tests.rollout_client.conftest import ServerProcess

GOLDEN = pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "hf_golden"

PROMPTS = ([3, 17, 42, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12])
PROCESSED = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02, max_new_tokens=24, stop_token_ids=())
RAW = SamplingParams(max_new_tokens=24, stop_token_ids=())
EOS_IDS = (2, 5)


@pytest.fixture(scope="module")
def learner_model():
    return Transformer(model_config("tiny"), rngs=nnx.Rngs(7))


def learner_weights(model) -> dict[str, np.ndarray]:
    state = nnx.state(model)
    names, _ = parameter_names(state)
    return {name: np.asarray(leaf) for name, leaf in zip(names, jax.tree.leaves(state))}


def serve_learner_model(tmp_path_factory, learner_model, dtype, weights_dir=None):
    extra = ["--weights-dir", str(weights_dir)] if weights_dir else []
    server = ServerProcess([sys.executable, "-m", "learner.serving", "--dtype", dtype,
                            "--max-batch-size", "4", "--max-seq-len", "64", "--decode-steps-per-call", "8",
                            "--eos-ids", *map(str, EOS_IDS), *extra],
                           tmp_path_factory.mktemp(f"model-{dtype}"))
    client = RolloutClient(ClientConfig(target=server.target, ready_timeout_s=60))
    client.publish_weights(1, weights=learner_weights(learner_model))
    return server, client


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    """The float32 server's --weights-dir."""
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def float32_server(tmp_path_factory, learner_model, weights_dir):
    server, client = serve_learner_model(tmp_path_factory, learner_model, "float32", weights_dir)
    yield client
    client.close()
    server.stop(signal.SIGKILL)


def learner_logprobs(model, batch, sampling: SamplingParams | None) -> np.ndarray:
    """Per-token logprobs aligned like `batch.rollout_logprobs`; PROCESSED when `sampling` is given."""
    tokens = jnp.asarray(batch.tokens)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    logits = model.logits(model(tokens, positions, jnp.ones(tokens.shape, bool)))
    if sampling is None:
        logp = jax.nn.log_softmax(logits)
    else:
        transform = lambda row: processed_logprobs(row, sampling.temperature, sampling.top_k, sampling.top_p,
                                                   sampling.min_p)
        logp = jax.vmap(jax.vmap(transform))(logits)
    per_token = jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    return np.where(batch.loss_mask == 1, np.asarray(jnp.pad(per_token, ((0, 0), (1, 0)))), 0.0)


def generate_batch(client, sampling, mode):
    samples = [s for prompt in PROMPTS
               for s in client.generate(RolloutRequest(prompt, sampling, num_samples=2, logprob_mode=mode))]
    return collate(samples, pad_to_multiple=8)


@pytest.mark.parametrize("sampling, mode", [(RAW, LogprobMode.RAW), (PROCESSED, LogprobMode.PROCESSED)])
@pytest.mark.slow  # 27 s on a quiet 2-core run: out of the default run's 15 minutes
def test_float32_server_logprobs_equal_learner_recomputation(float32_server, learner_model, sampling, mode):
    batch = generate_batch(float32_server, sampling, mode)
    assert batch.loss_mask.sum() == 4 * 24 and (batch.policy_versions[batch.loss_mask == 1] == 1).all()
    expected = learner_logprobs(learner_model, batch, sampling if mode == LogprobMode.PROCESSED else None)
    np.testing.assert_allclose(batch.rollout_logprobs, expected, atol=1e-5)


def test_server_info_reports_eos_ids_flag(float32_server):
    assert tuple(float32_server.server_info().eos_token_ids) == EOS_IDS


def test_wrong_shape_weights_are_refused_and_old_weights_keep_serving(float32_server, learner_model):
    request = RolloutRequest(PROMPTS[0], SamplingParams(max_new_tokens=8, stop_token_ids=(), seed=1))
    (before,) = float32_server.generate(request)
    weights = learner_weights(learner_model)
    weights["final_norm/scale"] = np.ones(3, np.float32)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        float32_server.publish_weights(float32_server.server_info().policy_version + 1, weights=weights)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "final_norm/scale" in caught.value.details()
    (after,) = float32_server.generate(request)
    np.testing.assert_array_equal(after.completion_token_ids, before.completion_token_ids)
    np.testing.assert_array_equal(after.logprobs, before.logprobs)


def test_update_from_orbax_checkpoint_of_nnx_state(float32_server, learner_model, weights_dir):
    other_model = Transformer(model_config("tiny"), rngs=nnx.Rngs(8))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(weights_dir / "orbax", nnx.state(other_model))
    version = float32_server.server_info().policy_version + 1
    try:
        float32_server.publish_weights(version, path="orbax", weights_format=pb.WEIGHTS_FORMAT_ORBAX)
        batch = generate_batch(float32_server, RAW, LogprobMode.RAW)
    finally:  # The other tests expect the learner model's weights.
        float32_server.publish_weights(version + 1, weights=learner_weights(learner_model))
    assert (batch.policy_versions[batch.loss_mask == 1] == version).all()
    np.testing.assert_allclose(batch.rollout_logprobs, learner_logprobs(other_model, batch, None), atol=1e-5)
    assert not np.allclose(batch.rollout_logprobs, learner_logprobs(learner_model, batch, None), atol=1e-3)


def test_bfloat16_server_has_measurable_mismatch(tmp_path_factory, learner_model, record_property):
    server, client = serve_learner_model(tmp_path_factory, learner_model, "bfloat16")
    try:
        batch = generate_batch(client, RAW, LogprobMode.RAW)
    finally:
        client.close()
        server.stop(signal.SIGKILL)
    expected = learner_logprobs(learner_model, batch, None)
    mismatch = np.abs(batch.rollout_logprobs - expected)[batch.loss_mask == 1]
    record_property("bf16_mean_abs_logprob_mismatch", float(mismatch.mean()))
    record_property("bf16_max_abs_logprob_mismatch", float(mismatch.max()))
    print(f"bfloat16 server vs float32 learner: mean |dlogp| {mismatch.mean():.2e}, max {mismatch.max():.2e}")
    assert 1e-4 < mismatch.mean() < 0.5


def test_server_from_hf_checkpoint_gives_transformers_logprobs(tmp_path):
    """--hf-path builds the model from config.json (here transformers 5's rope_parameters with Llama 3 scaling, which
    no named config has) and loads its weights: each prompt's first token's RAW logprob is transformers' (float32
    logits from scripts/make_golden_logits.py; 1e-4 covers XLA vs torch summation order)."""
    checkpoint = GOLDEN / "llama3_rope_parameters"
    golden = np.load(checkpoint / "golden.npz")
    input_ids, golden_logprobs = golden["input_ids"], np.asarray(jax.nn.log_softmax(golden["logits"], axis=-1))
    server = ServerProcess([sys.executable, "-m", "learner.serving", "--hf-path", str(checkpoint),
                            "--max-batch-size", "4", "--max-seq-len", "32", "--decode-steps-per-call", "1"], tmp_path)
    client = RolloutClient(ClientConfig(target=server.target, ready_timeout_s=60))
    try:
        assert client.server_info().vocab_size == golden["logits"].shape[1]
        for length in (3, 13, 24):
            sampling = SamplingParams(max_new_tokens=1, stop_token_ids=(), seed=length)
            request = RolloutRequest(input_ids[:length], sampling, num_samples=3, logprob_mode=LogprobMode.RAW)
            for sample in client.generate(request):
                token = sample.completion_token_ids[0]
                np.testing.assert_allclose(sample.logprobs[0], golden_logprobs[length - 1, token], atol=1e-4)
    finally:
        client.close()
        server.stop(signal.SIGKILL)


def test_model_generator_arguments_build_the_checkpoints_model_in_the_learners_dtype(capsys):
    """In-process protocol check of the CLI: --hf-path gives the checkpoint's shapes (Qwen3's q/k norms), and the
    accepted weights have --param-dtype; --hf-path and --model-config exclude each other."""
    from learner.serving.__main__ import add_model_arguments, build_model_generator
    from rollout_client.server.cli import server_parser

    parser = server_parser("python -m learner.serving", "")
    add_model_arguments(parser)
    generator = build_model_generator(parser.parse_args(["--hf-path", str(GOLDEN / "qwen3"), "--param-dtype",
                                                         "bfloat16", "--max-seq-len", "32"]))
    assert (generator.info.vocab_size, generator.info.max_seq_len) == (96, 32)
    assert generator.weight_spec["layers/1/attn/k_norm/scale"] == ((16,), np.dtype(jnp.bfloat16))
    assert {dtype for _, dtype in generator.weight_spec.values()} == {np.dtype(jnp.bfloat16)}
    with pytest.raises(SystemExit):
        parser.parse_args(["--hf-path", str(GOLDEN / "qwen3"), "--model-config", "tiny"])
    assert "not allowed with argument" in capsys.readouterr().err
