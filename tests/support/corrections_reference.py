"""NumPy float64 reference implementations of ../shared/reference/corrections.md, written from the formulas.

Independent of the ``corrections`` package (no shared code): every function takes [B, T] arrays (a mask ``m``
where it matters) and returns float64 (or bool) arrays. Conventions, as in the spec:

- masked sum = sum of x where m; masked mean = masked sum / max(count, 1) (0 for an empty mask);
- every log-ratio and every per-sequence sum / mean of log-ratios is clamped to [-SAFETY, SAFETY] before exp;
- per-sequence statistics skip empty rows (a row with no valid token), and are 0 when every row is empty;
- values at masked positions are never read (callers may pass garbage there).
"""

from __future__ import annotations

import math

import numpy as np

SAFETY = 20.0


# ----------------------------------------------------------------------------------------------- helpers


def f64(x):
    return np.asarray(x, dtype=np.float64)


def bmask(m):
    return np.asarray(m).astype(bool)


def clean(x, m):
    """x with every masked position replaced by 0 (so garbage never reaches arithmetic)."""
    return np.where(bmask(m), f64(x), 0.0)


def clamp(x):
    return np.clip(f64(x), -SAFETY, SAFETY)


def sexp(x):
    """exp of a clamped log-ratio."""
    return np.exp(clamp(x))


def msum(x, m):
    """Masked sum over everything."""
    return float(np.sum(clean(x, m)))


def mmean(x, m):
    """Masked mean over everything: masked sum / max(count, 1)."""
    return msum(x, m) / max(float(np.sum(bmask(m))), 1.0)


def row_sum(x, m):
    """Per-row masked sums, [B]."""
    return np.array([msum(x[b], m[b]) for b in range(len(x))])


def row_mean(x, m):
    """Per-row masked means, [B] (0 for an empty row)."""
    return np.array([mmean(x[b], m[b]) for b in range(len(x))])


def rows_valid(m):
    return bmask(m).any(axis=-1)


def mean_over_rows(values, m):
    """Mean of per-row values over non-empty rows; 0 when every row is empty."""
    rows = rows_valid(m)
    return float(np.mean(values[rows])) if rows.any() else 0.0


def bound(ratio, low, high, overflow):
    """Bounds [low, high]: "truncate" clips, "mask" zeroes outside (inclusive)."""
    hi = math.inf if high is None else high
    if overflow == "truncate":
        return np.clip(ratio, low, hi)
    return np.where((ratio >= low) & (ratio <= hi), ratio, 0.0)


def broadcast_rows(values, m):
    """Per-row values [B] -> [B, T], 0 at padding."""
    return np.where(bmask(m), f64(values)[:, None], 0.0)


# ---------------------------------------------------------------------------- section 1: importance weights


def token_tis(lr, m, high=2.0, low=0.0, overflow="truncate"):
    """Token TIS: bound(exp(clamp(lr_t)))."""
    out = np.zeros(np.shape(lr))
    mm = bmask(m)
    out[mm] = bound(sexp(f64(lr)[mm]), low, high, overflow)
    return out


def sequence_tis(lr, m, high=5.0, low=0.0, overflow="truncate"):
    """Sequence TIS: bound(exp(clamp(sum_t m*lr))) on every valid token."""
    lr, mm = f64(lr), bmask(m)
    per_row = np.array([bound(sexp(np.sum(lr[b][mm[b]])), low, high, overflow) for b in range(len(lr))])
    return broadcast_rows(per_row, mm)


def geometric_weight(lr, m, high=None, low=0.0, overflow="truncate"):
    """Geometric sequence weight: bound(exp(clamp(masked_mean(lr))))."""
    lr, mm = f64(lr), bmask(m)
    per_row = []
    for b in range(len(lr)):
        valid = lr[b][mm[b]]
        mean = valid.mean() if valid.size else 0.0
        per_row.append(bound(sexp(mean), low, high, overflow))
    return broadcast_rows(np.array(per_row), mm)


def icepop(lr, m, low=0.5, high=5.0):
    """IcePop: rho where low <= rho <= high (inclusive), else 0."""
    return token_tis(lr, m, high=high, low=low, overflow="mask")


def off_policy_is(lp, roll, m, low=0.0, high=2.0):
    """slime off-policy IS: clip(exp(clamp(lp - roll)), low, high)."""
    return token_tis(clean(lp, m) - clean(roll, m), m, high=high, low=low)


def batch_norm_factor(w, m, level="token"):
    """The batch mean of w (token: masked mean; sequence: mean over valid rows of row masked means), or 1 when
    that mean is <= 1e-8 (normalisation skipped)."""
    w, mm = f64(w), bmask(m)
    mean = mmean(w, mm) if level == "token" else mean_over_rows(row_mean(w, mm), mm)
    return mean if mean > 1e-8 else 1.0


def batch_normalize(w, m, level="token"):
    """w / its batch mean (``batch_norm_factor``)."""
    return f64(w) / batch_norm_factor(w, m, level)


WEIGHTS = {"token": token_tis, "sequence": sequence_tis, "geometric": geometric_weight}


# -------------------------------------------------------------------------------- section 2: rejection masks


