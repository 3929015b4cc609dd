"""``corrections.OBJECTIVES`` is the one list of objectives: ``Objective.name`` validation, the dispatch in
``compute`` and its input checks all read it, so one entry is all a new objective takes.

Values are checked against the float64 reference (tests/support/corrections_reference.py) on test_golden's batch.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

import corrections
from corrections import CorrectionConfig, Objective, ObjectiveSpec
from tests.corrections.test_golden import batch, check_compute, close
from tests.support import corrections_reference as ref

NAMES = ("ppo", "gspo", "cispo", "sapo", "reinforce", "rollout_is", "clip_cov", "kl_cov", "cross_entropy")
# Ratio 1 makes clip-cov cut every eligible token (count = n_valid), so its random choice does not matter; the
# window (0, 1e9) makes the tokens of positive covariance eligible.
CLIP_COV = dict(clip_cov_ratio=1.0, clip_cov_low=0.0, clip_cov_high=1e9)


@pytest.fixture(scope="module")
def data():
    return batch()


def config(name: str) -> CorrectionConfig:
    return CorrectionConfig(objective=Objective(name, **(CLIP_COV if name == "clip_cov" else {})))


def run(cfg, j, rows=slice(None), **inputs):
    return corrections.compute(j["lp"][rows], j["adv"][rows], j["m"][rows], cfg,
                               **{name: j[key][rows] for name, key in inputs.items()})


def test_the_registry_lists_every_objective_in_error_order():
    assert tuple(corrections.OBJECTIVES) == NAMES
    with pytest.raises(ValueError) as error:
        corrections.config_from_dict({"objective": {"name": "ppo2"}})
    assert str(error.value) == f"objective.name='ppo2' is not an option; use one of {', '.join(NAMES)}."
    with pytest.raises(TypeError):
        corrections.OBJECTIVES["ppo2"] = corrections.OBJECTIVES["ppo"]  # read-only


def test_the_registry_records_which_inputs_each_objective_reads():
    def having(flag):
        return {name for name, spec in corrections.OBJECTIVES.items() if getattr(spec, flag)}

    assert having("reads_proximal") == {"ppo", "gspo", "cispo", "sapo", "clip_cov", "kl_cov"}
    assert having("reads_rollout") == {"rollout_is"}
    assert having("whole_batch") == {"clip_cov", "kl_cov"}


@pytest.mark.parametrize("name", sorted(set(NAMES) - {"clip_cov"}))
def test_every_registered_objective_computes_the_float64_reference(data, name):
    """Weights, mask, per-token loss, reduced loss and every metric (``actor/pg_clipfrac`` ...) of ``compute``."""
    out, want = check_compute(config(name), data)
    assert np.any(np.asarray(want["per_token_loss"]) != 0.0)
    close(out.metrics["actor/pg_loss"], want["loss"])


def test_clip_cov_cuts_the_gradient_of_every_eligible_ppo_token(data):
    """clip-cov (random, so not in the reference pipeline) is PPO with the eligible tokens' loss cut."""
    j, n = data
    cfg = config("clip_cov")
    out = run(cfg, j, proximal_logprobs="old")
    ppo = ref.pipeline(corrections.config_to_dict(cfg.replace(objective=Objective("ppo"))), n["lp"], n["adv"],
                       n["m"], n["old"], n["roll"])
    adv = np.broadcast_to(n["adv"][:, None], n["m"].shape)
    eligible = ref.clip_cov_eligible(n["lp"], n["old"], adv, n["m"], cov_low=0.0, cov_high=1e9)
    assert 0 < eligible.sum() < n["m"].sum()
    close(out.per_token_loss, np.where(eligible, 0.0, ppo["per_token_loss"]))
    close(out.metrics["actor/pg_clipfrac"], eligible.sum() / n["m"].sum())


@pytest.mark.parametrize("name", NAMES)
def test_the_read_flags_decide_which_inputs_compute_requires(data, name):
    j, _ = data
    spec, cfg = corrections.OBJECTIVES[name], config(name)
    assert cfg.needs_rollout_logprobs is spec.reads_rollout
    if spec.reads_proximal:
        with pytest.raises(ValueError, match=f"proximal_logprobs is required by objective '{name}'"):
            run(cfg, j, rollout_logprobs="roll")
    if spec.reads_rollout:
        with pytest.raises(ValueError, match="rollout_logprobs is required"):
            run(cfg, j, proximal_logprobs="old")
    needed = {}  # the flagged inputs are enough, and the loss does not depend on the others
    if spec.reads_proximal:
        needed["proximal_logprobs"] = "old"
    if spec.reads_rollout:
        needed["rollout_logprobs"] = "roll"
    given_all = run(cfg, j, proximal_logprobs="old", rollout_logprobs="roll")
    assert float(run(cfg, j, **needed).loss) == float(given_all.loss)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.slow  # 24 s on a quiet 2-core run: out of the default run's 15 minutes
def test_only_whole_batch_objectives_let_other_rows_change_a_row(data, name):
    """Per-sequence objectives give each row the loss it gets alone; whole-batch ones select across rows."""
    j, _ = data
    cfg = config(name)
    inputs = dict(proximal_logprobs="old", rollout_logprobs="roll")
    whole = run(cfg, j, **inputs).per_token_loss
    alone = np.concatenate([run(cfg, j, slice(b, b + 1), **inputs).per_token_loss for b in range(len(whole))])
    if corrections.OBJECTIVES[name].whole_batch:
        assert np.max(np.abs(alone - whole)) > 0.1
    else:
        np.testing.assert_allclose(alone, whole, rtol=1e-6, atol=1e-7)


def test_one_registry_entry_adds_an_objective(data, monkeypatch):
    """A new entry validates, is dispatched to, reports its aux metric and has its inputs required: the registry
    binding that ``corrections._config`` reads is the only one the package consults."""
    spec = ObjectiveSpec(lambda o, lp, roll, adv, **_: (-adv * (lp - roll), {"lp_minus_roll": lp - roll}),
                         reads_rollout=True)
    monkeypatch.setattr(corrections._config, "OBJECTIVES", types.MappingProxyType({"new": spec}))
    j, n = data
    cfg = CorrectionConfig(objective=Objective("new"))
    with pytest.raises(ValueError, match="rollout_logprobs is required"):
        run(cfg, j)
    out = run(cfg, j, rollout_logprobs="roll")
    adv, m = np.broadcast_to(n["adv"][:, None], n["m"].shape), n["m"]
    close(out.per_token_loss, np.where(m, -adv * (n["lp"] - n["roll"]), 0.0))
    close(out.metrics["actor/lp_minus_roll"], (n["lp"] - n["roll"])[m].mean())
    with pytest.raises(ValueError, match="use one of new[.]"):
        Objective("ppo")
