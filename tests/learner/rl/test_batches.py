"""Batch assembly and the multi-host payload spec, in process: hand-made samples, values checked by hand."""

import collections

import numpy as np
import pytest

from learner.rl import PayloadSpec, assemble_payload, demonstration_batch, load_config
from learner.rl.batch_assembly import bounded_rewards, check_scored_window
from learner.tasks import load_task
from rollout_client import FinishReason, LogprobMode, Sample, SamplingParams
from rollout_client.sampling_params import SamplerOrder

TASK = load_task("addition_1digit", {"num_prompts": 8})
TOKENIZER = TASK.tokenizer
SAMPLER = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_new_tokens=3, seed=0)


def _sample(record, answer: str, request: str, index: int, version: int = 5) -> Sample:
    completion = np.append(TOKENIZER.encode(answer), TOKENIZER.eos_id).astype(np.int32)
    return Sample(request_id=request, sample_index=index, prompt_token_ids=np.asarray(record["prompt_ids"], np.int32),
                  completion_token_ids=completion, logprobs=np.full(completion.size, -0.5, np.float32),
                  policy_versions=np.full(completion.size, version, np.int64), finish_reason=FinishReason.STOP,
                  sampling=SAMPLER, logprob_mode=LogprobMode.PROCESSED)


def test_groups_become_a_fixed_shape_batch_with_grpo_advantages():
    records = [TASK.prompts()[i] for i in range(3)]
    right = [record["answer"] for record in records]
    groups = [
        [_sample(records[0], right[0], "a", 0), _sample(records[0], "x", "a", 1)],  # rewards 1, 0
        [_sample(records[1], right[1], "b", 0)],  # one sample of two was dropped: one left, the group is dropped
        [_sample(records[2], "y", "c", 0), _sample(records[2], "z", "c", 1)],  # rewards 0, 0: advantage 0
    ]
    spec = PayloadSpec(rows=8, length=16, sampling=False, raw=False)
    payload, collated = assemble_payload(groups, records, TASK, spec, num_samples=2, logprob_mode="processed")
    assert int(payload.real_rows) == 4
    np.testing.assert_array_equal(payload.rewards, [1, 0, 0, 0, 0, 0, 0, 0])
    # GRPO: (r - mean) / (std(ddof=1) + 1e-6): +-0.5 / 0.7071 for the first group, 0 for the second.
    expected = np.array([0.5, -0.5, 0.0, 0.0]) / (np.sqrt(0.5) + 1e-6)
    batch = payload.batch
    for row in range(4):
        prompt = collated.prompt_lengths[row]
        completion = slice(prompt, prompt + collated.completion_lengths[row])
        np.testing.assert_allclose(batch.advantages[row, completion], expected[row], rtol=1e-6)
        assert batch.loss_mask[row, completion].all() and batch.loss_mask[row].sum() == collated.completion_lengths[row]
        np.testing.assert_array_equal(batch.policy_version[row, completion], 5)
        assert batch.attention_mask[row].sum() == prompt + collated.completion_lengths[row]
    assert not batch.loss_mask[4:].any() and not batch.attention_mask[4:].any()  # padding rows
    assert batch.tokens.dtype == np.int32 and batch.policy_version.dtype == np.int32  # the spec's dtypes


class _SkipsAnswer7:
    """The addition task, but its reward fails (NaN: skipped, as the dataset task's on_reward_error = 'skip') on
    completions "7"."""

    tokenizer = TOKENIZER

    def rewards(self, rows, completions):
        rewards = TASK.rewards(rows, completions)
        return np.where([TOKENIZER.decode(c[:-1]) == "7" for c in completions], np.nan, rewards).astype(np.float32)