def in_bounds(value, low, high):
    keep = np.ones(np.shape(value), dtype=bool)
    if low is not None:
        keep &= value >= low
    if high is not None:
        keep &= value <= high
    return keep


def token_keep(lr, low=None, high=None):
    """Token mask: low <= rho_t <= high (inclusive)."""
    return in_bounds(sexp(lr), low, high)


def outlier_keep(lr, m, low=None, high=None):
    """Veto: a row is dropped (all T positions False) if any valid rho_t > high or < low (strict)."""
    lr, mm = f64(lr), bmask(m)
    out = np.ones(lr.shape, dtype=bool)
    for b in range(len(lr)):
        rho = sexp(lr[b][mm[b]])
        bad = np.zeros(rho.shape, dtype=bool)
        if high is not None:
            bad |= rho > high
        if low is not None:
            bad |= rho < low
        out[b] = not bad.any()
    return out


def k1(lr):
    return clamp(lr)


def k2(lr):
    return 0.5 * clamp(lr) ** 2


def k3(lr):
    l = clamp(lr)
    return np.exp(l) - 1.0 - l


K_STATS = {"k1": k1, "k2": k2, "k3": k3}


def divergence_keep(lr, m, rule, low=None, high=None):
    """verl k-family rejection with bounds meaning what they say.

    token_k1: low <= rho_t <= high; seq_sum_k1 (product): low <= exp(clamp(sum_valid lr)) <= high;
    seq_mean_k1 (geometric): low <= exp(clamp(mean_valid lr)) <= high; k2/k3 with l = clamp(lr): per token, or
    the masked sum / mean / max over valid tokens, keep if stat <= high. Sequence decisions fill the whole row.
    Empty rows: the statistic of no token is 0 (sum, mean) or 0 (max), as the conventions say.
    """
    aggregate, k = rule.rsplit("_", 1)
    lr, mm = f64(lr), bmask(m)
    if aggregate == "token":
        if k == "k1":
            return token_keep(lr, low, high)
        return in_bounds(K_STATS[k](lr), None, high)
    out = np.ones(lr.shape, dtype=bool)
    for b in range(len(lr)):
        valid = lr[b][mm[b]]
        if k == "k1":
            if aggregate == "seq_sum":
                stat = np.sum(valid)
            else:
                stat = valid.mean() if valid.size else 0.0
            out[b] = bool(in_bounds(sexp(stat), low, high))
        else:
            per_token = K_STATS[k](valid)
            if per_token.size == 0:
                stat = 0.0
            elif aggregate == "seq_sum":
                stat = per_token.sum()
            elif aggregate == "seq_mean":
                stat = per_token.mean()
            else:
                stat = per_token.max()
            out[b] = bool(stat <= high)
    return out


def opsm_keep(lp, old, adv, m, delta=1e-4):
    """OPSM: drop the row iff mean_valid(A) < 0 and mean_valid(old - lp) > delta."""
    mm = bmask(m)
    out = np.ones(mm.shape, dtype=bool)
    for b in range(len(mm)):
        a = f64(adv[b])[mm[b]]
        div = (f64(old[b]) - f64(lp[b]))[mm[b]]
        mean_a = a.mean() if a.size else 0.0
        mean_d = div.mean() if div.size else 0.0
        out[b] = not (mean_a < 0 and mean_d > delta)
    return out


# ------------------------------------------------------------------------------------ section 3: objectives


def ppo(lp, old, adv, clip_low=0.2, clip_high=0.2, dual_clip=None):
    """PPO clip; returns (loss, clipfrac indicator, lower-clip indicator or None, ppo_kl per token)."""
    lp, old, adv = f64(lp), f64(old), f64(adv)
    r = sexp(lp - old)
    unclipped = -r * adv
    clipped = -np.clip(r, 1.0 - clip_low, 1.0 + clip_high) * adv
    loss = np.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).astype(np.float64)
    lower = None
    if dual_clip is not None:
        bound_ = -dual_clip * adv
        lower = ((adv < 0) & (loss > bound_)).astype(np.float64)
        loss = np.where(adv < 0, np.minimum(loss, bound_), loss)
    return loss, clipfrac, lower, -clamp(lp - old)


def reinforce(lp, adv):
    return -f64(adv) * f64(lp)


def cispo(lp, old, adv, clip_low=1.0, clip_high=4.0):
    """CISPO: -clip(r) * A * lp (clip detached); clipfrac: clipped != r."""
    lp, old, adv = f64(lp), f64(old), f64(adv)
    r = sexp(lp - old)
    c = np.clip(r, 1.0 - clip_low, 1.0 + clip_high)
    return -c * adv * lp, (c != r).astype(np.float64), -clamp(lp - old)


def sapo(lp, old, adv, tau_pos=1.0, tau_neg=1.05):
    """SAPO: -gate * A, gate = sigmoid(tau (r - 1)) * 4 / tau, tau by the sign of A."""
    lp, old, adv = f64(lp), f64(old), f64(adv)
    r = sexp(lp - old)
    tau = np.where(adv > 0, tau_pos, tau_neg)
    gate = 1.0 / (1.0 + np.exp(-tau * (r - 1.0))) * 4.0 / tau
    return -gate * adv, -clamp(lp - old)


