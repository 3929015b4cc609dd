"""The migration front doors: a config written as a verl, SkyRL, slime or AReaL user writes it (key for key from
upstream defaults and examples) goes through ``from_<framework>`` and through ``config_from_dict``, and
``corrections.compute`` on one fixed batch gives the loss of the NumPy float64 port of that framework
(``tests/support/reference_ports``) to rtol 1e-5 (float32 JAX against float64 NumPy; XLA may reorder sums).

Also: unknown keys name the nearest match, unsupported settings say why, keys outside the loss are listed by their
own names, verl's preset arguments, the ``skyrl_*`` presets' loss, and ``preset(..., rejection=...)`` merging by rule
name.
"""

from __future__ import annotations

import functools
import pathlib
import re
import types
import warnings

import numpy as np
import pytest

import corrections
from corrections import CorrectionConfig, ImportanceWeights, Objective, RejectionRule
from corrections.frameworks import _areal, _skyrl, _slime, _verl
from tests.support.reference_ports import areal, skyrl, slime, verl

RTOL, ATOL = 1e-5, 1e-6
B, T = 6, 8
DOCS = pathlib.Path(__file__).parents[2] / "docs" / "from-other-frameworks.md"


@functools.cache
def batch():
    """Rows of lengths 8, 5, 3, 8, 6, 1 (no empty row); mismatch old - roll of a few per cent with one row of
    sum ~0.9 (product/seq-sum masks reject it) and one token of ratio ~6 (TIS caps it, IcePop drops it)."""
    rng = np.random.default_rng(7)
    m = np.zeros((B, T), np.float32)
    for i, (start, length) in enumerate([(0, 8), (2, 5), (0, 3), (0, 8), (1, 6), (4, 1)]):
        m[i, start:start + length] = 1
    roll = -rng.uniform(0.1, 2.5, (B, T))
    lr = rng.normal(0.0, 0.05, (B, T))
    lr[3] = 0.9 / 8 + rng.normal(0.0, 0.01, T)
    lr[1, 3] = np.log(6.0)
    d = rng.normal(0.0, 0.15, (B, T))  # lp - old: some tokens clip at 0.2 / 0.28
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    j = dict(m=m, roll=f32(roll), old=f32(roll + lr), lp=f32(roll + lr + d), ref=f32(roll + lr + d + 0.3),
             adv=f32([1.0, -0.7, 0.4, -1.2, 0.8, -0.3]))
    n = {k: np.asarray(v, np.float64) for k, v in j.items()}
    n["A"] = n["adv"][:, None] * n["m"]
    return types.SimpleNamespace(j=j, n=n)


def run(config: CorrectionConfig, **extra) -> types.SimpleNamespace:
    j = batch().j
    out = corrections.compute(j["lp"], j["adv"], j["m"], config, proximal_logprobs=j["old"],
                              rollout_logprobs=j["roll"], rows_per_chunk=0, **extra)
    return types.SimpleNamespace(loss=float(out.loss), mask=np.asarray(out.mask),
                                 metrics={k: float(v) for k, v in out.metrics.items()})


def both_doors(front_door, config):
    """The config through its front door and through config_from_dict (recognised, then explicitly named)."""
    name = front_door.__name__.removeprefix("from_")
    via_door = front_door(config)
    assert corrections.config_from_dict(config) == via_door
    assert corrections.config_from_dict({name: config}) == via_door
    return via_door


# ============================================================================================ verl
VERL_DECOUPLED = {  # verl docs/algo/rollout_corr.md style: token TIS, product RS, DAPO clip-higher, k3 KL loss
    "algorithm": {
        "adv_estimator": "grpo",
        "rollout_correction": {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False,
                               "rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.5_2.0", "bypass_mode": False,
                               "loss_type": "ppo_clip"},
    },
    "actor_rollout_ref": {"actor": {
        "strategy": "fsdp", "ppo_mini_batch_size": 256, "ppo_micro_batch_size_per_gpu": 4, "clip_ratio": 0.2,
        "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0, "loss_agg_mode": "token-mean",
        "entropy_coeff": 0, "use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl",
        "policy_loss": {"loss_mode": "vanilla"}, "optim": {"lr": 1e-6},
    }},
}