def test_a_skipped_reward_costs_its_sample_not_its_group():
    """Groups of 3: a skipped reward or a missing sample leaves the group's other two to train, with advantages over
    them (a NumPy float64 GRPO of the two); a group with one scored sample left is dropped and counted."""
    records = [TASK.prompts()[i] for i in range(4)]
    right = [record["answer"] for record in records]
    groups = [[_sample(records[0], right[0], "a", 0), _sample(records[0], "7", "a", 1),
               _sample(records[0], "x", "a", 2)],  # rewards 1, skipped, 0: trains 1, 0
              [_sample(records[1], right[1], "b", 0), _sample(records[1], "x", "b", 1),
               _sample(records[1], right[1], "b", 2)],  # rewards 1, 0, 1
              [_sample(records[2], "7", "c", 0), _sample(records[2], "7", "c", 1),
               _sample(records[2], right[2], "c", 2)],  # one scored: dropped
              [_sample(records[3], "x", "d", 0), _sample(records[3], right[3], "d", 2)]]  # one lost: trains 0, 1
    spec = PayloadSpec(rows=12, length=16, sampling=False, raw=False)
    drops = collections.Counter()
    payload, collated = assemble_payload(groups, records, _SkipsAnswer7(), spec, num_samples=3,
                                         logprob_mode="processed", drops=drops)
    assert int(payload.real_rows) == 7 and collated.tokens.shape[0] == 7 and drops == {"groups_dropped": 1}
    np.testing.assert_array_equal(payload.rewards[:7], [1, 0, 1, 0, 1, 0, 1])
    trained = [s for g in (0, 1, 3) for s in groups[g] if TOKENIZER.decode(s.completion_token_ids[:-1]) != "7"]
    assert [(s.request_id, s.sample_index) for s in trained] == [
        (collated.request_ids[row], collated.sample_indices[row]) for row in range(7)]

    def grpo(rewards):  # float64
        rewards = np.asarray(rewards, np.float64)
        return (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)

    expected = np.concatenate([grpo([1, 0]), grpo([1, 0, 1]), grpo([0, 1])])
    batch = payload.batch
    advantages = (batch.advantages[:7] * batch.loss_mask[:7]).sum(1) / batch.loss_mask[:7].sum(1)
    np.testing.assert_allclose(advantages, expected, rtol=1e-5)
    with pytest.raises(RuntimeError, match="no group of this rollout batch had 2 scored samples: 1 lost samples "
                                           r"\(stale or invalid\), 2 had a skipped reward"):
        assemble_payload([groups[2][:2], groups[2][2:]], records[2:4], _SkipsAnswer7(), spec, 2, "processed")


class _HugeOn7:
    """A plug-in task computing its rewards without `learner.tasks.RewardSet`: float64, 1e300 on completions "7" and
    -inf on "8" (1e300 is finite in float64 and inf in the float32 the update uses)."""

    tokenizer = TOKENIZER

    def rewards(self, rows, completions):
        texts = [TOKENIZER.decode(c[:-1]) for c in completions]
        rewards = TASK.rewards(rows, completions).astype(np.float64)
        return np.select([np.equal(texts, "7"), np.equal(texts, "8")], [1e300, -np.inf], rewards)


def test_a_plugin_tasks_rewards_beyond_the_bound_are_skipped_named_and_counted(caplog):
    records = [TASK.prompts()[i] for i in range(3)]
    right = [record["answer"] for record in records]
    groups = [[_sample(records[0], right[0], "a", 0), _sample(records[0], "7", "a", 1)],  # 1e300: left out
              [_sample(records[1], right[1], "b", 0), _sample(records[1], "x", "b", 1)],  # rewards 1, 0
              [_sample(records[2], "8", "c", 0), _sample(records[2], "y", "c", 1)]]  # -inf: left out
    spec = PayloadSpec(rows=4, length=16, sampling=False, raw=False)
    errors = []
    with caplog.at_level("WARNING", logger="learner.rl.batch_assembly"):
        payload, collated = assemble_payload(groups, records, _HugeOn7(), spec, num_samples=2,
                                             logprob_mode="processed", reward_errors=errors)
    assert int(payload.real_rows) == 2 and collated.tokens.shape[0] == 2
    np.testing.assert_array_equal(payload.rewards, [1, 0, 0, 0])
    assert np.isfinite(payload.batch.advantages).all()
    assert errors == ["reward 1e+300 of sample 1 is beyond |reward| <= 1e+06 (rewards are trained in float32): "
                      "skipped", "reward -inf of sample 4 is beyond |reward| <= 1e+06 (rewards are trained in "
                      "float32): skipped"]
    assert [record.getMessage() for record in caplog.records] == errors
    assert np.isnan(bounded_rewards([1e6, -1e6, 1.0000001e6])[0]).tolist() == [False, False, True]  # |r| <= bound


def test_a_batch_whose_groups_were_all_dropped_is_an_error():
    record = TASK.prompts()[0]
    spec = PayloadSpec(rows=4, length=16, sampling=False, raw=False)
    with pytest.raises(RuntimeError, match="every sample of this rollout batch was dropped"):
        assemble_payload([[], []], [record, record], TASK, spec, 2, "processed")
    with pytest.raises(RuntimeError, match="no group of this rollout batch had 2 scored samples: 1 lost samples"):
        assemble_payload([[_sample(record, "1", "a", 0)]], [record], TASK, spec, 2, "processed")