def rollout_is(lp, roll, adv, clip_low=0.2, clip_high=0.2):
    """GLM-5 rollout IS: -where(1-lo < r < 1+hi, r, 0) * A * lp, r = exp(clamp(lp - roll))."""
    lp, roll, adv = f64(lp), f64(roll), f64(adv)
    r = sexp(lp - roll)
    inside = (r > 1.0 - clip_low) & (r < 1.0 + clip_high)
    return -np.where(inside, r, 0.0) * adv * lp, (~inside).astype(np.float64)


def cross_entropy(lp):
    return -f64(lp)


def gspo(lp, old, adv, m, clip_low=3e-4, clip_high=4e-4, log_ratio_cap=10.0):
    """GSPO token form: value per token is PPO clip on s_b = exp(min(mean_valid(lp - old), cap)).

    Returns (loss, d loss_t / d lp_t, clipfrac indicator). Gradient: r_t = sg(s) exp(lp_t - sg(lp_t)) has
    d r_t / d lp_t = s (0 when the cap binds); the loss takes the unclipped branch (or the identical clipped
    branch inside the clip range) unless the clipped branch is strictly larger (then 0).
    """
    lp, old, adv, mm = f64(lp), f64(old), f64(adv), bmask(m)
    loss = np.zeros(lp.shape)
    grad = np.zeros(lp.shape)
    clipfrac = np.zeros(lp.shape)
    for b in range(len(lp)):
        diff = (lp[b] - old[b])[mm[b]]
        seq = diff.mean() if diff.size else 0.0
        capped = seq > log_ratio_cap
        s = math.exp(min(seq, log_ratio_cap))
        a = adv[b][mm[b]]
        unclipped = -a * s
        clipped = -a * min(max(s, 1.0 - clip_low), 1.0 + clip_high)
        is_clipped = clipped > unclipped
        loss[b][mm[b]] = np.maximum(unclipped, clipped)
        clipfrac[b][mm[b]] = is_clipped
        grad[b][mm[b]] = 0.0 if capped else np.where(is_clipped, 0.0, -a * s)
    return loss, grad, clipfrac


def centered_covariance(adv, lp, m):
    """(A - mean_valid A) * (lp - mean_valid lp), batch means over valid tokens."""
    a, l = clean(adv, m), clean(lp, m)
    return (a - mmean(a, m)) * (l - mmean(l, m))


def clip_cov_eligible(lp, old, adv, m, clip_low=0.2, clip_high=0.2, cov_low=1.0, cov_high=5.0):
    """Tokens clip-cov may cut: valid, not clipped by PPO, covariance strictly inside (cov_low, cov_high)."""
    mm = bmask(m)
    lp, old, adv = clean(lp, m), clean(old, m), clean(adv, m)
    r = sexp(lp - old)
    clipped_by_ppo = (-adv * np.clip(r, 1 - clip_low, 1 + clip_high)) > (-adv * r)
    cov = centered_covariance(adv, lp, m)
    return mm & ~clipped_by_ppo & (cov > cov_low) & (cov < cov_high)


def clip_cov_count(m, eligible, ratio):
    """Number of cut tokens: min(max(floor(ratio * n_valid), 1), n_eligible)."""
    n_valid = int(np.sum(bmask(m)))
    return min(max(math.floor(ratio * n_valid), 1), int(np.sum(eligible)))


def kl_cov(lp, old, adv, m, ratio=2e-3, coef=1.0):
    """KL-Cov: -A*r, plus coef*|lp - old| on the max(1, floor(n_valid*ratio)) valid tokens of largest
    covariance. Returns (loss, chosen)."""
    mm = bmask(m)
    lp, old, adv = clean(lp, m), clean(old, m), clean(adv, m)
    loss = -adv * sexp(lp - old)
    cov = centered_covariance(adv, lp, m)
    k = max(1, math.floor(int(mm.sum()) * ratio))
    flat = np.where(mm, cov, -np.inf).ravel()
    order = np.argsort(-flat, kind="stable")[:k]
    chosen = np.zeros(flat.shape, dtype=bool)
    chosen[order] = True
    chosen = chosen.reshape(mm.shape) & mm
    return np.where(chosen, loss + coef * np.abs(lp - old), loss), chosen


# ------------------------------------------------------------------------------------ section 4: reductions


def reduction_terms(loss, m, den_mask, mode, max_len=None, count_rows=False):
    """(numerator, denominator) with the loss summed over ``m`` and counted over ``den_mask``; ``count_rows``:
    Dr. GRPO divides by the rows of ``den_mask`` with a token (verl) instead of B."""
    loss = clean(loss, m)
    mm, dm = bmask(m), bmask(den_mask)
    B, T = mm.shape
    rs = loss.sum(axis=-1)
    counts = dm.sum(axis=-1).astype(np.float64)
    rows = float(np.sum(counts > 0))
    if mode == "token-mean":
        return rs.sum(), counts.sum()
    if mode == "seq-mean-token-mean":
        return float(np.sum([rs[b] / counts[b] for b in range(B) if counts[b] > 0])), rows
    if mode == "seq-mean-token-sum":
        return float(np.sum([rs[b] for b in range(B) if counts[b] > 0])), rows
    if mode == "seq-mean-token-sum-norm":
        return rs.sum(), float((rows if count_rows else B) * (max_len or T))
    if mode == "token-sum":
        return rs.sum(), 0.0  # no division; 0 adds up over micro-batches and max(0, 1) = 1
    raise ValueError(mode)