def test_verl_decoupled_config_gives_verls_loss_and_metrics():
    """Token TIS + seq_sum_k1 "0.5_2.0" (symmetric, so verl's inverted k1 bounds agree) + vanilla PPO with dual
    clip + low_var_kl KL loss, token-mean over the kept mask: loss, final mask and the shared metrics equal verl's."""
    n = batch().n
    out = run(both_doors(corrections.from_verl, VERL_DECOUPLED), ref_logprobs=batch().j["ref"])
    w, kept, rc = verl.compute_rollout_correction_and_rejection_mask(n["old"], n["roll"], n["m"], "token", 2.0, False,
                                                                     "seq_sum_k1", "0.5_2.0")
    pg, pm = verl.compute_policy_loss_vanilla(n["old"], n["lp"], n["A"], kept, "token-mean", clip_ratio_low=0.2,
                                              clip_ratio_high=0.28, clip_ratio_c=3.0, rollout_is_weights=w)
    kl = verl.agg_loss(verl.kl_penalty(n["lp"], n["ref"], "low_var_kl"), kept, "token-mean")
    assert 0 < kept.sum() < n["m"].sum()  # the rule rejects a row, the test sees the kept-count denominator
    np.testing.assert_allclose(out.loss, pg + 0.1 * kl, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(out.mask, kept)
    for key in ("actor/pg_clipfrac", "actor/ppo_kl", "rollout_corr/kl", "rollout_corr/chi2_token",
                "rollout_corr/rollout_rs_masked_fraction", "rollout_corr/rollout_is_mean"):
        want = {**pm, **rc}[key]
        np.testing.assert_allclose(out.metrics[key], want, rtol=RTOL, atol=ATOL, err_msg=key)


def test_verl_bypass_reinforce_in_dotted_keys_gives_verls_loss():
    """Hydra's dotted command-line keys; bypass REINFORCE with sequence TIS, seq-mean-token-sum."""
    n = batch().n
    config = {"algorithm.rollout_correction.bypass_mode": True, "algorithm.rollout_correction.loss_type": "reinforce",
              "algorithm.rollout_correction.rollout_is": "sequence",
              "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-sum"}
    out = run(both_doors(corrections.from_verl, config))
    want, _ = verl.compute_policy_loss_bypass_mode(n["roll"], n["lp"], n["A"], n["m"], "seq-mean-token-sum",
                                                   loss_type="reinforce", rollout_is="sequence")
    np.testing.assert_allclose(out.loss, want, rtol=RTOL, atol=ATOL)


def test_verl_bypass_ppo_clip_applies_no_weights():
    """verl's bypass PPO computes rollout_is weights for its metrics only: the loss is plain PPO vs the rollout."""
    n = batch().n
    config = corrections.from_verl(rollout_is="token", bypass_mode=True)
    assert config.importance is None and config.mode == "bypass"
    want, _ = verl.compute_policy_loss_bypass_mode(n["roll"], n["lp"], n["A"], n["m"], "token-mean",
                                                   loss_type="ppo_clip", rollout_is="token")
    np.testing.assert_allclose(run(config).loss, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("actor, field, value", [
    ({"policy_loss": {"loss_mode": "gspo"}, "loss_agg_mode": "token-mean"}, "reduction", "seq-mean-token-mean"),
    ({"policy_loss": {"loss_mode": "cispo"}, "clip_ratio_low": None, "clip_ratio": 0.3}, "objective",
     Objective("cispo", clip_low=0.3, clip_high=0.2)),
    ({"policy_loss": {"loss_mode": "kl_cov", "kl_cov_ratio": 0.01}}, "objective",
     Objective("kl_cov", kl_cov_ratio=0.01, kl_cov_coef=0.1)),
    ({"use_kl_loss": True, "kl_loss_type": "k3"}, "kl_estimator", "low_var_kl"),  # verl's k3 is clamped
    ({"use_kl_loss": False, "kl_loss_coef": 0.5}, "kl_coef", 0.0),
    ({"entropy_coeff": 0.01}, "entropy_coef", 0.01),
    ({"clip_ratio": 0.3}, "objective", Objective("ppo", clip_low=0.2, clip_high=0.2, dual_clip=3.0)),
])
def test_verl_actor_keys_map_as_verl_reads_them(actor, field, value):
    """GSPO forces seq-mean-token-mean; clip_ratio counts only where clip_ratio_low/high are null (their YAML
    default is 0.2, so clip_ratio alone changes nothing); kl_cov's coefficient is ppo_kl_coef (verl 0.1)."""
    assert getattr(corrections.from_verl({"actor_rollout_ref": {"actor": actor}}), field) == value


def test_verl_preset_arguments_match_verls_factories():
    """verl's preset arguments are accepted; each preset with its defaults equals from_verl of verl's block."""
    for name, factory in corrections.VERL_PRESETS.items():
        assert corrections.preset(name) == corrections.from_verl(factory()), name
    got = corrections.preset("decoupled_seq_is_rs", is_threshold=3.0, rs_threshold="0.8_1.25")
    assert got.importance == ImportanceWeights("sequence", high=3.0)
    assert got.rejection == (RejectionRule("seq_sum_k1", 0.8, 1.25),)
    icepop = corrections.preset("bypass_pg_token_icepop", threshold=4.0, threshold_lower=0.25, kl_coef=0.1)
    assert (icepop.importance.low, icepop.importance.high, icepop.importance.overflow, icepop.kl_coef) == (
        0.25, 4.0, "mask", 0.1)
    assert corrections.preset("decoupled_k3_rs", rs_threshold=0.05).rejection == (
        RejectionRule("seq_mean_k3", None, 0.05),)


# ============================================================================================ SkyRL
SKYRL_ALGORITHM = {  # SkyRL docs/algorithms/off_policy_correction.mdx: token TIS + geometric mask + outlier veto
    "advantage_estimator": "grpo", "policy_loss_type": "dual_clip", "loss_reduction": "token_mean",
    "eps_clip_low": 0.2, "eps_clip_high": 0.28, "clip_ratio_c": 3.0, "use_kl_loss": False,
    "off_policy_correction": {"tis_ratio_type": "token", "token_tis_ratio_clip_high": 2.0,
                              "sequence_mask_metric": "product", "product_mask_high": 2.0, "product_mask_low": 0.5,
                              "outlier_token_is_threshold_low": 1e-4, "outlier_token_is_threshold_high": 100.0},
}


@pytest.mark.parametrize("config", [{"trainer": {"algorithm": SKYRL_ALGORITHM}}, {"algorithm": SKYRL_ALGORITHM}],
                         ids=["trainer.algorithm", "algorithm"])
def test_skyrl_config_gives_skyrls_loss(config):
    """Token mean over the ORIGINAL mask (SkyRL pre-scales advantages with it), masks after the clipped loss."""
    n = batch().n
    out = run(both_doors(corrections.from_skyrl, config))
    scaled = skyrl.apply_loss_reduction_to_advantages_minibatch(n["A"], n["m"], "token_mean")
    want, _ = skyrl.ppo_policy_loss(n["lp"], n["old"], scaled, SKYRL_ALGORITHM, loss_mask=n["m"],
                                    rollout_logprobs=n["roll"])
    assert out.mask.sum() < n["m"].sum()
    np.testing.assert_allclose(out.loss, want, rtol=RTOL, atol=ATOL)


def test_skyrl_defaults_are_skyrls():
    """SkyRL's defaults: regular PPO (no dual clip), token mean, original denominator, KL loss on at 0.001 (k3,
    clamped: low_var_kl); cross_entropy is a token sum; the deprecated use_tis becomes token TIS."""
    config = corrections.from_skyrl({})
    assert config == CorrectionConfig(objective=Objective("ppo"), kl_coef=0.001, kl_estimator="low_var_kl")
    assert corrections.from_skyrl(policy_loss_type="cross_entropy").reduction == "token-sum"
    assert corrections.from_skyrl(use_tis=True, tis_imp_ratio_cap=3.0).importance == ImportanceWeights("token", 3.0)
    assert corrections.from_skyrl({"cispo": {"cispo_anchor": "rollout"}}, policy_loss_type="cispo").mode == "bypass"


def test_skyrl_presets_use_skyrls_default_loss():
    """skyrl_* presets are regular PPO (SkyRL's default policy_loss_type), not dual clip."""
    for name in (n for n in corrections.PRESETS if n.startswith("skyrl_")):
        assert corrections.preset(name).objective.dual_clip is None, name
    block = {"off_policy_correction": {"tis_ratio_type": "sequence"}, "use_kl_loss": False}
    assert corrections.preset("skyrl_sequence_tis") == corrections.from_skyrl(block)


# ============================================================================================ slime
def slime_loss(tis=None, **kwargs):
    """slime's pg loss as sum of per-sample means (port), divided by B: Tether's seq-mean-token-mean."""
    n = batch().n
    loss, metrics = slime.policy_loss_function(n["lp"], n["old"], n["A"], n["m"], n["roll"], **kwargs)
    return loss / B, metrics


@pytest.mark.parametrize("argv, want_kwargs", [
    ("--advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28 --use-tis --tis-clip 2.0 --tis-clip-low 0",
     dict(eps_clip=0.2, eps_clip_high=0.28, use_tis=True, tis_clip=2.0, tis_clip_low=0.0)),
    ("--eps-clip 0.2 --eps-clip-c 3.0 --use-tis --tis-clip 5.0 --tis-clip-low 0.5 "
     "--custom-tis-function-path slime.backends.megatron_utils.loss.icepop_function",
     dict(eps_clip=0.2, eps_clip_c=3.0, use_tis=True, tis_func=slime.icepop_function, tis_clip=5.0,
          tis_clip_low=0.5)),
    ("--advantage-estimator cispo --eps-clip 1.0 --eps-clip-high 4.0", dict(pg_loss_type="cispo", eps_clip=1.0,
                                                                            eps_clip_high=4.0)),
], ids=["vanilla_tis", "icepop_dual_clip", "cispo"])
def test_slime_arguments_give_slimes_loss(argv, want_kwargs):
    """A slime launch script's arguments, as a string, as tokens, and as a dict of ``--flags``."""
    config = corrections.from_slime(argv)
    assert corrections.from_slime(argv.split()) == config
    assert both_doors(corrections.from_slime, _as_dict(argv)) == config
    want, _ = slime_loss(**want_kwargs)
    np.testing.assert_allclose(run(config).loss, want, rtol=RTOL, atol=ATOL)


def _as_dict(argv: str) -> dict:
    tokens, out = argv.split(), {}
    for i, token in enumerate(tokens):
        if token.startswith("--"):
            nxt = tokens[i + 1] if i + 1 < len(tokens) else "--"
            out[token] = True if nxt.startswith("--") else nxt
    return out


def test_slime_off_policy_is_weights_use_the_current_policy():
    """PR #2084 (8e0d556e): off_policy_is_function multiplies slime's PPO loss by clip(exp(sg(lp) - roll),
    tis_clip_low, tis_clip); written out from its source here, sample-mean reduction."""
    n = batch().n
    config = corrections.from_slime("--use-tis --tis-clip 1.5 --tis-clip-low 0.5 --custom-tis-function-path "
                                    "slime.utils.ppo_utils.off_policy_is_function")
    assert config.importance.numerator == "current" and config.mode == "decoupled"
    pg, _ = slime.compute_policy_loss(n["old"] - n["lp"], n["A"], 0.2, 0.2)
    weight = np.clip(np.exp(n["lp"] - n["roll"]), 0.5, 1.5)
    want = slime.get_sum_of_sample_mean(n["m"])(pg * weight) / B
    np.testing.assert_allclose(run(config).loss, want, rtol=RTOL, atol=ATOL)


def test_slime_switches_map():
    """Per-token loss, rollout logprobs as the PPO anchor, OPSM, and slime's KL loss (k1 by default, unbiased)."""
    config = corrections.from_slime({"calculate_per_token_loss": True, "use-rollout-logprobs": True,
                                     "--use-opsm": True, "--opsm-delta": 1e-3, "--use-kl-loss": True,
                                     "--kl-loss-coef": 0.01, "--use-unbiased-kl": True})
    assert (config.reduction, config.mode, config.opsm_delta, config.kl_coef, config.kl_estimator,
            config.kl_importance_weighted) == ("token-mean", "bypass", 1e-3, 0.01, "k1", True)


# ============================================================================================ AReaL
AREAL_TOKEN_MASK = {"actor": {
    "experiment_name": "gsm8k-grpo", "path": "Qwen/Qwen2.5-1.5B-Instruct", "ppo_n_minibatches": 1,
    "eps_clip": 0.2, "eps_clip_higher": 0.28, "c_clip": 3.0, "recompute_logprob": True, "use_decoupled_loss": True,
    "kl_ctl": 0.0, "rejection_sampling": {"level": "token", "action": "mask", "metric": "ratio", "upper": 5.0},
}}


@pytest.mark.parametrize("rejection_sampling", [
    dict(level="token", action="mask", metric="ratio", upper=5.0),
    dict(level="token", action="clamp", metric="ratio", upper=2.0),
    dict(level="sequence", action="mask", metric="ratio", agg="sum", upper=2.0, lower=0.5),
    dict(level="sequence", action="mask", metric="kl_k2", agg="max", upper=0.02),
], ids=["token_mask", "token_clamp", "sequence_sum_mask", "sequence_max_k2"])
def test_areal_config_gives_areals_loss(rejection_sampling):
    """Decoupled PPO: PPO vs the recomputed policy times the behaviour weight exp(prox - old), filtered or
    clamped as the rejection_sampling block says, divided by the ORIGINAL token count."""
    n = batch().n
    config = {"actor": dict(AREAL_TOKEN_MASK["actor"], rejection_sampling=rejection_sampling)}
    out = run(both_doors(corrections.from_areal, config))
    want, _ = areal.ppo_actor_loss_fn_rs(n["lp"], n["old"], n["roll"], n["A"], 0.2, n["m"], eps_clip_higher=0.28,
                                         c_clip=3.0,
                                         rejection_sampling=dict(_areal.REJECTION_SAMPLING, **rejection_sampling))
    np.testing.assert_allclose(out.loss, want, rtol=RTOL, atol=ATOL)


def test_areal_gspo_is_the_sequence_form():
    """importance_sampling_level='sequence' is AReaL's GSPO: same loss value as the port."""
    n = batch().n
    config = corrections.from_areal({"actor.importance_sampling_level": "sequence", "actor.eps_clip": 3e-3,
                                     "actor.use_decoupled_loss": True})
    assert config.objective.gspo_form == "sequence"
    want, _ = areal.ppo_actor_loss_fn_rs(n["lp"], n["old"], n["roll"], n["A"], 3e-3, n["m"],
                                         importance_sampling_level="sequence")
    np.testing.assert_allclose(run(config).loss, want, rtol=RTOL, atol=ATOL)


def test_areal_modes():
    """Without the decoupled loss AReaL anchors PPO on the recomputed logprobs (recompute_logprob) or on the
    inference engine's (bypass); SAPO takes its temperatures."""
    assert corrections.from_areal(recompute_logprob=True).mode == "decoupled"
    assert corrections.from_areal().mode == "bypass"
    sapo = corrections.from_areal(use_sapo_loss=True, sapo_tau_neg=2.0).objective
    assert (sapo.name, sapo.tau_neg) == ("sapo", 2.0)


# ============================================================================================ errors
@pytest.mark.parametrize("door, config, message", [
    (corrections.from_verl, {"algorithm": {"rollout_correction": {"rollout_is_treshold": 2.0}}},
     "verl.algorithm.rollout_correction: unknown key 'rollout_is_treshold'; did you mean 'rollout_is_threshold'?"),
    (corrections.from_verl, {"actor_rollout_ref.actor.loss_agg_mod": "token-mean"},
     "verl.actor_rollout_ref.actor: unknown key 'loss_agg_mod'; did you mean 'loss_agg_mode'?"),
    (corrections.from_verl, {"algorithim": {}}, "verl: unknown key 'algorithim'; did you mean 'algorithm'?"),
    (corrections.from_skyrl, {"trainer": {"algorithm": {"eps_clip_hi": 0.28}}},
     "skyrl.trainer.algorithm: unknown key 'eps_clip_hi'; did you mean 'eps_clip_high'?"),
    (corrections.from_skyrl, {"algorithm": {"cispo": {"cispo_eps_clip_hgh": 4.0}}},
     "skyrl.trainer.algorithm.cispo: unknown key 'cispo_eps_clip_hgh'; did you mean 'cispo_eps_clip_high'?"),
    (corrections.from_slime, "--use-tis --tis-clp 2.0", "slime: unknown key 'tis_clp'; did you mean 'tis_clip'?"),
    (corrections.from_areal, {"actor": {"rejection_sampling": {"uper": 5.0}}, "actor.use_decoupled_loss": True},
     "areal.actor.rejection_sampling: unknown key 'uper'; did you mean 'upper'?"),
])
def test_unknown_keys_name_the_nearest_match(door, config, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        door(config)
    if not isinstance(config, str):  # config_from_dict names the same key and match (the framework may be unknown)
        key, match = re.findall(r"'([^']*)'", message)
        with pytest.raises(ValueError, match=f"{key!r}.*{match!r}"):
            corrections.config_from_dict(config)


@pytest.mark.parametrize("door, config, match", [
    (corrections.from_verl, {"actor_rollout_ref.actor.policy_loss.loss_mode": "gpg"}, "loss_mode='gpg' is not supp"),
    (corrections.from_verl, {"actor_rollout_ref.actor.kl_loss_type": "abs"}, "kl_loss_type='abs' is not supported"),
    (corrections.from_verl, {"bypass_mode": True, "actor": {"policy_loss": {"loss_mode": "gspo"}}},
     "bypass mode replaces it"),
    (corrections.from_skyrl, {"loss_reduction": "prompt_mean"}, "loss_reduction='prompt_mean' is not supported"),
    (corrections.from_skyrl, {"off_policy_correction": {"token_mask_is_threshold_low": 0.5}}, "set both"),
    (corrections.from_slime, "--use-tis --custom-tis-function-path my.module:my_tis", "cannot be read from its path"),
    (corrections.from_areal, {"actor.use_decoupled_loss": True, "actor.rejection_sampling.metric": "kl_k3"},
     "metric='kl_k3' is not supported"),
    (corrections.from_areal, {"actor.m2_threshold": 0.04}, "M2PO"),
])
def test_unsupported_settings_say_why(door, config, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        door(config)


@pytest.mark.parametrize("door, config, field", [
    (corrections.from_verl, {"defaults": [{"actor@actor_rollout_ref.actor": "dp_actor"}, "_self_"]}, "verl.defaults"),
    (corrections.from_verl, {"actor_rollout_ref.actor": {"clip_ratio": 0.2, "defaults": [{"../optim@optim": "x"}]}},
     "verl.actor_rollout_ref.actor.defaults"),
    (corrections.from_verl, {"actor": {"defaults": ["actor"]}}, "verl.actor_rollout_ref.actor.defaults"),
    (corrections.from_skyrl, {"defaults": ["_self_"], "trainer": {"algorithm": {}}}, "skyrl.defaults"),
])
def test_a_hydra_defaults_list_is_refused_naming_the_field_and_the_fix(door, config, field):
    """The front doors take plain data: a Hydra ``defaults`` list (files to compose, even verl's stock entries) is
    refused, naming the field and the reader that composes the file, through ``config_from_dict`` too."""
    message = (f"{field}: a Hydra defaults list (files to compose) is not read here; read the file with "
               "learner.rl.framework_files.read_file (which composes its files and checks the entries left), or pass "
               "the resolved config.")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        door(config)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        corrections.config_from_dict({door.__name__.removeprefix("from_"): config})


def test_config_from_dict_routing():
    """Tether's own form still parses (errors name the field); keys that fit two frameworks ask which one."""
    assert corrections.config_from_dict({"importance": {"level": "token"}}).importance.level == "token"
    with pytest.raises(ValueError, match=r"^config: unknown field\(s\) clip; known:"):
        corrections.config_from_dict({"clip": 0.2})
    with pytest.raises(ValueError, match="fit slime and areal; wrap them"):
        corrections.config_from_dict({"eps_clip": 0.2})
    assert corrections.config_from_dict({"areal": {"eps_clip": 0.3}}).objective.clip_low == 0.3


# ============================================================================================ keys outside the loss
def outside(call) -> tuple[str, dict]:
    """(message, settings) of the one TrainingKeysWarning ``call()`` gives."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    listed = [w.message for w in caught if w.category is corrections.TrainingKeysWarning]
    assert len(listed) == 1, [str(w.message) for w in caught]
    return str(listed[0]), listed[0].settings


@pytest.mark.parametrize("framework, config, want", [
    ("verl", {"algorithm": {"adv_estimator": "gae", "rollout_correction": {"rollout_is": "token"}},
              "actor_rollout_ref": {"rollout": {"n": 5}, "actor": {"ppo_epochs": 2, "optim": {"lr": 1e-5},
                                                                   "clip_ratio_high": 0.28}}},
     {"algorithm.adv_estimator": "gae", "actor_rollout_ref.rollout": {"n": 5},
      "actor_rollout_ref.actor.ppo_epochs": 2, "actor_rollout_ref.actor.optim": {"lr": 1e-5}}),
    ("verl", {"ppo_epochs": 3, "clip_ratio_high": 0.28}, {"actor_rollout_ref.actor.ppo_epochs": 3}),  # flat
    ("skyrl", {"trainer": {"update_epochs_per_batch": 2, "algorithm": {"advantage_estimator": "rloo",
                                                                       "eps_clip_high": 0.28}}},
     {"trainer.update_epochs_per_batch": 2, "trainer.algorithm.advantage_estimator": "rloo"}),
    ("slime", "--lr 1e-5 --eps-clip 0.2 --kl-coef 0", {"--lr": 1e-5, "--kl-coef": 0}),
    ("areal", {"experiment_name": "x", "actor": {"eps_clip": 0.2, "optimizer": {"lr": 1e-5}}},
     {"experiment_name": "x", "actor.optimizer": {"lr": 1e-5}}),
])
def test_keys_outside_the_loss_are_listed_once_by_their_own_names(framework, config, want):
    """The framework's keys a front door accepts and does not apply (batching, optimizer, advantages, ...) are
    listed in one TrainingKeysWarning, each with its block as the framework names it; loss keys are not."""
    door = getattr(corrections, f"from_{framework}")
    message, settings = outside(lambda: door(config))
    assert settings == want
    assert message.startswith(f"{framework}: keys outside the loss are accepted and not applied")
    assert all(key in message for key in want)
    if not isinstance(config, str):
        assert outside(lambda: corrections.config_from_dict({framework: config}))[1] == want


@pytest.mark.parametrize("call", [
    lambda: corrections.from_verl({"algorithm": {"rollout_correction": {"rollout_is": "token"}},
                                   "actor_rollout_ref": {"actor": {"clip_ratio_high": 0.28}}}),
    lambda: corrections.from_skyrl({"trainer": {"algorithm": {"eps_clip_high": 0.28}}}),
    lambda: corrections.from_slime("--use-tis --tis-clip 2.0"),
    lambda: corrections.from_areal({"actor": {"eps_clip": 0.2}}),
])
def test_loss_keys_alone_list_nothing(call):
    with warnings.catch_warnings():
        warnings.simplefilter("error", corrections.TrainingKeysWarning)
        call()


def test_the_loss_is_unchanged_by_the_keys_outside_it():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", corrections.TrainingKeysWarning)
        with_training = corrections.from_verl({"actor_rollout_ref.actor.clip_ratio_high": 0.28,
                                               "actor_rollout_ref.actor.ppo_epochs": 4})
    assert with_training == corrections.from_verl({"actor_rollout_ref.actor.clip_ratio_high": 0.28})
    assert with_training.objective.clip_high == 0.28


# ============================================================================================ presets
def test_preset_rejection_overrides_merge_by_rule_name():
    """A rule of the same name gets new bounds (configs/bf16_server.toml widens Geo-RS so), a new name is added,
    ``rejection_mode='replace'`` drops the preset's rules, and ``rejection=[]`` without it is an error."""
    base = "decoupled_geo_rs_token_tis"
    widened = corrections.preset(base, rejection=[{"name": "seq_mean_k1", "low": 0.98, "high": 1.02}])
    assert widened.rejection == (RejectionRule("seq_mean_k1", 0.98, 1.02),)
    assert corrections.preset(base, rejection=[{"name": "geometric", "high": 1.01}]).rejection == (
        RejectionRule("seq_mean_k1", 0.999, 1.01),)
    added = corrections.preset(base, rejection=[{"name": "outlier", "low": 1e-4, "high": 100.0}])
    assert [r.name for r in added.rejection] == ["seq_mean_k1", "outlier"]
    replaced = corrections.preset(base, rejection=[], rejection_mode="replace")
    assert replaced.rejection == () and replaced.importance == ImportanceWeights("token", 2.0)
    with pytest.raises(ValueError, match="rejection_mode='replace' to drop them"):
        corrections.preset(base, rejection=[])
    with pytest.raises(ValueError, match="unknown key 'rs_treshold'; did you mean 'rs_threshold'"):
        corrections.preset(base, rs_treshold=0.1)


# ============================================================================================ docs
@pytest.mark.parametrize("module, tables", [
    (_verl, ("ROLLOUT_CORRECTION", "ACTOR", "POLICY_LOSS")),
    (_skyrl, ("ALGORITHM", "OFF_POLICY_CORRECTION")),
    (_slime, ("ARGUMENTS",)),
    (_areal, ("ACTOR", "REJECTION_SAMPLING")),
])
def test_docs_table_every_key_a_front_door_reads(module, tables):
    """docs/from-other-frameworks.md names every key a front door reads (in backticks)."""
    text = DOCS.read_text()
    for table in tables:
        for key in getattr(module, table):
            names = {key, "--" + key.replace("_", "-")}
            assert any(f"`{name}`" in text for name in names), f"{module.__name__}.{table}: {key}"