@pytest.mark.parametrize("overrides, sampling, raw", [
    ([], False, False),  # temperature 1, nothing truncated: the processed distribution is the plain one
    (["rollout.temperature=0.7"], True, False),
    (["rollout.top_p=0.9", "rollout.logprob_mode='raw'"], True, True),  # RAW logprobs rebuilt: the sampler replayed
    (["rollout.logprob_mode='raw'"], False, False),
    (["rollout.top_k=5"], True, False),
])
@pytest.mark.parametrize("order", list(SamplerOrder))
def test_payload_spec_follows_the_rollout_section(overrides, sampling, raw, order):
    config = load_config(None, overrides)
    spec = PayloadSpec.of_run(config.rollout, rows=8, length=32, order=order, scored_window=8)
    assert (spec.sampling, spec.raw, spec.scored_window) == (sampling, raw, 8)
    zeros = spec.zeros()
    assert zeros.batch.sampling is not None if sampling else zeros.batch.sampling is None
    if sampling:  # order codes only for a temperature-last engine (else the program without them)
        assert (zeros.batch.sampling.order is None) == (order == SamplerOrder.TEMPERATURE_FIRST)
    spec.check(zeros)


def test_payload_check_names_the_wrong_leaf():
    spec = PayloadSpec(rows=4, length=8, sampling=False, raw=False)
    zeros = spec.zeros()
    with pytest.raises(ValueError, match=r"batch.policy_version is int64 \(4, 8\), the spec says int32 \(4, 8\)"):
        spec.check(zeros._replace(batch=zeros.batch.replace(policy_version=np.zeros((4, 8), np.int64))))
    with pytest.raises(ValueError, match="structure"):
        PayloadSpec(rows=4, length=8, sampling=True, raw=False).check(zeros)


class _PadIsEos:
    """A task whose tokenizer pads with its eos id, as most Hugging Face tokenizers do."""

    class tokenizer:
        vocab_size, pad_id, eos_ids = 16, 2, (2,)

    def make_prompt(self, rng):
        return np.array([5, 6, 7], np.int32), None

    def noisy_demonstration(self, prompt_ids, rng, noise):
        return np.array([9, 2], np.int32)  # answer then eos (== pad)


def test_demonstrations_keep_the_eos_in_attention_and_loss_when_pad_is_eos():
    batch = demonstration_batch(_PadIsEos(), np.random.default_rng(0), size=2, noise=0.0, length=8, row_multiple=2)
    np.testing.assert_array_equal(batch.tokens[0, :5], [5, 6, 7, 9, 2])
    np.testing.assert_array_equal(batch.attention_mask[0], [1, 1, 1, 1, 1, 0, 0, 0])  # eos attended, padding not
    np.testing.assert_array_equal(batch.loss_mask[0], [0, 0, 0, 1, 1, 0, 0, 0])  # eos trained on


def test_demonstrations_longer_than_the_row_are_cut_there():
    batch = demonstration_batch(_PadIsEos(), np.random.default_rng(0), size=2, noise=0.0, length=4, row_multiple=2)
    np.testing.assert_array_equal(batch.tokens[0], [5, 6, 7, 9])  # as a rollout at its length limit: no eos
    np.testing.assert_array_equal(batch.loss_mask[0], [0, 0, 0, 1])


def test_a_trained_span_longer_than_the_scored_window_is_refused_naming_the_key():
    loss_mask = np.zeros((3, 10), np.float32)
    loss_mask[0, 2:5] = 1  # span 3
    loss_mask[2, [4, 8]] = 1  # span 5, with a hole (a multi-turn row); row 1 trains nothing
    check_scored_window(loss_mask, 5)
    check_scored_window(loss_mask, None)
    with pytest.raises(ValueError, match=r"update.scored_window: the update scores 4 tokens per row from its first "
                                         r"trained one, but row 2 trains tokens 4 to 8 \(a span of 5\).*Set "
                                         r"update.scored_window to at least 5, or to \"off\""):
        check_scored_window(loss_mask, 4)


def test_rollout_and_demonstration_batches_are_checked_against_the_scored_window():
    record = TASK.prompts()[0]
    group = [_sample(record, "12", "a", 0), _sample(record, "3", "a", 1)]  # completions of 3 and 2 tokens
    spec = PayloadSpec(rows=2, length=16, sampling=False, raw=False, scored_window=3)
    payload, _ = assemble_payload([group], [record], TASK, spec, num_samples=2, logprob_mode="processed")
    assert payload.batch.loss_mask.sum(axis=1).tolist() == [3, 2]
    with pytest.raises(ValueError, match=r"update.scored_window: the update scores 2 tokens.*row 0 .*a span of 3"):
        assemble_payload([group], [record], TASK, PayloadSpec(2, 16, False, False, scored_window=2), 2, "processed")
    rng = np.random.default_rng(0)
    demonstration_batch(_PadIsEos(), rng, size=2, noise=0.0, length=8, row_multiple=2, scored_window=2)
    with pytest.raises(ValueError, match=r"update.scored_window: the update scores 1 tokens.*a span of 2"):
        demonstration_batch(_PadIsEos(), rng, size=2, noise=0.0, length=8, row_multiple=2, scored_window=1)