def reduce(loss, m, den_mask, mode, max_len=None):
    num, den = reduction_terms(loss, m, den_mask, mode, max_len)
    return num / max(den, 1.0)


# ------------------------------------------------------------------------------------ section 5: advantages


def grpo(rewards, group_size, normalize_std=True, eps=1e-6, scored=None):
    """Per group, over its scored samples only (all when ``scored`` is None); 0 elsewhere and for a group of one."""
    r = f64(rewards).reshape(-1, group_size)
    keep = np.ones(r.shape, bool) if scored is None else np.asarray(scored, bool).reshape(r.shape)
    out = np.zeros_like(r)
    for g in range(len(r)):
        s = r[g][keep[g]]
        if s.size < 2:
            continue
        centered = s - s.mean()
        if normalize_std:
            centered = centered / (np.std(s, ddof=1) + eps)
        out[g][keep[g]] = centered
    return out.ravel()


def dr_grpo(rewards, group_size):
    return grpo(rewards, group_size, normalize_std=False)


def rloo(rewards, group_size):
    r = f64(rewards).reshape(-1, group_size)
    out = np.zeros_like(r)
    if group_size > 1:
        for g in range(len(r)):
            for i in range(group_size):
                others = np.delete(r[g], i)
                out[g, i] = r[g, i] - others.mean()
    return out.ravel()


def reinforce_pp(token_rewards, m, gamma=1.0, eps=1e-8):
    """Discounted returns of valid rewards, whitened over valid tokens with the unbiased variance."""
    mm = bmask(m)
    rew = clean(token_rewards, m)
    B, T = rew.shape
    returns = np.zeros((B, T))
    for b in range(B):
        g = 0.0
        for t in reversed(range(T)):
            g = rew[b, t] + gamma * g
            returns[b, t] = g
    vals = returns[mm]
    n = vals.size
    mean = vals.mean() if n else 0.0
    var = np.sum((vals - mean) ** 2) / max(n - 1, 1)
    return np.where(mm, (returns - mean) / np.sqrt(var + eps), 0.0)


def kl_estimate(lp, ref, estimator):
    """k1 and k2 take no exp and are not clamped; k3 clamps the log-ratio before its exp."""
    l = f64(lp) - f64(ref)
    if estimator == "k1":
        return l
    if estimator == "k2":
        return 0.5 * l * l
    l = clamp(l)
    k3_ = np.exp(-l) - 1.0 + l
    if estimator == "k3":
        return k3_
    return np.clip(k3_, -10.0, 10.0)


# ----------------------------------------------------------------------------------- section 6: diagnostics

P = "rollout_corr/"


def pearson(x, y):
    xc, yc = x - x.mean(), y - y.mean()
    spread = math.sqrt(np.mean(xc**2) * np.mean(yc**2))
    return float(np.mean(xc * yc) / spread) if spread > 0 else 0.0


def mismatch(old, roll, m):
    mm = bmask(m)
    old, roll = clean(old, m), clean(roll, m)
    lr = clamp(old - roll)
    rows = rows_valid(mm)
    mt = row_mean(old, mm)  # per-row mean logprob (verl's mean_log_prob_training); log-ppl is -mt
    mr = row_mean(roll, mm)
    diff = mr - mt  # training log-ppl minus rollout log-ppl
    seq_lr = clamp(row_sum(lr, mm))
    any_tok = bool(mm.any())
    vo, vr = old[mm], roll[mm]
    absd = np.abs(vo - vr)
    rho = np.exp(lr)[mm]
    return {
        P + "token_ratio_mean": float(rho.mean()) if any_tok else 0.0,
        P + "token_ratio_std": float(rho.std()) if any_tok else 0.0,
        P + "token_ratio_max": float(rho.max()) if any_tok else 0.0,
        P + "token_ratio_min": float(rho.min()) if any_tok else 0.0,
        P + "kl": mmean(roll - old, mm),
        P + "k3_kl": mmean(np.exp(lr) - lr - 1.0, mm),
        P + "training_ppl": mean_over_rows(np.exp(-mt), mm),
        P + "training_log_ppl": mean_over_rows(-mt, mm),
        P + "rollout_ppl": mean_over_rows(np.exp(-mr), mm),
        P + "rollout_log_ppl": mean_over_rows(-mr, mm),
        P + "log_ppl_diff": mean_over_rows(diff, mm),
        P + "log_ppl_abs_diff": mean_over_rows(np.abs(diff), mm),
        P + "log_ppl_diff_max": float(diff[rows].max()) if rows.any() else 0.0,
        P + "log_ppl_diff_min": float(diff[rows].min()) if rows.any() else 0.0,
        P + "ppl_ratio": mean_over_rows(sexp(diff), mm),
        P + "chi2_token": mmean(np.exp(lr) ** 2, mm) - 1.0 if any_tok else 0.0,
        P + "chi2_seq": mean_over_rows(np.exp(2.0 * seq_lr), mm) - 1.0 if rows.any() else 0.0,
        P + "logprob_abs_diff_mean": float(absd.mean()) if any_tok else 0.0,
        P + "logprob_abs_diff_max": float(absd.max()) if any_tok else 0.0,
        P + "logprob_pearson_corr": pearson(vo, vr) if any_tok else 0.0,
    }


def ess(w, m):
    """1 / masked_mean(n^2), n = w / masked_mean(w); 0 when every weight is 0."""
    w = clean(w, m)
    mean = mmean(w, m)
    if mean <= 0:
        return 0.0
    second = mmean((w / mean) ** 2, m)
    return 1.0 / second if second > 0 else 0.0


def weight_stats(w, raw, m, cap, low=None, level="token"):
    """verl's IS metrics of the bounded weights ``w`` of every valid token and the raw ratios ``raw``; per-row
    statistics over non-empty rows; at a sequence level max/min/fractions are the rows' raw ratios."""
    mm = bmask(m)
    lower = low if low else 1.0 / cap
    vw, vr = f64(w)[mm], f64(raw)[mm]
    n = vw.size
    mean = float(vw.mean()) if n else 0.0
    rows = rows_valid(mm)
    seq = np.array([f64(w)[b][mm[b]].mean() for b in range(len(mm)) if rows[b]])
    raw_seq = np.array([f64(raw)[b][mm[b]].mean() for b in range(len(mm)) if rows[b]])
    row_ratio = np.array([f64(raw)[b][mm[b]].max() for b in range(len(mm)) if rows[b]])
    clipped = np.array([np.mean(f64(w)[b][mm[b]] != f64(raw)[b][mm[b]]) for b in range(len(mm)) if rows[b]])
    if level == "token":
        high, low_ = (float(np.mean(vr > cap)), float(np.mean(vr < lower))) if n else (0.0, 0.0)
        largest, smallest = (float(vw.max()), float(vw.min())) if n else (0.0, 0.0)
    else:
        high, low_ = (float(np.mean(row_ratio > cap)), float(np.mean(row_ratio < lower))) if n else (0.0, 0.0)
        largest, smallest = (float(row_ratio.max()), float(row_ratio.min())) if n else (0.0, 0.0)
    some = seq.size > 0
    return {
        P + "rollout_is_mean": mean,
        P + "rollout_is_std": float(np.sqrt(np.mean((vw - mean) ** 2))) if n else 0.0,
        P + "rollout_is_max": largest,
        P + "rollout_is_min": smallest,
        P + "rollout_is_ratio_fraction_high": high,
        P + "rollout_is_ratio_fraction_low": low_,
        P + "rollout_is_eff_sample_size": ess(w, m),
        P + "rollout_is_seq_mean": float(seq.mean()) if some else 0.0,
        P + "rollout_is_seq_std": float(seq.std(ddof=1)) if seq.size > 1 else 0.0,
        P + "rollout_is_seq_max": float(seq.max()) if some else 0.0,
        P + "rollout_is_seq_min": float(seq.min()) if some else 0.0,
        P + "rollout_is_seq_max_deviation": float(np.abs(seq - 1.0).max()) if some else 0.0,
        P + "rollout_is_seq_fraction_high": float(np.mean(raw_seq > cap)) if some else 0.0,
        P + "rollout_is_seq_fraction_low": float(np.mean(raw_seq < lower)) if some else 0.0,
        P + "tis_clipfrac": float(clipped.mean()) if some else 0.0,
    }


def rule_statistics(name, rule, lr, m):
    """verl's ``compute_rs_metrics`` of one k-family rule on its own over the original mask, in verl's terms:
    k1 is ``-log rho`` with bounds ``[-log high, -log low]``; k2/k3 keep ``stat <= high``."""
    mm = bmask(m)
    agg, k = rule["name"].rsplit("_", 1)
    low, high = rule.get("low"), rule.get("high")
    tok = {"k1": -clamp(lr), "k2": k2(lr), "k3": k3(lr)}[k]
    if k == "k1":
        upper = np.inf if low is None else -np.log(low)
        lower = -np.inf if high is None else -np.log(high)
    else:
        upper, lower = high, None
    rows = rows_valid(mm)
    if agg == "token":
        seq = np.array([tok[b][mm[b]].mean() for b in range(len(mm)) if rows[b]])
        per_token = tok
    else:
        red = {"seq_sum": np.sum, "seq_mean": np.mean, "seq_max": np.max}[agg]
        full = np.array([red(tok[b][mm[b]]) if rows[b] else 0.0 for b in range(len(mm))])
        seq = full[rows]
        per_token = np.broadcast_to(full[:, None], mm.shape)
    v = per_token[mm]
    lo_ = -np.inf if lower is None else lower
    if agg == "token":
        high_f, low_f = float(np.mean(v > upper)), float(np.mean(v < lo_))
        largest, smallest = float(v.max()), float(v.min())
    else:
        high_f, low_f = float(np.mean(seq > upper)), float(np.mean(seq < lo_))
        largest, smallest = float(seq.max()), float(seq.min())
    c = np.clip(v, 0.0 if lower is None else lower, upper)
    out = {
        "mean": float(v.mean()),
        "std": float(np.sqrt(max(np.mean(c ** 2) - np.mean(c) ** 2, 0.0))) if v.size > 1 else 0.0,
        "max": largest, "min": smallest, "fraction_high": high_f,
        "fraction_low": low_f if k == "k1" else 0.0,
        "seq_mean": float(seq.mean()), "seq_std": float(seq.std(ddof=1)) if seq.size > 1 else 0.0,
        "seq_max": float(seq.max()), "seq_min": float(seq.min()), "seq_max_deviation": float(np.abs(seq).max()),
        "seq_fraction_high": float(np.mean(seq > upper)),
    }
    if k == "k1":
        out["seq_fraction_low"] = float(np.mean(seq < lo_))
    return {f"{P}{name}_{key}": value for key, value in out.items()}


def rejection_stats(name, keep, m):
    mm = bmask(m)
    rejected = mm & ~bmask(keep)
    touched = rejected.any(axis=-1).astype(np.float64)
    return {
        f"{P}{name}_masked_fraction": mmean(rejected.astype(np.float64), mm),
        f"{P}{name}_seq_masked_fraction": mean_over_rows(touched, mm),
    }


def staleness(lag, m):
    mm = bmask(m)
    lag = f64(lag)
    if lag.ndim == 1:
        lag = np.broadcast_to(lag[:, None], mm.shape)
    v = lag[mm]
    return {P + "staleness_mean": float(v.mean()) if v.size else 0.0,
            P + "staleness_max": float(v.max()) if v.size else 0.0}


# ------------------------------------------------------------------------------ the pipeline (compute order)


def _rule_keep(rule, lr, keep_rows, valid_rows):
    """One rule's keep for one row [T]: outlier on the original valid mask, others over the surviving mask; a
    row with no surviving token counts as kept."""
    name, low, high = rule["name"], rule.get("low"), rule.get("high")
    if not keep_rows.any():
        return np.ones(lr.shape, dtype=bool)
    if name == "outlier":
        return outlier_keep(lr[None], valid_rows[None], low, high)[0]
    return divergence_keep(lr[None], keep_rows[None], name, low, high)[0]


def pipeline(cfg, lp, adv, m, proximal, roll, ref=None, entropy=None, policy_lag=None, key_cut=None):
    """The documented order of ``compute``, in float64, on a config given as plain data (``config_to_dict``).

    Returns dict(weights, mask, per_token_loss, loss, numerator, denominator, metrics).
    """
    mm = bmask(m)
    B, T = mm.shape
    lp, proximal, roll = clean(lp, mm), clean(proximal, mm), clean(roll, mm)
    adv = f64(adv)
    adv = clean(np.broadcast_to(adv[:, None], (B, T)) if adv.ndim == 1 else adv, mm)
    ref = None if ref is None else clean(ref, mm)
    entropy = None if entropy is None else clean(entropy, mm)
    bypass = cfg["mode"] == "bypass"
    old = roll if bypass else proximal
    trainer = lp if bypass else old
    lr = trainer - roll
    imp = cfg["importance"]
    rules = cfg["rejection"]
    early = [r for r in rules if r["name"] == "outlier"] + [r for r in rules if r["name"].startswith("token")]
    late = [r for r in rules if r["name"] != "outlier" and not r["name"].startswith("token")]

    names = [r["name"] for r in early + late]
    labels = [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]
    wlr = (lp - roll) if imp is not None and imp.get("numerator") == "current" else lr

    keep = mm.copy()
    weights = np.zeros((B, T))  # applied (0 where an early rule dropped the token)
    bounded = np.zeros((B, T))  # bounded ratio of every valid token (the metrics' weights)
    raw = np.zeros((B, T))
    skyrl = {"outlier": "outlier_seq", "seq_mean_k1": "geo_sequence_mask", "seq_sum_k1": "product_sequence_mask"}
    over_under = {label: np.zeros((2, B)) for r, label in zip(early + late, labels) if r["name"] in skyrl}
    opsm = opsm_keep(lp, old, adv, mm, cfg["opsm_delta"]) if cfg["opsm_delta"] is not None else None

    def flag(rule, label, b, k):
        if label not in over_under:
            return
        lo = -np.inf if rule.get("low") is None else rule["low"]
        hi = np.inf if rule.get("high") is None else rule["high"]
        if rule["name"] == "outlier":
            rho = sexp(lr[b])[mm[b]]
            over_under[label][:, b] = [np.any(rho > hi), np.any(rho < lo)]
        else:
            kept = clamp(lr[b])[k]
            stat = (kept.mean() if kept.size else 0.0) if rule["name"] == "seq_mean_k1" else kept.sum()
            over_under[label][:, b] = [sexp(stat) > hi, sexp(stat) < lo]

    for b in range(B):
        k = mm[b].copy()
        for rule, label in zip(early, labels):
            flag(rule, label, b, k)
            k &= _rule_keep(rule, lr[b], k, mm[b])
        if imp is None:
            weights[b] = k.astype(np.float64)
            raw[b] = sexp(lr[b])
            bounded[b] = 1.0
        else:
            # Raw (unbounded) ratios on every valid token: a token's own rho (token level), or its row's ratio
            # over the tokens that survived the outlier/token rules (sequence levels).
            if imp["level"] == "token":
                raw[b] = sexp(wlr[b])
            else:
                survivors = wlr[b][k]
                if imp["level"] == "sequence":
                    raw[b] = sexp(np.sum(survivors))
                else:
                    s_ = clamp(survivors) if imp.get("clamp_each_token") else survivors
                    raw[b] = sexp(s_.mean() if s_.size else 0.0)
            bounded[b] = bound(raw[b], imp["low"], imp["high"], imp["overflow"])
            weights[b] = np.where(k, bounded[b], 0.0)
        for rule, label in zip(late, labels[len(early):]):
            flag(rule, label, b, k)
            k &= _rule_keep(rule, lr[b], k, mm[b])
        if opsm is not None:
            k &= opsm[b]
        keep[b] = k
    weights = np.where(mm, weights, 0.0)
    bounded = np.where(mm, bounded, 0.0)
    metrics = {}
    cap = imp["high"] if imp is not None and imp["high"] else 2.0
    metrics.update(weight_stats(bounded, raw, mm, cap, imp["low"] if imp is not None else None,
                                imp["level"] if imp is not None else "token"))
    if imp is None:  # no weights configured: none is clipped (the ratios still differ from 1)
        metrics[P + "tis_clipfrac"] = 0.0
    if imp is not None and imp["batch_normalize"]:
        metrics[P + "rollout_is_batch_norm_factor"] = batch_norm_factor(weights, mm, imp["level"])
        weights = batch_normalize(weights, mm, imp["level"])
    weights = np.where(keep, weights, 0.0)  # every rejected token weighs 0 in the output (as AReaL's weights)
    if imp is not None and imp["overflow"] == "mask":  # verl's "lo_up" metric: raw ratios outside the bounds
        high = np.inf if imp["high"] is None else imp["high"]
        outside = (f64(raw) < imp["low"]) | (f64(raw) > high)
        metrics[P + "rollout_is_oob_ratio"] = float(outside[mm].mean()) if mm.any() else 0.0

    metrics.update(mismatch(trainer, roll, mm))
    for rule, label in zip(early + late, labels):  # each rule on its own, over the original mask (verl)
        alone = np.stack([_rule_keep(rule, lr[b], mm[b], mm[b]) for b in range(B)])
        metrics.update(rejection_stats(f"rollout_rs_{label}", alone, mm))
        if rule["name"] != "outlier":
            metrics.update(rule_statistics(f"rollout_rs_{label}", rule, lr, mm))
    rows = rows_valid(mm)
    for rule, label in zip(early + late, labels):
        if label in over_under:
            prefix = skyrl[rule["name"]] + label[len(rule["name"]):]
            metrics[f"{P}{prefix}_over_high_ratio"] = float(over_under[label][0][rows].mean())
            metrics[f"{P}{prefix}_under_low_ratio"] = float(over_under[label][1][rows].mean())
    if opsm is not None:
        metrics.update(rejection_stats("rollout_rs_opsm", opsm, mm))
        dropped = [np.mean(~opsm[b][mm[b]]) for b in range(B) if rows[b]]
        metrics[P + "opsm_clipfrac"] = float(np.mean(dropped)) if dropped else 0.0
    metrics.update(rejection_stats("rollout_rs", keep, mm))  # every rule together
    behave = keep & (weights > 0)
    lr_c = clamp(lr)
    metrics[P + "behave_approx_kl"] = float(lr_c[behave].mean()) if behave.any() else 0.0
    metrics[P + "behave_approx_kl_k3"] = float((np.exp(-lr_c) - 1 + lr_c)[behave].mean()) if behave.any() else 0.0

    obj = cfg["objective"]
    name = obj["name"]
    aux = {}
    if name == "ppo":
        loss, clipfrac, lower, ppo_kl = ppo(lp, old, adv, obj["clip_low"], obj["clip_high"], obj["dual_clip"])
        aux = {"pg_clipfrac": clipfrac, "ppo_kl": ppo_kl}
        if lower is not None:
            aux["pg_clipfrac_lower"] = lower
    elif name == "reinforce":
        loss = reinforce(lp, adv)
        aux = {"ppo_kl": -clamp(lp - old)}
    elif name == "cispo":
        loss, clipfrac, ppo_kl = cispo(lp, old, adv, obj["clip_low"], obj["clip_high"])
        aux = {"pg_clipfrac": clipfrac, "ppo_kl": ppo_kl}
        r = sexp(lp - old)
        metrics["actor/cispo/ratio_mean"] = mmean(r, mm)
        metrics["actor/cispo/ratio_clamped_mean"] = mmean(np.clip(r, 1 - obj["clip_low"], 1 + obj["clip_high"]), mm)
        metrics["actor/cispo/ratio_max"] = float(r[mm].max()) if mm.any() else 0.0
        metrics["actor/cispo/ratio_min"] = float(r[mm].min()) if mm.any() else 0.0
    elif name == "sapo":
        loss, ppo_kl = sapo(lp, old, adv, obj["tau_pos"], obj["tau_neg"])
        aux = {"ppo_kl": ppo_kl}
    elif name == "rollout_is":
        loss, clipfrac = rollout_is(lp, roll, adv, obj["clip_low"], obj["clip_high"])
        aux = {"pg_clipfrac": clipfrac}
    elif name == "cross_entropy":
        loss = cross_entropy(lp)
    elif name == "gspo":
        loss, _, clipfrac = gspo(lp, old, adv, mm, obj["clip_low"], obj["clip_high"], obj["log_ratio_cap"])
        aux = {"pg_clipfrac": clipfrac, "ppo_kl": -clamp(lp - old)}
    elif name == "kl_cov":
        loss, chosen = kl_cov(lp, old, adv, mm, obj["kl_cov_ratio"], obj["kl_cov_coef"])
        aux = {"pg_clipfrac": chosen.astype(np.float64), "ppo_kl": np.abs(clamp(lp - old))}
    else:
        raise NotImplementedError(name)
    per_token = loss * weights
    if "pg_clipfrac" in aux:
        metrics["actor/clip_ratio"] = mmean(aux["pg_clipfrac"], mm)  # SkyRL's: over the original mask
    if cfg["kl_coef"] > 0:
        kl = kl_estimate(lp, ref, cfg["kl_estimator"])
        if cfg.get("kl_importance_weighted"):
            kl = sexp(lp - old) * (kl_estimate(lp, ref, "k3") if cfg["kl_estimator"] == "low_var_kl" else kl)
            kl = np.clip(kl, -10, 10) if cfg["kl_estimator"] == "low_var_kl" else kl
        per_token = per_token + cfg["kl_coef"] * kl
        metrics["actor/kl_loss"] = mmean(kl, keep)
    if entropy is not None:
        metrics["actor/entropy"] = mmean(entropy, mm)
        if cfg["entropy_coef"] > 0:
            per_token = per_token - cfg["entropy_coef"] * entropy
    per_token = np.where(keep, per_token, 0.0)
    den_mask = mm if cfg["denominator"] == "original" else keep
    num, den = reduction_terms(per_token, keep, den_mask, cfg["reduction"], count_rows=cfg["denominator"] == "kept")
    loss_value = num / max(den, 1.0)
    metrics["actor/pg_loss"] = loss_value
    for k_, v in aux.items():
        metrics[f"actor/{k_}"] = mmean(v, keep)
    n_valid, n_kept = float(mm.sum()), float(keep.sum())
    metrics[P + "valid_tokens"] = n_valid
    metrics[P + "kept_tokens"] = n_kept
    metrics[P + "all_rejected"] = float(n_valid > 0 and n_kept == 0)
    if policy_lag is not None:
        metrics.update(staleness(policy_lag, mm))
    return {
        "weights": weights,
        "mask": keep.astype(np.float64),
        "per_token_loss": per_token,
        "loss": loss_value,
        "numerator": num,
        "denominator": den,
        "metrics": metrics,
    }


# ------------------------------------------------------------------------------- gradients (for golden checks)


def objective_grad(cfg, lp, old, roll, adv, m):
    """d per-token objective / d lp_t (before weights) for ppo, reinforce, cispo and rollout_is; weights and
    clipped ratios are constants (stop-gradient)."""
    obj = cfg["objective"]
    lp, old, roll, adv = clean(lp, m), clean(old, m), clean(roll, m), clean(adv, m)
    name = obj["name"]
    if name == "reinforce":
        return -adv
    if name == "cispo":
        r = sexp(lp - old)
        return -np.clip(r, 1.0 - obj["clip_low"], 1.0 + obj["clip_high"]) * adv
    if name == "rollout_is":
        r = sexp(lp - roll)
        inside = (r > 1.0 - obj["clip_low"]) & (r < 1.0 + obj["clip_high"])
        return -np.where(inside, r, 0.0) * adv
    if name != "ppo":
        raise NotImplementedError(name)
    x = lp - old
    r = sexp(x)
    loss, clipfrac, _, _ = ppo(lp, old, adv, obj["clip_low"], obj["clip_high"], None)
    grad = np.where((clipfrac > 0) | (np.abs(x) > SAFETY), 0.0, -adv * r)
    if obj["dual_clip"] is not None:
        grad = np.where((adv < 0) & (loss > -obj["dual_clip"] * adv), 0.0, grad)
    return grad


def reduction_coefficients(keep, den_mask, mode, max_len=None):
    """c_t such that the reduced loss is sum_t c_t * loss_t (each mode is linear in the per-token loss)."""
    keep, dm = bmask(keep), bmask(den_mask)
    B, T = keep.shape
    _, den = reduction_terms(np.zeros((B, T)), keep, dm, mode, max_len)
    if mode == "seq-mean-token-mean":
        per_row = np.array([1.0 / c if c > 0 else 0.0 for c in dm.sum(axis=-1)])
        coef = np.broadcast_to(per_row[:, None], (B, T))
    else:
        coef = np.ones((B, T))
    return np.where(keep, coef, 0.0) / max(den, 1.0)


def pipeline_grad(cfg, lp, adv, m, proximal, roll):
    """d loss / d lp of the pipeline with weights as constants (presets: no KL, no entropy)."""
    out = pipeline(cfg, lp, adv, m, proximal, roll)
    mm = bmask(m)
    B, T = mm.shape
    adv = f64(adv)
    adv = np.broadcast_to(adv[:, None], (B, T)) if adv.ndim == 1 else adv
    old = roll if cfg["mode"] == "bypass" else proximal
    g = objective_grad(cfg, lp, old, roll, adv, mm) * out["weights"]
    den_mask = mm if cfg["denominator"] == "original" else out["mask"]
    return g * reduction_coefficients(out["mask"], den_mask, cfg["reduction"])
