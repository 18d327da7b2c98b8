"""Tests for qerl_jax.grpo (advantages, losses, KL, metrics) and qerl_jax.update (the update step).

References are float64 numpy written here, independently of the implementation, or worked by hand.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from qerl_jax import grpo, update

# ---------------------------------------------------------------------------------------------
# The two-sequence hand example
# ---------------------------------------------------------------------------------------------
# Sequence 0 has 3 unmasked tokens and advantage +1, sequence 1 has 2 and advantage -0.5;
# importance ratios pi/pi_old are chosen round. Masked slots hold NaN to prove they cannot leak.
RATIOS = np.array([[1.0, 1.5, 0.5, 1.0], [0.7, 1.1, 1.0, 1.0]])
OLD = np.log(np.array([[0.5, 0.2, 0.3, 0.9], [0.4, 0.6, 0.1, 0.1]]))
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.int32)
ADV = np.array([1.0, -0.5])
EPS, EPS_HIGH = 0.2, 0.28


def _hand_inputs():
    lp = OLD + np.log(RATIOS)
    lp = np.where(MASK == 1, lp, np.nan)
    old = np.where(MASK == 1, OLD, np.nan)
    return lp.astype(np.float32), old.astype(np.float32)


def _np_per_token(lp, old, adv, eps_low, eps_high, beta=0.0, ref=None, est="k3"):
    """float64 reference of the per-token clipped loss (+ beta * KL)."""
    lp, old = np.asarray(lp, np.float64), np.asarray(old, np.float64)
    r = np.exp(lp - old)
    a = np.asarray(adv, np.float64)[:, None]
    c = np.clip(r, 1 - eps_low, 1 + eps_high)
    loss = -np.minimum(r * a, c * a)
    if beta:
        d = np.asarray(ref, np.float64) - lp
        kl = {"k1": -d, "k2": 0.5 * d * d, "k3": np.exp(d) - d - 1}[est]
        loss = loss + beta * kl
    return loss


def _np_per_token_cispo(lp, old, adv, eps_max):
    """float64 reference of CISPO's per-token loss value, -min(r, eps_max) * A * logp (MiniMax-M1 eq. 4)."""
    lp, old = np.asarray(lp, np.float64), np.asarray(old, np.float64)
    return -np.minimum(np.exp(lp - old), eps_max) * np.asarray(adv, np.float64)[:, None] * lp


def _np_per_token_sapo(lp, old, adv, tau_pos=1.0, tau_neg=1.05):
    """float64 reference of SAPO's per-token loss, -sigmoid(tau (r - 1)) * 4 / tau * A (arXiv:2511.20347; TRL)."""
    r = np.exp(np.asarray(lp, np.float64) - np.asarray(old, np.float64))
    a = np.asarray(adv, np.float64)[:, None]
    tau = np.where(a > 0, tau_pos, tau_neg)
    return -4.0 / tau / (1.0 + np.exp(-tau * (r - 1.0))) * a


def _np_reduce(per_token, mask, loss_type, max_len):
    m = np.asarray(mask, bool)
    pt = np.where(m, per_token, 0.0)
    if loss_type in ("grpo", "sapo"):
        n = m.sum(1)
        keep = n > 0
        return (pt.sum(1)[keep] / n[keep]).mean() if keep.any() else 0.0
    if loss_type in ("bnpo", "dapo", "cispo"):
        return pt.sum() / max(m.sum(), 1)
    return pt.sum() / (m.shape[0] * max_len)


# Worked fully by hand (epsilon 0.2, epsilon_high 0.28, so the ratio is clipped to [0.8, 1.28]):
#   seq 0, A = +1:   ratios 1.0, 1.5, 0.5 -> clipped 1.0, 1.28, 0.8
#                    -min(r*A, clip(r)*A) = -1.0, -1.28, -0.5        sum -2.78, mean -0.926667
#   seq 1, A = -0.5: ratios 0.7, 1.1     -> clipped 0.8, 1.1
#                    r*A = -0.35, -0.55; clip*A = -0.40, -0.55
#                    -min(...) = 0.40, 0.55                          sum  0.95, mean  0.475
#   grpo    = (-0.926667 + 0.475) / 2        = -0.2258333
#   bnpo    = dapo = (-2.78 + 0.95) / 5 tokens = -0.366
#   dr_grpo = (-2.78 + 0.95) / (2 seqs * 4)  = -0.22875
#   clip metrics over 5 tokens: low (r < 0.8, A < 0) = seq1 tok0 -> 0.2; high (r > 1.28, A > 0) =
#   seq0 tok1 -> 0.2; region 0.4. (seq0 tok2 has r = 0.5 < 0.8 but A > 0: not low-clipped.)
# cispo (epsilon_high 0.28 as its cap): every ratio is above 0.28, so each weight is 0.28:
#   seq 0: -0.28 * log(0.5, 0.3, 0.15) = 0.194081, 0.337112, 0.531194; seq 1: +0.14 * log(0.28, 0.66) = -0.178215,
#   -0.058172; sum 0.826000 / 5 tokens = 0.1652000; its clip metric: A > 0 and r > 0.28 on seq 0's 3 tokens = 0.6
# sapo (tau 1.0 for A > 0, 1.05 otherwise): seq 0: -4 * sigmoid(r - 1) at r = 1, 1.5, 0.5 = -2, -2.4898373,
#   -1.5101627, mean -2; seq 1: 4 / 1.05 * 0.5 * sigmoid(1.05 (r - 1)) at r = 0.7, 1.1 = 0.8036091, 1.0023351, mean
#   0.9029721; as grpo: (-2 + 0.9029721) / 2 = -0.5485140; no hard clip, so clip metrics 0
HAND = {"grpo": -0.2258333333, "bnpo": -0.366, "dapo": -0.366, "dr_grpo": -0.22875, "cispo": 0.1651999670,
        "sapo": -0.5485139636}


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_hand_example_each_loss_type(loss_type):
    lp, old = _hand_inputs()
    loss, met = grpo.policy_loss(lp, old, ADV, MASK, loss_type=loss_type, epsilon=EPS,
                                 epsilon_high=EPS_HIGH, max_completion_length=4)
    per = {"cispo": lambda: _np_per_token_cispo(np.nan_to_num(lp), np.nan_to_num(old), ADV, EPS_HIGH),
           "sapo": lambda: _np_per_token_sapo(np.nan_to_num(lp), np.nan_to_num(old), ADV)}.get(
               loss_type, lambda: _np_per_token(np.nan_to_num(lp), np.nan_to_num(old), ADV, EPS, EPS_HIGH))()
    ref = _np_reduce(per, MASK, loss_type, 4)
    np.testing.assert_allclose(float(loss), ref, rtol=1e-6)
    np.testing.assert_allclose(float(loss), HAND[loss_type], rtol=1e-6)
    low, high, region = {"cispo": (0.0, 0.6, 0.6), "sapo": (0.0, 0.0, 0.0)}.get(loss_type, (0.2, 0.2, 0.4))
    np.testing.assert_allclose(float(met["clip_ratio/low_mean"]), low, rtol=1e-6, atol=0)
    np.testing.assert_allclose(float(met["clip_ratio/high_mean"]), high, rtol=1e-6)
    np.testing.assert_allclose(float(met["clip_ratio/region_mean"]), region, rtol=1e-6)
    assert float(met["num_tokens"]) == 5


def test_hand_example_gradient_grpo():
    lp, old = _hand_inputs()
    g = jax.grad(lambda x: grpo.policy_loss(x, old, ADV, MASK, loss_type="grpo", epsilon=EPS,
                                            epsilon_high=EPS_HIGH)[0])(jnp.asarray(lp))
    # d/dlogp of -r*A is -r*A where the unclipped branch is active, 0 where clipped; grpo then
    # divides by the sequence's token count and the number of sequences (2).
    r, a = RATIOS, ADV[:, None]
    active = (r * a <= np.clip(r, 1 - EPS, 1 + EPS_HIGH) * a) & (MASK == 1)
    expected = np.where(active, -r * a, 0.0) / MASK.sum(1, keepdims=True) / 2
    np.testing.assert_allclose(np.asarray(g), expected, rtol=1e-6, atol=1e-8)
    assert np.all(np.isfinite(np.asarray(g)))


def _np_per_token_gspo(lp, old, adv, mask, eps_low, eps_high):
    """float64 reference of GSPO's per-token loss: each token of a sequence takes the sequence's ratio
    exp(mean of its unmasked log-ratios) (Zheng et al. 2025, eq. 7)."""
    m = np.asarray(mask, bool)
    d = np.where(m, np.asarray(lp, np.float64) - np.asarray(old, np.float64), 0.0)
    r = np.exp(d.sum(1, keepdims=True) / np.maximum(m.sum(1, keepdims=True), 1))
    a = np.asarray(adv, np.float64)[:, None]
    return np.broadcast_to(-np.minimum(r * a, np.clip(r, 1 - eps_low, 1 + eps_high) * a), m.shape)


# GSPO on the hand example: sequence ratios are geometric means of the token ratios,
#   seq 0: (1.0 * 1.5 * 0.5) ** (1/3) = 0.75 ** (1/3) = 0.9085603, A = +1
#   seq 1: (0.7 * 1.1) ** (1/2) = 0.77 ** 0.5 = 0.8774964, A = -0.5
# clip range [0.8, 1.28]: neither is clipped; per-token losses -0.9085603 and +0.4387482
#   grpo = (-0.9085603 + 0.4387482) / 2 = -0.2349060; dapo = (3 * -0.9085603 + 2 * 0.4387482) / 5 = -0.3696369
# clip range [0.95, 1.05]: seq 1 (A < 0, r < 0.95) is clipped to 0.95: loss 0.475 and no gradient;
#   seq 0 (A > 0, r < 0.95) is not (min picks r * A); grpo = (-0.9085603 + 0.475) / 2 = -0.2167802;
#   clip_ratio/low_mean counts seq 1's 2 tokens of 5 = 0.4
GSPO_HAND = {(0.2, 0.28, "grpo"): -0.2349060, (0.2, 0.28, "dapo"): -0.3696369, (0.05, 0.05, "grpo"): -0.2167802}


@pytest.mark.parametrize("eps_low,eps_high,loss_type", list(GSPO_HAND))
def test_gspo_sequence_level_ratio_hand_example(eps_low, eps_high, loss_type):
    lp, old = _hand_inputs()
    loss, met = grpo.policy_loss(lp, old, ADV, MASK, loss_type=loss_type, epsilon=eps_low, epsilon_high=eps_high,
                                 importance_sampling_level="sequence")
    ref = _np_reduce(_np_per_token_gspo(np.nan_to_num(lp), np.nan_to_num(old), ADV, MASK, eps_low, eps_high),
                     MASK, loss_type, 4)
    np.testing.assert_allclose(float(loss), ref, rtol=1e-6)
    np.testing.assert_allclose(float(loss), GSPO_HAND[(eps_low, eps_high, loss_type)], rtol=1e-6)
    np.testing.assert_allclose(float(met["clip_ratio/low_mean"]), 0.4 if eps_low == 0.05 else 0.0, atol=1e-7)
    assert float(met["clip_ratio/high_mean"]) == 0.0
    # the gradient by hand: d(-A r_i)/d logp_t = -A r_i / n_i on each unmasked token of an unclipped sequence;
    # grpo then divides by the sequence's token count n_i (its mean of n_i equal terms) and by B = 2, dapo by
    # the 5 tokens
    g = jax.grad(lambda x: grpo.policy_loss(x, old, ADV, MASK, loss_type=loss_type, epsilon=eps_low,
                                            epsilon_high=eps_high, importance_sampling_level="sequence")[0])(
        jnp.asarray(lp))
    r = np.array([0.75 ** (1 / 3), 0.77 ** 0.5])
    n = MASK.sum(1)
    active = np.array([True, eps_low != 0.05])
    per_seq = np.where(active, -ADV * r / n, 0.0) * (1.0 if loss_type == "grpo" else n)
    expected = np.where(MASK == 1, per_seq[:, None], 0.0) / (2 if loss_type == "grpo" else 5)
    np.testing.assert_allclose(np.asarray(g), expected, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_gspo_equals_grpo_when_every_sequence_has_one_token(loss_type):
    """With one unmasked token a sequence, its sequence ratio is its token ratio: the two levels agree."""
    rng = np.random.default_rng(5)
    lp = rng.normal(-2.0, 0.5, size=(6, 3)).astype(np.float32)
    old = (lp + rng.normal(0.0, 0.3, size=(6, 3))).astype(np.float32)
    mask = np.zeros((6, 3), np.int32)
    mask[np.arange(6), rng.integers(0, 3, size=6)] = 1
    adv = rng.normal(size=6).astype(np.float32)
    kw = dict(loss_type=loss_type, epsilon=0.2, epsilon_high=0.28, max_completion_length=3)
    tok = grpo.policy_loss(lp, old, adv, mask, **kw)[0]
    seq = grpo.policy_loss(lp, old, adv, mask, importance_sampling_level="sequence", **kw)[0]
    np.testing.assert_allclose(float(seq), float(tok), rtol=1e-6)
    per = {"cispo": lambda: _np_per_token_cispo(lp, old, adv, 0.28),
           "sapo": lambda: _np_per_token_sapo(lp, old, adv)}.get(
               loss_type, lambda: _np_per_token_gspo(lp, old, adv, mask, 0.2, 0.28))()
    ref = _np_reduce(per, mask, loss_type, 3)
    np.testing.assert_allclose(float(seq), ref, rtol=1e-5)


def test_delta_two_sided_clipping_hand_example():
    """INTELLECT-2's delta caps the unclipped branch: one sequence, A = -1, ratios 3 and 1, epsilon 0.2, delta 2.
    token 0: -min(min(3, 2) * -1, clip(3, 0.8, 1.2) * -1) = -min(-2, -1.2) = 2 (without delta: 3), no gradient
    (the cap is constant); token 1: -min(-1, -1) = 1, gradient -A * r = 1. grpo: (2 + 1) / 2 = 1.5."""
    old = np.log(np.array([[0.2, 0.5]], np.float32))
    lp = (old + np.log(np.array([[3.0, 1.0]]))).astype(np.float32)
    mask, adv = np.ones((1, 2), np.int32), np.array([-1.0], np.float32)
    f = lambda x, d: grpo.policy_loss(x, old, adv, mask, loss_type="grpo", epsilon=0.2, delta=d)[0]
    np.testing.assert_allclose(float(f(lp, 2.0)), 1.5, rtol=1e-6)
    np.testing.assert_allclose(float(f(lp, None)), 2.0, rtol=1e-6)
    np.testing.assert_allclose(float(f(lp, 5.0)), 2.0, rtol=1e-6)  # a cap above the ratio changes nothing
    np.testing.assert_allclose(np.asarray(jax.grad(f)(jnp.asarray(lp), 2.0)), [[0.0, 0.5]], atol=1e-7)
    np.testing.assert_allclose(np.asarray(jax.grad(f)(jnp.asarray(lp), None)), [[1.5, 0.5]], rtol=1e-6)


# The hand example's entropies; top_entropy_quantile 0.4 keeps tokens at or above the 0.6 quantile of
# [0.1, 0.3, 0.5, 0.7, 0.9] (linear: 0.5 + 0.4 * 0.2 = 0.58): seq 0 token 2 (0.9) and seq 1 token 1 (0.7).
# Their losses (HAND): -0.5 and 0.55. grpo = (-0.5 / 3 + 0.55 / 2) / 2 = 0.0541667; dapo = (-0.5 + 0.55) / 5 = 0.01
ENTROPY = np.array([[0.1, 0.5, 0.9, np.nan], [0.3, 0.7, np.nan, np.nan]], np.float32)


@pytest.mark.parametrize("loss_type,want", [("grpo", 0.0541666667), ("dapo", 0.01)])
def test_top_entropy_quantile_hand_example(loss_type, want):
    lp, old = _hand_inputs()
    kw = dict(loss_type=loss_type, epsilon=EPS, epsilon_high=EPS_HIGH, entropy=ENTROPY)
    loss, met = grpo.policy_loss(lp, old, ADV, MASK, top_entropy_quantile=0.4, **kw)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    assert float(met["num_tokens"]) == 5  # the normalisers still count every token
    # float64 reference: numpy's linear quantile over the unmasked entropies
    per = _np_per_token(np.nan_to_num(lp), np.nan_to_num(old), ADV, EPS, EPS_HIGH)
    ent = np.nan_to_num(ENTROPY.astype(np.float64), nan=-1.0)
    keep = (MASK == 1) & (ent >= np.quantile(ent[MASK == 1], 0.6))
    np.testing.assert_allclose(float(loss), _np_reduce(np.where(keep, per, 0.0), MASK, loss_type, 4), rtol=1e-5)
    # quantile 1 keeps every token; the KL term is not masked (beta = 1, k1 against ref = logp - 0.1: +0.1 a token)
    full = grpo.policy_loss(lp, old, ADV, MASK, top_entropy_quantile=1.0, **kw)[0]
    np.testing.assert_allclose(float(full), HAND[loss_type], rtol=1e-5)
    kl = grpo.policy_loss(lp, old, ADV, MASK, top_entropy_quantile=0.4, beta=1.0, ref_logprobs=lp - 0.1,
                          kl_estimator="k1", **kw)[0]
    np.testing.assert_allclose(float(kl) - float(loss), 0.1, rtol=1e-4)
    # TRL's lower end, 0: the quantile is the maximum, so only seq 0 token 2 (0.9) keeps its term (-0.5)
    top = grpo.policy_loss(lp, old, ADV, MASK, top_entropy_quantile=0.0, **kw)[0]
    np.testing.assert_allclose(float(top), -0.5 / 3 / 2 if loss_type == "grpo" else -0.5 / 5, rtol=1e-5)
    g = jax.grad(lambda x: grpo.policy_loss(x, old, ADV, MASK, top_entropy_quantile=0.4, **kw)[0])(jnp.asarray(lp))
    assert np.count_nonzero(np.asarray(g)) == 2 and np.asarray(g)[0, 2] != 0 and np.asarray(g)[1, 1] != 0


def test_top_entropy_quantile_keeps_tokens_tied_at_the_quantile():
    """Entropies [v, v, 3.5], top_entropy_quantile 0.8: the 0.2 quantile sits between the two v's (rank 0.4), so
    it is v (torch.quantile's lerp, numpy's linear method) and every token is kept. jnp.nanquantile computes
    v * 0.6 + v * 0.4, which rounds above v for some v and dropped both tied tokens. With ratio 1 and A = 1 each
    kept token's dapo loss is -1/3: the loss is -(kept tokens) / 3."""
    lp = np.full((1, 3), -1.0, np.float32)
    mask, adv = np.ones((1, 3), np.int32), np.ones(1, np.float32)
    for v in np.linspace(0.05, 3.0, 60, dtype=np.float32):
        ent = np.array([[v, v, 3.5]], np.float32)
        assert np.quantile(ent.astype(np.float64), 0.2) == np.float64(v)  # the threshold, independently
        loss = grpo.policy_loss(lp, lp, adv, mask, loss_type="dapo", entropy=ent, top_entropy_quantile=0.8)[0]
        np.testing.assert_allclose(float(loss), -1.0, rtol=1e-6, err_msg=f"v={v!r}")


def test_delta_and_top_entropy_quantile_refuse_bad_values():
    lp, old = _hand_inputs()
    for kw, needle in ((dict(delta=0.0), "delta must be None or a finite float > 1"), (dict(delta=1.0), "delta"),
                       (dict(delta=float("nan")), "delta must be"), (dict(delta=True), "delta must be"),
                       (dict(top_entropy_quantile=-0.1), r"top_entropy_quantile must be a float in \[0, 1\]"),
                       (dict(top_entropy_quantile=1.5), "top_entropy_quantile must be"),
                       (dict(top_entropy_quantile=0.2), "top_entropy_quantile=0.2 < 1 needs entropy")):
        with pytest.raises(ValueError, match=needle):
            grpo.policy_loss(lp, old, ADV, MASK, **kw)


def test_cispo_gradient_by_hand_keeps_every_token():
    """CISPO's weight is not differentiated: d/dlogp_t of -sg(min(r, eps_max)) * A * logp_t is
    -min(r, eps_max) * A, on every token, clipped or not (GRPO's clipped tokens get 0); / 5 tokens."""
    lp, old = _hand_inputs()
    for cap in (1.2, 5.0):
        g = jax.grad(lambda x: grpo.policy_loss(x, old, ADV, MASK, loss_type="cispo", epsilon_high=cap)[0])(
            jnp.asarray(lp))
        expected = np.where(MASK == 1, -np.minimum(RATIOS, cap) * ADV[:, None], 0.0) / 5
        np.testing.assert_allclose(np.asarray(g), expected, rtol=1e-6, atol=1e-8)
    # with the cap at 5 no weight is capped: the loss is sum(-r * A * logp) / 5 (worked: 2.773595 / 5)
    loss = grpo.policy_loss(lp, old, ADV, MASK, loss_type="cispo", epsilon_high=5.0)[0]
    np.testing.assert_allclose(float(loss), 0.5547189798, rtol=1e-6)
    with pytest.raises(ValueError, match="loss_type='cispo' has none"):
        grpo.policy_loss(lp, old, ADV, MASK, loss_type="cispo", epsilon_high=5.0, delta=4.0)


def test_sapo_gradient_by_hand_and_temperatures():
    """d/dlogp of -sigmoid(tau (r - 1)) * 4 / tau * A is -4 sigmoid (1 - sigmoid) * r * A: at r = 1, GRPO's -A; the
    gate fades it smoothly off ratio 1 instead of cutting it at the clip. grpo's reduction: / n_i / B."""
    lp, old = _hand_inputs()
    for tau_pos, tau_neg in ((1.0, 1.05), (2.0, 0.5)):
        g = jax.grad(lambda x: grpo.policy_loss(x, old, ADV, MASK, loss_type="sapo", sapo_temperature_pos=tau_pos,
                                                sapo_temperature_neg=tau_neg)[0])(jnp.asarray(lp))
        tau = np.where(ADV[:, None] > 0, tau_pos, tau_neg)
        sig = 1.0 / (1.0 + np.exp(-tau * (RATIOS - 1.0)))
        expected = np.where(MASK == 1, -4.0 * sig * (1 - sig) * RATIOS * ADV[:, None], 0.0)
        expected = expected / MASK.sum(1, keepdims=True) / 2
        np.testing.assert_allclose(np.asarray(g), expected, rtol=1e-5, atol=1e-8)
    assert np.asarray(g)[0, 0] == pytest.approx(-1.0 / 3 / 2)  # r = 1, A = 1: GRPO's gradient
    for kw, needle in ((dict(sapo_temperature_pos=0.0), "sapo_temperature_pos must be a finite float > 0"),
                       (dict(sapo_temperature_neg=float("inf")), "sapo_temperature_neg must be"),
                       (dict(delta=4.0), "loss_type='sapo' has none")):
        with pytest.raises(ValueError, match=needle):
            grpo.policy_loss(lp, old, ADV, MASK, loss_type="sapo", **kw)


@pytest.mark.parametrize("est", grpo.KL_ESTIMATORS)
def test_kl_penalty_matches_numpy(est):
    lp, old = _hand_inputs()
    ref = np.log(np.array([[0.3, 0.35, 0.1, 0.5], [0.45, 0.5, 0.2, 0.2]])).astype(np.float32)
    loss, met = grpo.policy_loss(lp, old, ADV, MASK, loss_type="bnpo", epsilon=EPS, beta=0.04,
                                 ref_logprobs=ref, kl_estimator=est)
    lp0 = np.nan_to_num(lp)
    per = _np_per_token(lp0, np.nan_to_num(old), ADV, EPS, EPS, beta=0.04, ref=ref, est=est)
    np.testing.assert_allclose(float(loss), _np_reduce(per, MASK, "bnpo", 4), rtol=1e-5)
    d = ref.astype(np.float64) - lp0
    kl = {"k1": -d, "k2": 0.5 * d * d, "k3": np.exp(d) - d - 1}[est]
    np.testing.assert_allclose(float(met["kl"]), kl[MASK == 1].mean(), rtol=1e-5)


def test_kl_exactly_zero_for_equal_inputs():
    x = jnp.asarray(np.log(np.linspace(0.01, 0.99, 37)), jnp.float32)
    for est in grpo.KL_ESTIMATORS:
        assert np.all(np.asarray(grpo.kl_divergence(x, x, estimator=est)) == 0.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_k3_finite_at_log_ratio_100(dtype, sign):
    ref = jnp.zeros((3,), dtype)
    lp = jnp.asarray([-sign * 100.0, -1.0, 0.0], dtype)  # ref - lp = +-100 at token 0

    def f(x):
        return grpo.kl_divergence(x, ref, estimator="k3").sum()

    val, g = jax.value_and_grad(f)(lp)
    assert np.isfinite(float(val)) and np.all(np.isfinite(np.asarray(g, np.float32)))
    k3 = np.asarray(grpo.kl_divergence(lp, ref, estimator="k3"))
    assert k3[0] >= 0 and np.isfinite(k3[0])
    if sign < 0:  # d = -100: below the clamp the estimator is exact: e^-100 + 100 - 1
        np.testing.assert_allclose(k3[0], 99.0, rtol=1e-2)
    # the whole loss with beta > 0 and a ratio of e^100 to the old policy stays finite too
    old = jnp.asarray([0.0, -1.0, 0.0], dtype)
    mask = jnp.ones((1, 3))

    def total(x):
        return grpo.policy_loss(x[None], old[None], jnp.ones((1,)), mask, beta=0.1,
                                ref_logprobs=ref[None])[0]

    val, g = jax.value_and_grad(total)(jnp.asarray([sign * 100.0, -1.0, 0.0], dtype))
    assert np.isfinite(float(val)) and np.all(np.isfinite(np.asarray(g, np.float32)))


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_zero_mask_gives_zero_loss_and_gradient(loss_type):
    lp = jnp.full((2, 4), jnp.nan)  # padding may hold anything
    mask = jnp.zeros((2, 4), jnp.int32)

    def f(x):
        return grpo.policy_loss(x, None, jnp.array([1.0, -1.0]), mask, loss_type=loss_type,
                                beta=0.1, ref_logprobs=jnp.zeros((2, 4)))[0]

    val, g = jax.value_and_grad(f)(lp)
    assert float(val) == 0.0
    assert np.all(np.asarray(g) == 0.0)


def test_empty_and_truncated_sequences_count_as_in_trl():
    """TRL: grpo is the .mean() over all B sequences of each one's token mean (an empty one adds 0 and
    counts); dr_grpo divides by B * max_completion_length whatever is masked; dapo by the unmasked tokens."""
    lp, old = _hand_inputs()
    lp3 = np.concatenate([np.nan_to_num(lp), np.zeros((1, 4), np.float32)])
    old3 = np.concatenate([np.nan_to_num(old), np.zeros((1, 4), np.float32)])
    mask3 = np.concatenate([MASK, np.zeros((1, 4), np.int32)])
    adv3 = np.append(ADV, 3.0)
    loss, _ = grpo.policy_loss(lp3, old3, adv3, mask3, epsilon=EPS, epsilon_high=EPS_HIGH)
    np.testing.assert_allclose(float(loss), HAND["grpo"] * 2 / 3, rtol=1e-6)  # the two sequences' sum / 3
    # mask_truncated_completions drops sequence 1: sequence 0's mean (-2.78 / 3 over its 3 tokens) remains
    trunc = np.array([False, True])
    for lt, expect in [("grpo", -2.78 / 3 / 2), ("dapo", -2.78 / 3), ("dr_grpo", -2.78 / (2 * 4))]:
        loss, met = grpo.policy_loss(np.nan_to_num(lp), np.nan_to_num(old), ADV, MASK,
                                     loss_type=lt, epsilon=EPS, epsilon_high=EPS_HIGH,
                                     truncated=trunc, mask_truncated_completions=True,
                                     max_completion_length=4)
        np.testing.assert_allclose(float(loss), expect, rtol=1e-6)
        assert float(met["num_tokens"]) == 3
    with pytest.raises(ValueError, match="truncated"):
        grpo.policy_loss(lp, old, ADV, MASK, mask_truncated_completions=True)


def test_on_policy_ratio_is_one_without_old_logprobs():
    lp = jnp.asarray(np.nan_to_num(_hand_inputs()[0]))
    loss, met = grpo.policy_loss(lp, None, ADV, MASK)
    # ratio 1 everywhere -> per-token loss -A; grpo = mean(-A) over the 2 sequences
    np.testing.assert_allclose(float(loss), -(1.0 - 0.5) / 2, rtol=1e-6)
    assert float(met["clip_ratio/region_mean"]) == 0.0
    g = jax.grad(lambda x: grpo.policy_loss(x, None, ADV, MASK)[0])(lp)
    expected = np.where(MASK == 1, -ADV[:, None] / MASK.sum(1, keepdims=True) / 2, 0.0)
    np.testing.assert_allclose(np.asarray(g), expected, rtol=1e-6)


def test_policy_loss_errors():
    lp, old = _hand_inputs()
    with pytest.raises(ValueError, match="loss_type"):
        grpo.policy_loss(lp, old, ADV, MASK, loss_type="ppo")
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo.policy_loss(lp, old, ADV, MASK, beta=0.1)
    with pytest.raises(ValueError, match="advantages"):
        grpo.policy_loss(lp, old, np.ones(3), MASK)
    with pytest.raises(ValueError, match="kl_estimator"):
        grpo.policy_loss(lp, old, ADV, MASK, kl_estimator="k4")


def test_entropy_metric():
    lp, old = _hand_inputs()
    ent = np.arange(8, dtype=np.float32).reshape(2, 4)
    _, met = grpo.policy_loss(lp, old, ADV, MASK, entropy=ent)
    np.testing.assert_allclose(float(met["entropy"]), (0 + 1 + 2 + 4 + 5) / 5, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Training-inference mismatch correction (TRL's vllm_importance_sampling_correction)
# ---------------------------------------------------------------------------------------------
# d = trainer - sampler log-probs per completion token, chosen to straddle the bounds:
#   row 0: ratio 3 * e^0.01 (just above C_max = 3), 1 (d = 0 exactly), 0.5; one padding slot
#   row 1: 0.2 * e^-0.01 and 0.2 * e^0.01 (either side of C_min = 0.2), e^5, e^-60
#   row 2: e^100 (inf in float32), then padding
#   row 3: e^0.5, e^-0.5: a sequence ratio of exactly 1
#   row 4: no completion token at all
IS_D = np.array([[math.log(3.0) + 0.01, 0.0, math.log(0.5), 0.0],
                 [math.log(0.2) - 0.01, math.log(0.2) + 0.01, 5.0, -60.0],
                 [100.0, 0.0, 0.0, 0.0],
                 [0.5, -0.5, 0.0, 0.0],
                 [0.0, 0.0, 0.0, 0.0]])
IS_MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]], np.int32)


def _is_inputs():
    """(trainer, sampler) float32 log-probs whose difference on the mask is IS_D (padding: inf / NaN)."""
    sampler = np.array([[-1.0, -2.0, -0.5, 0.0], [-0.25, -3.0, -7.5, -0.5], [-120.0, 0, 0, 0],
                        [-1.5, -1.5, 0, 0], [0, 0, 0, 0]])
    trainer = sampler + IS_D
    trainer = np.where(IS_MASK == 1, trainer, np.inf).astype(np.float32)
    sampler = np.where(IS_MASK == 1, sampler, np.nan).astype(np.float32)
    return trainer, sampler


def _np_is_weights(trainer, sampler, mask, mode, lo, hi):
    """float64 reference of TRL's ratio (the float32 inputs' difference, exp, then truncate or mask)."""
    m = np.asarray(mask, bool)
    d = np.where(m, np.asarray(trainer, np.float64) - np.where(m, np.asarray(sampler, np.float64), 0.0), 0.0)
    if mode.startswith("sequence"):
        d = np.broadcast_to(d.sum(1, keepdims=True), d.shape)
    elif mode.startswith("geometric"):  # the mean over the row's completion tokens
        d = np.broadcast_to(d.sum(1, keepdims=True) / np.maximum(m.sum(1, keepdims=True), 1), d.shape)
    with np.errstate(over="ignore"):
        r = np.exp(d)
    if mode.endswith("truncate"):
        r = np.clip(r, 0.0 if lo is None else lo, hi)
    else:
        r = np.where((r <= hi) & (r >= (0.0 if lo is None else lo)), r, 0.0)
    return np.where(m, r, 0.0)


# expected by hand, row by row (where the value is not the plain ratio), for (clip_min, clip_max):
IS_HAND = {
    ("token_truncate", None, 3.0): {(0, 0): 3.0, (0, 1): 1.0, (2, 0): 3.0},
    ("token_mask", 0.2, 3.0): {(0, 0): 0.0, (1, 0): 0.0, (1, 2): 0.0, (1, 3): 0.0, (2, 0): 0.0},
    ("token_truncate", 0.2, 3.0): {(1, 0): 0.2, (1, 2): 3.0, (1, 3): 0.2},
    ("token_mask", 1.0, 2.0): {(0, 1): 1.0, (3, 0): math.exp(0.5), (3, 1): 0.0},  # d = 0: C_min kept
    ("sequence_truncate", 0.2, 3.0): {(0, 0): 1.5 * math.exp(0.01), (1, 1): 0.2, (2, 0): 3.0, (3, 1): 1.0},
    ("sequence_mask", None, 3.0): {(0, 2): 1.5 * math.exp(0.01), (1, 0): 0.04 * math.exp(-55.0), (2, 0): 0.0,
                                   (3, 0): 1.0},
    ("sequence_mask", 1.0, 2.0): {(0, 0): 1.5 * math.exp(0.01), (1, 3): 0.0, (2, 0): 0.0, (3, 0): 1.0},
    # geometric: the n-th root of the sequence ratio (row 0: n = 3, row 1: n = 4, row 2: e^100, row 3: 1)
    ("geometric_truncate", 0.5, 1.2): {(0, 0): (1.5 * math.exp(0.01)) ** (1 / 3), (1, 3): 0.5, (2, 0): 1.2,
                                       (3, 1): 1.0},
    ("geometric_mask", None, 3.0): {(0, 1): (1.5 * math.exp(0.01)) ** (1 / 3),
                                    (1, 0): 0.04 ** 0.25 * math.exp(-55.0 / 4), (2, 0): 0.0, (3, 0): 1.0},
    ("geometric_mask", 0.9, 1.1): {(0, 2): 0.0, (1, 1): 0.0, (2, 0): 0.0, (3, 1): 1.0},
}


@pytest.mark.parametrize("mode,lo,hi", list(IS_HAND))
def test_rollout_importance_weights_match_numpy_at_the_bounds(mode, lo, hi):
    trainer, sampler = _is_inputs()
    rho = np.asarray(grpo.rollout_importance_weights(trainer, sampler, IS_MASK, mode=mode, clip_min=lo, clip_max=hi))
    assert rho.dtype == np.float32 and rho.shape == IS_D.shape and np.all(np.isfinite(rho))
    np.testing.assert_allclose(rho, _np_is_weights(trainer, sampler, IS_MASK, mode, lo, hi), rtol=1e-5, atol=0)
    for (i, j), want in IS_HAND[(mode, lo, hi)].items():
        np.testing.assert_allclose(rho[i, j], want, rtol=1e-5, atol=0)
    assert np.all(rho[IS_MASK == 0] == 0.0)
    if not mode.startswith("token"):  # one value a row on its completion tokens
        for i in range(4):
            assert len(set(rho[i][IS_MASK[i] == 1].tolist())) == 1
    # clip_min 0 is no lower bound, as None
    if lo is None:
        again = grpo.rollout_importance_weights(trainer, sampler, IS_MASK, mode=mode, clip_min=0.0, clip_max=hi)
        np.testing.assert_array_equal(np.asarray(again), rho)


def test_rollout_importance_weights_refuse_bad_modes_bounds_and_shapes():
    trainer, sampler = _is_inputs()
    for kw, needle in ((dict(mode="none"), "mode must be one of"), (dict(mode="token"), "mode must be one of"),
                       (dict(mode="token_mask", clip_max=0.0), "clip_max must be a finite float > 0"),
                       (dict(mode="token_mask", clip_max=float("inf")), "clip_max must be a finite float > 0"),
                       (dict(mode="token_mask", clip_max=None), "clip_max"),
                       (dict(mode="token_mask", clip_min=-0.1), r"clip_min must be None or a float in \[0, "),
                       (dict(mode="sequence_truncate", clip_min=3.0, clip_max=3.0), r"\[0, clip_max=3.0\)"),
                       (dict(mode="sequence_truncate", clip_min=float("nan")), "clip_min")):
        with pytest.raises(ValueError, match=needle):
            grpo.rollout_importance_weights(trainer, sampler, IS_MASK, **kw)
    with pytest.raises(ValueError, match="sampler_logprobs shape"):
        grpo.rollout_importance_weights(trainer, sampler[:, :3], IS_MASK, mode="token_mask")
    with pytest.raises(ValueError, match="mask must be"):
        grpo.rollout_importance_weights(trainer[0], sampler[0], IS_MASK[0], mode="token_mask")
    with pytest.raises(ValueError, match="mode must be one of"):
        grpo.rollout_importance_metrics(trainer, IS_MASK, mode="none")


def test_rollout_importance_metrics_over_tokens_or_sequences():
    trainer, sampler = _is_inputs()
    rho = grpo.rollout_importance_weights(trainer, sampler, IS_MASK, mode="token_truncate", clip_min=0.2)
    met = grpo.rollout_importance_metrics(rho, IS_MASK, mode="token_truncate")
    tokens = _np_is_weights(trainer, sampler, IS_MASK, "token_truncate", 0.2, 3.0)[IS_MASK == 1]  # 10 tokens
    p = "sampling/importance_sampling_ratio/"
    np.testing.assert_allclose([float(met[p + k]) for k in ("min", "mean", "max")],
                               [0.2, tokens.mean(), 3.0], rtol=1e-5)
    rho = grpo.rollout_importance_weights(trainer, sampler, IS_MASK, mode="sequence_mask", clip_max=2.0)
    met = grpo.rollout_importance_metrics(rho, IS_MASK, mode="sequence_mask")
    seqs = [1.5 * math.exp(0.01), 0.04 * math.exp(-55.0), 0.0, 1.0]  # row 4 (no token) is not a sequence
    np.testing.assert_allclose([float(met[p + k]) for k in ("min", "mean", "max")],
                               [0.0, np.mean(seqs), max(seqs)], rtol=1e-5)
    rho = grpo.rollout_importance_weights(trainer, sampler, IS_MASK, mode="geometric_truncate", clip_min=0.5,
                                          clip_max=1.2)
    met = grpo.rollout_importance_metrics(rho, IS_MASK, mode="geometric_truncate")
    seqs = [(1.5 * math.exp(0.01)) ** (1 / 3), 0.5, 1.2, 1.0]  # one value a sequence, as in the sequence modes
    np.testing.assert_allclose([float(met[p + k]) for k in ("min", "mean", "max")],
                               [0.5, np.mean(seqs), 1.2], rtol=1e-5)
    empty = grpo.rollout_importance_metrics(rho, np.zeros_like(IS_MASK), mode="sequence_mask")
    assert all(float(v) == 0.0 for v in empty.values())


def test_rollout_importance_leaves_out_truncated_completions_when_asked():
    """With mask_truncated_completions, truncated rows leave the mask as they leave the loss: the same rho and
    metrics as a mask with those rows zeroed by hand (the float64 reference's), and without a truncated a clear
    error."""
    trainer, sampler = _is_inputs()
    truncated = np.array([False, True, False, True, False])
    by_hand = IS_MASK * ~truncated[:, None]
    p = "sampling/importance_sampling_ratio/"
    for mode in ("token_truncate", "sequence_mask", "geometric_truncate"):
        rho = np.asarray(grpo.rollout_importance_weights(trainer, sampler, IS_MASK, mode=mode, clip_min=0.2,
                                                         truncated=truncated, mask_truncated_completions=True))
        np.testing.assert_allclose(rho, _np_is_weights(trainer, sampler, by_hand, mode, 0.2, 3.0), rtol=1e-5, atol=0)
        met = grpo.rollout_importance_metrics(rho, IS_MASK, mode=mode, truncated=truncated,
                                              mask_truncated_completions=True)
        want = grpo.rollout_importance_metrics(rho, by_hand, mode=mode)
        assert {k: float(v) for k, v in met.items()} == {k: float(v) for k, v in want.items()}
        assert float(met[p + "max"]) > 0
    with pytest.raises(ValueError, match="needs truncated"):
        grpo.rollout_importance_weights(trainer, sampler, IS_MASK, mode="token_mask", mask_truncated_completions=True)


def test_policy_loss_with_rollout_weights_matches_numpy_and_weights_no_kl():
    """TRL multiplies the clipped per-token loss by the ratio and then adds beta * KL (not weighted)."""
    lp, old = _hand_inputs()
    rho = np.where(MASK == 1, [[0.5, 2.0, 1.0, 9.0], [3.0, 0.0, 9.0, 9.0]], np.nan).astype(np.float32)
    ref = np.log(np.array([[0.3, 0.35, 0.1, 0.5], [0.45, 0.5, 0.2, 0.2]])).astype(np.float32)
    lp0, old0, rho0 = np.nan_to_num(lp), np.nan_to_num(old), np.nan_to_num(rho)
    for loss_type in grpo.LOSS_TYPES:
        for beta in (0.0, 0.04):
            kw = dict(loss_type=loss_type, epsilon=EPS, epsilon_high=EPS_HIGH, max_completion_length=4, beta=beta,
                      ref_logprobs=ref)
            loss, met = grpo.policy_loss(lp, old, ADV, MASK, rollout_is_weights=rho, **kw)
            pg = _np_per_token(lp0, old0, ADV, EPS, EPS_HIGH)
            kl = _np_per_token(lp0, old0, ADV, EPS, EPS_HIGH, beta=beta, ref=ref) - pg
            if loss_type == "cispo":
                pg = _np_per_token_cispo(lp0, old0, ADV, EPS_HIGH)
            elif loss_type == "sapo":
                pg = _np_per_token_sapo(lp0, old0, ADV)
            want = _np_reduce(pg * rho0 + kl, MASK, loss_type, 4)
            np.testing.assert_allclose(float(loss), want, rtol=1e-6)
            np.testing.assert_allclose(float(met["clip_ratio/region_mean"]),
                                       {"cispo": 0.6, "sapo": 0.0}.get(loss_type, 0.4), rtol=1e-6)  # as before
            plain, _ = grpo.policy_loss(lp, old, ADV, MASK, **kw)
            ones, _ = grpo.policy_loss(lp, old, ADV, MASK, rollout_is_weights=np.ones_like(rho), **kw)
            assert float(ones) == float(plain) and abs(float(loss) - float(plain)) > 1e-3
    # the gradient (grpo): the hand example's, each token's times its weight; none flows into the weights
    g, g_rho = jax.grad(lambda x, w: grpo.policy_loss(x, old, ADV, MASK, loss_type="grpo", epsilon=EPS,
                                                       epsilon_high=EPS_HIGH, rollout_is_weights=w)[0],
                        argnums=(0, 1))(jnp.asarray(lp), jnp.asarray(rho))
    r, a = RATIOS, ADV[:, None]
    active = (r * a <= np.clip(r, 1 - EPS, 1 + EPS_HIGH) * a) & (MASK == 1)
    expected = np.where(active, -r * a * rho0, 0.0) / MASK.sum(1, keepdims=True) / 2
    np.testing.assert_allclose(np.asarray(g), expected, rtol=1e-6, atol=1e-8)
    assert np.all(np.asarray(g_rho) == 0.0)
    with pytest.raises(ValueError, match="rollout_is_weights shape"):
        grpo.policy_loss(lp, old, ADV, MASK, rollout_is_weights=rho[:, :3])


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------
def _np_group_adv(r, g, ddof=1, eps=1e-4):
    """TRL's (r - mean) / (std + 1e-4) per group of g, in float64."""
    r = np.asarray(r, np.float64).reshape(-1, g)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=ddof, keepdims=True) + eps)).reshape(-1)


def test_group_advantages_basic_and_scalings():
    rng = np.random.default_rng(0)
    r = rng.uniform(size=12).astype(np.float32)
    np.testing.assert_allclose(np.asarray(grpo.group_advantages(r, 4)), _np_group_adv(r, 4),
                               rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grpo.group_advantages(r, 4, std_ddof=0)),
                               _np_group_adv(r, 4, ddof=0), rtol=1e-5)
    r64 = r.astype(np.float64).reshape(3, 4)
    centered = (r64 - r64.mean(1, keepdims=True)).reshape(-1)
    np.testing.assert_allclose(np.asarray(grpo.group_advantages(r, 4, scale_rewards="none")),
                               centered, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grpo.group_advantages(r, 4, scale_rewards="batch")),
                               centered / (r64.std(ddof=1) + 1e-4), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grpo.group_advantages(r, 4, std_eps=0.0)), _np_group_adv(r, 4, eps=0),
                               rtol=1e-5)
    # binary rewards in a group of 4: [1, 0, 0, 1] -> mean .5, std sqrt(1/3) -> +-0.5 / (0.57735 + 1e-4) = +-0.86588
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    np.testing.assert_allclose(np.asarray(grpo.group_advantages([1.0, 0, 0, 1], 4)), [a, -a, -a, a], rtol=1e-6)
    # a group whose rewards differ slightly: TRL's epsilon bounds the advantage (std 5e-4 -> 0.5e-4 / 6e-4)
    np.testing.assert_allclose(np.asarray(grpo.group_advantages([1.0, 1.0, 1.001, 1.001], 4))[:2],
                               -0.0005 / (np.std([1, 1, 1.001, 1.001], ddof=1) + 1e-4), rtol=2e-3)


def test_group_advantages_equal_rewards_not_representable():
    r = jnp.full((8,), 0.1, jnp.float32)
    # the naive float32 computation divides rounding noise (std ~ 8e-9) and returns -0.935 on the CPU;
    # on a GPU, whose sum leaves no noise here, it divides 0 by 0. Never the zeros it should be:
    c = r - r.sum() / 8
    naive = np.asarray(c / jnp.sqrt((c * c).sum() / 7))
    assert np.all(np.isnan(naive) | (np.abs(naive) > 0.5))
    for scale in grpo.SCALE_REWARDS:
        assert np.all(np.asarray(grpo.group_advantages(r, 8, scale_rewards=scale)) == 0.0)
    assert float(grpo.reward_metrics(r, 8)["frac_reward_zero_std"]) == 1.0


def test_group_advantages_nonfinite_and_degenerate_groups():
    nan, inf = np.nan, np.inf
    r = np.array([1.0, nan, 0.0, 0.5,     # NaN excluded: stats of [1, 0, .5]
                  nan, nan, nan, nan,      # all missing
                  inf, 2.0, -inf, nan,     # one finite value: no std -> 0
                  3.0, 3.0, 3.0, 3.0], np.float32)  # zero std
    adv = np.asarray(grpo.group_advantages(r, 4))
    assert np.all(np.isfinite(adv))
    np.testing.assert_allclose(adv[[0, 2, 3]], _np_group_adv([1.0, 0.0, 0.5], 3), rtol=1e-5)
    assert np.all(adv[[1]] == 0) and np.all(adv[4:] == 0)
    met = grpo.reward_metrics(r, 4)
    np.testing.assert_allclose(float(met["frac_reward_zero_std"]), 3 / 4)
    np.testing.assert_allclose(float(met["frac_reward_nonfinite"]), 8 / 16)
    np.testing.assert_allclose(float(met["reward"]), (1.0 + 0 + 0.5 + 2 + 12) / 8, rtol=1e-6)
    # reward_std: mean of the group stds where defined (groups 0 and 3)
    np.testing.assert_allclose(float(met["reward_std"]), np.std([1, 0, .5], ddof=1) / 2,
                               rtol=1e-5)
    # a group of one always gets 0
    assert np.all(np.asarray(grpo.group_advantages([0.3, 1.0, -2.0], 1)) == 0.0)
    # batch scaling with a missing reward and a zero-std group
    adv_b = np.asarray(grpo.group_advantages(np.array([1, 0, nan, 2, 2, 2], np.float32), 3,
                                             scale_rewards="batch"))
    bstd = np.std([1.0, 0, 2, 2, 2], ddof=1)
    np.testing.assert_allclose(adv_b, [0.5 / (bstd + 1e-4), -0.5 / (bstd + 1e-4), 0, 0, 0, 0], rtol=1e-5)


def test_group_advantages_errors_and_jit():
    with pytest.raises(ValueError, match="multiple"):
        grpo.group_advantages(np.zeros(5), 2)
    with pytest.raises(ValueError, match="scale_rewards"):
        grpo.group_advantages(np.zeros(4), 2, scale_rewards="token")
    with pytest.raises(ValueError, match="group_size"):
        grpo.group_advantages(np.zeros(4), 0)
    with pytest.raises(ValueError, match="1-D"):
        grpo.group_advantages(np.zeros((2, 2)), 2)
    r = np.array([1.0, 0.0, 0.2, 0.9], np.float32)
    jitted = jax.jit(grpo.group_advantages, static_argnums=1)(r, 2)
    np.testing.assert_allclose(np.asarray(jitted), _np_group_adv(r, 2), rtol=1e-5)


def test_completion_metrics():
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    met = grpo.completion_metrics(mask, np.array([False, True, False]))
    np.testing.assert_allclose(float(met["completions/mean_length"]), 8 / 3, rtol=1e-6)
    assert float(met["completions/min_length"]) == 1
    assert float(met["completions/max_length"]) == 4
    np.testing.assert_allclose(float(met["completions/clipped_ratio"]), 1 / 3, rtol=1e-6)
    assert float(met["completions/mean_terminated_length"]) == 2.0


# ---------------------------------------------------------------------------------------------
# Optimizer and update step on a toy differentiable policy
# ---------------------------------------------------------------------------------------------
V, D, B, T = 7, 5, 8, 6


def toy_logprob_fn(params, batch):
    """A linear softmax policy over a toy vocabulary: logits = (x * scale) @ w + norm."""
    x = batch["features"] * batch["shared"]["scale"]
    logits = jnp.einsum("btd,dv->btv", x, params["w"]) + params["final_norm"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    lp = jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    ent = -(jnp.exp(logp) * logp).sum(-1)
    return lp, ent


def _toy(seed=0, beta=False):
    rng = np.random.default_rng(seed)
    params = {"w": jnp.asarray(rng.normal(size=(D, V)), jnp.float32),
              "final_norm": jnp.asarray(rng.normal(size=(V,)) * 0.1, jnp.float32)}
    lengths = np.array([6, 3, 0, 5, 1, 6, 4, 2])
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
    batch = {
        "features": jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32),
        "targets": jnp.asarray(rng.integers(0, V, size=(B, T)), jnp.int32),
        "completion_mask": jnp.asarray(mask),
        "advantages": jnp.asarray(rng.normal(size=(B,)), jnp.float32),
        "truncated": jnp.asarray(lengths == T),
        "shared": {"scale": jnp.float32(0.7)},
    }
    lp, _ = toy_logprob_fn(params, batch)
    batch["old_logprobs"] = lp + jnp.asarray(rng.normal(size=(B, T)) * 0.3, jnp.float32)
    if beta:
        batch["ref_logprobs"] = lp + jnp.asarray(rng.normal(size=(B, T)) * 0.2, jnp.float32)
    return params, batch


def test_lr_schedule_warmup_cosine():
    sched = update.make_lr_schedule({"learning_rate": 1e-5, "max_steps": 100, "warmup_ratio": 0.1})
    got = [float(sched(c)) for c in (0, 5, 10, 55, 100, 150)]
    np.testing.assert_allclose(got, [0.0, 0.5e-5, 1e-5, 0.5e-5, 0.0, 0.0], atol=1e-12)
    with pytest.raises(ValueError, match="max_steps"):
        update.make_lr_schedule({})
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        update.make_lr_schedule({"lr_scheduler_type": "exp", "max_steps": 3})


def test_lr_schedule_constant_with_warmup():
    # Hugging Face's constant_with_warmup: c / warmup while c < warmup, then 1. Without warmup
    # (no max_steps, or warmup_ratio 0) the first update already gets the full rate.
    cfg = {"learning_rate": 1e-3, "lr_scheduler_type": "constant_with_warmup"}
    for extra in ({}, {"max_steps": 50, "warmup_ratio": 0.0}):
        sched = update.make_lr_schedule({**cfg, **extra})
        np.testing.assert_allclose([float(sched(c)) for c in (0, 1, 7)], [1e-3] * 3, rtol=1e-6)
    sched = update.make_lr_schedule({**cfg, "warmup_steps": 4})
    np.testing.assert_allclose([float(sched(c)) for c in range(6)],
                               [0.0, 0.25e-3, 0.5e-3, 0.75e-3, 1e-3, 1e-3], rtol=1e-6, atol=1e-12)


def test_optimizer_first_step_adamw_clip_and_decay_mask():
    cfg = {"learning_rate": 1e-3, "lr_scheduler_type": "constant", "weight_decay": 0.1,
           "max_grad_norm": 0.2}
    opt = update.make_optimizer(cfg)
    p = {"w": jnp.array([1.0, -2.0, 3.0]), "input_norm": jnp.array([1.0, 2.0])}
    g = {"w": jnp.array([30.0, -40.0, 0.0]), "input_norm": jnp.array([0.0, 5.0])}
    upd, _ = opt.update(g, opt.init(p), p)
    new = optax.apply_updates(p, upd)
    # first Adam step after clipping to norm 0.2: m_hat = g_c, v_hat = g_c**2 (bias-corrected),
    # so the step is lr * g_c / (|g_c| + eps); decoupled decay lr * wd * p except on norms.
    scale = 0.2 / np.sqrt(30**2 + 40**2 + 5**2)
    for k, wd in (("w", 0.1), ("input_norm", 0.0)):
        gc = np.asarray(g[k], np.float64) * scale
        expect = np.asarray(p[k]) - 1e-3 * (gc / (np.abs(gc) + 1e-8) + wd * np.asarray(p[k]))
        np.testing.assert_allclose(np.asarray(new[k]), expect, rtol=1e-5)


def _reference_grad(params, batch, cfg):
    def f(p):
        lp, ent = toy_logprob_fn(p, batch)
        return grpo.policy_loss(
            lp, batch["old_logprobs"], batch["advantages"], batch["completion_mask"],
            loss_type=cfg["loss_type"], beta=cfg.get("beta", 0.0),
            ref_logprobs=batch.get("ref_logprobs"), epsilon_high=cfg.get("epsilon_high"),
            truncated=batch["truncated"],
            mask_truncated_completions=cfg.get("mask_truncated_completions", False),
            rollout_is_weights=batch.get("rollout_is_weights"),
            importance_sampling_level=cfg.get("importance_sampling_level", "token"))[0]
    return jax.value_and_grad(f)(params)


@pytest.mark.parametrize("cfg", [
    {"loss_type": "grpo"},
    {"loss_type": "grpo", "mask_truncated_completions": True},
    {"loss_type": "dapo", "epsilon_high": 0.28, "mask_truncated_completions": True},
    {"loss_type": "dr_grpo", "beta": 0.04, "mask_truncated_completions": True},
    {"loss_type": "grpo", "beta": 0.04, "importance_sampling_level": "sequence"},
    {"loss_type": "dapo", "epsilon_high": 0.28, "importance_sampling_level": "sequence",
     "mask_truncated_completions": True},
    {"loss_type": "cispo", "epsilon_high": 1.2, "mask_truncated_completions": True},
    {"loss_type": "sapo", "beta": 0.04, "mask_truncated_completions": True},
])
def test_gradient_accumulation_equals_single_batch(cfg):
    params, batch = _toy(1, beta="beta" in cfg)
    sgd = optax.sgd(1.0)  # params - grads: exposes the accumulated gradient exactly
    out = {}
    for m in (1, 4):
        step_fn = update.make_update_step(
            toy_logprob_fn, {**cfg, "gradient_accumulation_steps": m}, optimizer=sgd)
        state, met = step_fn(update.make_train_state(params, sgd), batch, 3, jax.random.key(0))
        out[m] = (jax.tree.map(lambda new, old: np.asarray(new) - np.asarray(old), state.params, params),
                  met)
    ref_loss, ref_grad = _reference_grad(params, batch, cfg)
    for m in (1, 4):
        delta, met = out[m]
        for k in params:
            np.testing.assert_allclose(-delta[k], np.asarray(ref_grad[k]), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(float(met["loss"]), float(ref_loss), rtol=1e-5)
        assert float(met["update_skipped"]) == 0.0
    for name in ("loss", "clip_ratio/region_mean", "entropy", "grad_norm", "num_tokens"):
        np.testing.assert_allclose(float(out[4][1][name]), float(out[1][1][name]), rtol=1e-5)
    assert ("kl" in out[1][1]) == ("beta" in cfg)
    assert np.abs(out[1][0]["w"]).max() > 0
    if cfg["loss_type"] == "sapo":  # SAPO's loss in float64: sequence means of the gated term + KL, over all B rows
        lp = np.asarray(toy_logprob_fn(params, batch)[0], np.float64)
        m = (np.asarray(batch["completion_mask"]) == 1) & ~np.asarray(batch["truncated"])[:, None]
        d = np.asarray(batch["ref_logprobs"], np.float64) - lp
        per = _np_per_token_sapo(lp, batch["old_logprobs"], batch["advantages"]) + 0.04 * (np.exp(d) - d - 1)
        per = np.where(m, per, 0.0)
        np.testing.assert_allclose(float(out[1][1]["loss"]), (per.sum(1) / np.maximum(m.sum(1), 1)).sum() / B,
                                   rtol=1e-5)
    if cfg["loss_type"] == "cispo":  # CISPO's loss in float64: the window's token mean of -min(r, 1.2) * A * logp
        lp = np.asarray(toy_logprob_fn(params, batch)[0], np.float64)
        m = (np.asarray(batch["completion_mask"]) == 1) & ~np.asarray(batch["truncated"])[:, None]
        per = np.where(m, _np_per_token_cispo(lp, batch["old_logprobs"], batch["advantages"], 1.2), 0.0)
        np.testing.assert_allclose(float(out[1][1]["loss"]), per.sum() / m.sum(), rtol=1e-5)
    if cfg.get("importance_sampling_level") == "sequence":  # GSPO's loss in float64, independently of grpo
        lp = np.asarray(toy_logprob_fn(params, batch)[0], np.float64)
        m = np.asarray(batch["completion_mask"]) == 1
        if cfg.get("mask_truncated_completions"):
            m = m & ~np.asarray(batch["truncated"])[:, None]
        per = _np_per_token_gspo(lp, batch["old_logprobs"], batch["advantages"], m, 0.2, cfg.get("epsilon_high", 0.2))
        if cfg.get("beta"):
            d = np.asarray(batch["ref_logprobs"], np.float64) - lp
            per = per + cfg["beta"] * (np.exp(d) - d - 1)
        per = np.where(m, per, 0.0)
        want = ((per.sum(1) / np.maximum(m.sum(1), 1)).sum() / B if cfg["loss_type"] == "grpo"  # the empty row counts
                else per.sum() / m.sum())
        np.testing.assert_allclose(float(out[1][1]["loss"]), want, rtol=1e-5)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_update_step_weights_the_loss_by_rollout_is_weights_through_accumulation(loss_type):
    """batch["rollout_is_weights"] [B, T] is sliced into the micro-batches like the other [B, T] entries: the loss
    and the gradient are those of grpo.policy_loss with the weights (checked against numpy below), and without
    the key those of the plain loss."""
    params, batch = _toy(3, beta=True)
    rng = np.random.default_rng(7)
    rho = np.where(rng.uniform(size=(B, T)) < 0.2, 0.0, rng.uniform(0.2, 3.0, size=(B, T))).astype(np.float32)
    weighted = {**batch, "rollout_is_weights": jnp.asarray(rho)}
    sgd = optax.sgd(1.0)
    cfg = {"loss_type": loss_type, "beta": 0.04, "epsilon_high": 0.28}
    for b, other in ((weighted, batch), (batch, weighted)):
        ref_loss, ref_grad = _reference_grad(params, b, cfg)
        other_loss, _ = _reference_grad(params, other, cfg)
        assert abs(float(ref_loss) - float(other_loss)) > 1e-4
        for m in (1, 4):
            step_fn = update.make_update_step(toy_logprob_fn, {**cfg, "gradient_accumulation_steps": m}, optimizer=sgd)
            state, met = step_fn(update.make_train_state(params, sgd), b, 3, jax.random.key(0))
            np.testing.assert_allclose(float(met["loss"]), float(ref_loss), rtol=1e-5)
            for k in params:
                np.testing.assert_allclose(np.asarray(params[k]) - np.asarray(state.params[k]),
                                           np.asarray(ref_grad[k]), rtol=1e-5, atol=1e-7)
    # the weighted loss by hand in float64: each token's clipped term times its weight, plus beta * k3
    lp = np.asarray(toy_logprob_fn(params, batch)[0], np.float64)
    pg = _np_per_token(lp, batch["old_logprobs"], batch["advantages"], 0.2, 0.28)
    d = np.asarray(batch["ref_logprobs"], np.float64) - lp
    per = np.where(np.asarray(batch["completion_mask"]) == 1, pg * rho + 0.04 * (np.exp(d) - d - 1), 0.0)
    n = np.asarray(batch["completion_mask"]).sum(1)
    want = ((per.sum(1) / np.maximum(n, 1)).sum() / B if loss_type == "grpo"  # the empty row counts in B
            else per.sum() / n.sum())
    np.testing.assert_allclose(float(_reference_grad(params, weighted, cfg)[0]), want, rtol=1e-5)


def test_bnpo_averages_the_micro_batches_token_means():
    """TRL's bnpo: each micro-batch's loss is its own token mean, divided by the accumulation steps; so with
    micro-batches of unequal token counts (here 9, 5, 7, 6) it is not dapo's one token mean over the batch."""
    params, batch = _toy(1, beta=True)
    sgd = optax.sgd(1.0)
    cfg = {"loss_type": "bnpo", "beta": 0.04}

    def reference(p, m):  # the mean over m contiguous micro-batches of the one-batch bnpo loss
        lp, _ = toy_logprob_fn(p, batch)
        rows = B // m
        return sum(grpo.policy_loss(lp[i * rows:(i + 1) * rows], batch["old_logprobs"][i * rows:(i + 1) * rows],
                                    batch["advantages"][i * rows:(i + 1) * rows],
                                    batch["completion_mask"][i * rows:(i + 1) * rows], loss_type="bnpo", beta=0.04,
                                    ref_logprobs=batch["ref_logprobs"][i * rows:(i + 1) * rows])[0]
                   for i in range(m)) / m

    for m in (1, 4):
        step_fn = update.make_update_step(toy_logprob_fn, {**cfg, "gradient_accumulation_steps": m}, optimizer=sgd)
        state, met = step_fn(update.make_train_state(params, sgd), batch, 3, jax.random.key(0))
        ref_loss, ref_grad = jax.value_and_grad(reference)(params, m)
        np.testing.assert_allclose(float(met["loss"]), float(ref_loss), rtol=1e-5)
        for k in params:
            np.testing.assert_allclose(np.asarray(params[k]) - np.asarray(state.params[k]), np.asarray(ref_grad[k]),
                                       rtol=1e-5, atol=1e-7)
    dapo_loss, _ = jax.value_and_grad(lambda p: grpo.policy_loss(
        toy_logprob_fn(p, batch)[0], batch["old_logprobs"], batch["advantages"], batch["completion_mask"],
        loss_type="dapo", beta=0.04, ref_logprobs=batch["ref_logprobs"])[0])(params)
    assert abs(float(met["loss"]) - float(dapo_loss)) > 1e-3 * abs(float(dapo_loss))  # m = 4 differs from dapo


def test_update_step_skips_nonfinite_and_keeps_state_bit_identical():
    params, batch = _toy(2)
    cfg = {"max_steps": 10, "warmup_steps": 2, "learning_rate": 1e-2}
    step_fn = update.make_update_step(toy_logprob_fn, cfg)
    state = update.make_train_state(params, update.make_optimizer(cfg))
    state, met = step_fn(state, batch, 0, jax.random.key(0))  # a good step first
    assert float(met["update_skipped"]) == 0 and int(state.num_updates) == 1
    before = jax.tree.map(np.asarray, state)

    def sqrt_fn(p, b):  # finite loss, non-finite gradient: d sqrt(x)/dx at 0 is inf
        lp, ent = toy_logprob_fn(p, b)
        return lp + 0.0 * jnp.sqrt(p["w"][0, 0] - p["w"][0, 0]), ent

    # finite loss and gradient, non-finite update: an infinite rate makes warm-up's rate 0 * inf = NaN at
    # count 0 and inf after; before, that update was applied and wrote NaN into the adapter
    inf_step = update.make_update_step(toy_logprob_fn, {**cfg, "learning_rate": float("inf")})
    bad_batches = [(step_fn, {**batch, "advantages": batch["advantages"].at[1].set(jnp.nan)}),
                   (update.make_update_step(sqrt_fn, cfg), batch), (inf_step, batch)]
    for i, (fn, bad) in enumerate(bad_batches):
        state, met = fn(state, bad, 1, jax.random.key(1))
        assert float(met["update_skipped"]) == 1.0
        assert int(state.skipped_updates) == i + 1 and int(state.num_updates) == 1
        assert jax.tree.structure(state) == jax.tree.structure(before)
        for a, b in zip(jax.tree.leaves(before.params) + jax.tree.leaves(before.opt_state),
                        jax.tree.leaves(state.params) + jax.tree.leaves(state.opt_state)):
            assert np.array_equal(a, np.asarray(b)) and a.dtype == np.asarray(b).dtype
        assert np.isfinite(float(met["grad_norm"])) or i < 2
    state, met = step_fn(state, batch, 2, jax.random.key(2))
    assert float(met["update_skipped"]) == 0 and int(state.num_updates) == 2
    assert float(met["skipped_updates"]) == 3
    assert not np.array_equal(before.params["w"], np.asarray(state.params["w"]))
    np.testing.assert_allclose(float(met["learning_rate"]), 1e-2 * 1 / 2,  # warmup, count 1
                               rtol=1e-5)


def test_update_step_passes_step_key_and_shared():
    params, batch = _toy(3)
    seen = {}

    def fn(p, b):
        seen["keys"] = sorted(b)
        seen["scale_shape"] = b["shared"]["scale"].shape
        seen["features_shape"] = b["features"].shape
        return toy_logprob_fn(p, b)

    sgd = optax.sgd(0.1)
    step_fn = update.make_update_step(fn, {"gradient_accumulation_steps": 2}, optimizer=sgd)
    step_fn(update.make_train_state(params, sgd), batch, 7, jax.random.key(0))
    assert seen["keys"] == ["advantages", "completion_mask", "features", "key", "old_logprobs",
                            "shared", "step", "targets", "truncated"]
    assert seen["features_shape"] == (B // 2, T, D) and seen["scale_shape"] == ()
    with pytest.raises(ValueError, match="divisible"):
        bad = update.make_update_step(fn, {"gradient_accumulation_steps": 3}, optimizer=sgd)
        bad(update.make_train_state(params, sgd), batch, 0, jax.random.key(0))
    with pytest.raises(ValueError, match="ref_logprobs"):
        bad = update.make_update_step(fn, {"beta": 0.1}, optimizer=sgd)
        bad(update.make_train_state(params, sgd), batch, 0, jax.random.key(0))


def test_update_steps_raise_positive_advantage_likelihood():
    """A few AdamW updates of the default optimizer move the policy the way advantages say."""
    params, batch = _toy(4)
    batch.pop("old_logprobs")  # on-policy, num_iterations == 1
    cfg = {"learning_rate": 0.05, "lr_scheduler_type": "constant", "loss_type": "dapo"}
    step_fn = update.make_update_step(toy_logprob_fn, cfg)
    state = update.make_train_state(params, update.make_optimizer(cfg))
    mask = np.asarray(batch["completion_mask"], bool)
    adv = np.asarray(batch["advantages"])

    def objective(p):
        lp = np.asarray(toy_logprob_fn(p, batch)[0])
        return float((np.where(mask, lp, 0).sum(1) * adv).sum())

    start = objective(params)
    for i in range(5):
        state, met = step_fn(state, batch, i, jax.random.key(i))
        assert np.isfinite(float(met["loss"]))
    assert objective(state.params) > start


# ---------------------------------------------------------------------------------------------
# The update step through the real decoder: NVFP4 base, LoRA trainable
# ---------------------------------------------------------------------------------------------
def test_update_step_through_nvfp4_model_with_lora():
    from qerl_jax import models, nvfp4

    cfg = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                             num_heads=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    base = jax.jit(lambda k: models.quantize_base(models.init_params(cfg, k), "nvfp4"))(
        jax.random.key(0))
    assert isinstance(base["layers"]["attn"]["q"], nvfp4.NVFP4Tensor)
    L, r = cfg.num_layers, 4

    rng = np.random.default_rng(0)  # numpy set-up: no eager XLA op compiles

    def ab(kdim, ndim):
        return {"a": jnp.asarray(0.1 * rng.normal(size=(L, kdim, r)), jnp.float32),
                "b": jnp.asarray(0.1 * rng.normal(size=(L, r, ndim)), jnp.float32)}

    lora = {"layers": {"attn": {"q": ab(32, 32), "v": ab(32, 16)}, "mlp": {"down": ab(64, 32)},
                       "input_norm": jnp.ones((L, 32), jnp.float32)}}
    n, t, prompt = 4, 12, 4
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(n, t)), jnp.int32)
    lengths = np.array([8, 5, 8, 2])
    cmask = ((np.arange(t)[None] >= prompt) & (np.arange(t)[None] < prompt + lengths[:, None]))
    attn = jnp.ones((n, t), jnp.int32)
    noise = {"input_norm": jnp.asarray(0.01 * rng.normal(size=(L, 32)), jnp.float32),
             "post_attn_norm": jnp.zeros((L, 32), jnp.float32)}

    def logprob_fn(params, mb):
        return models.token_logprobs(cfg, mb["shared"]["base"], mb["tokens"], mb["positions"],
                                     lora=params, lora_cfg=2.0, attn_mask=mb["attn_mask"],
                                     norm_noise=mb["shared"]["noise"], chunk_size=8, remat=False)

    positions = jnp.asarray(np.broadcast_to(np.arange(t, dtype=np.int32), (n, t)))
    inputs = {"tokens": tokens, "positions": positions, "attn_mask": attn,
              "shared": {"base": base, "noise": noise}}
    lp_jit = jax.jit(logprob_fn)
    lp0, _ = lp_jit(lora, inputs)
    # the reference policy (LoRA off, no noise), through the same compiled function: B = 0 makes
    # every LoRA delta exactly 0, the trainable input_norm equals the base's ones, noise 0
    lora_off = jax.tree.map(jnp.zeros_like, lora)
    lora_off["layers"]["input_norm"] = base["layers"]["input_norm"].astype(jnp.float32)
    for group in ("attn", "mlp"):
        for name in lora["layers"][group]:
            lora_off["layers"][group][name]["a"] = lora["layers"][group][name]["a"]
    ref, _ = lp_jit(lora_off, {**inputs, "shared": {"base": base,
                                                    "noise": jax.tree.map(jnp.zeros_like, noise)}})
    adv = grpo.group_advantages(jnp.array([1.0, 0.0, 0.0, 1.0]), 4)
    batch = {"tokens": tokens, "positions": positions, "attn_mask": attn,
             "completion_mask": jnp.asarray(cmask), "advantages": adv, "old_logprobs": lp0,
             "ref_logprobs": ref, "shared": {"base": base, "noise": noise}}
    upd = {"loss_type": "dapo", "beta": 0.04, "gradient_accumulation_steps": 2,
           "learning_rate": 1e-3, "lr_scheduler_type": "constant"}
    step_fn = update.make_update_step(logprob_fn, upd)
    state0 = update.make_train_state(lora, update.make_optimizer(upd))
    base_before = jax.tree.map(np.asarray, base)
    state, met = step_fn(state0, batch, 0, jax.random.key(1))

    # first iteration: old == current, ratio 1, so dapo's loss is the token mean of
    # -A + beta * k3(ref - logp), computed here in float64 from the model's own log-probs
    lp64, ref64 = np.asarray(lp0, np.float64), np.asarray(ref, np.float64)
    d = ref64 - lp64
    per = -np.asarray(adv, np.float64)[:, None] + 0.04 * (np.exp(d) - d - 1)
    # (the update recomputes the log-probs in its own program: on the CPU within 2e-4 of lp0; a GPU
    # fuses that program differently, within 2e-3)
    rtol = 2e-4 if jax.default_backend() == "cpu" else 2e-3
    np.testing.assert_allclose(float(met["loss"]), per[cmask].mean(), rtol=rtol, atol=1e-6)
    np.testing.assert_allclose(float(met["kl"]), (np.exp(d) - d - 1)[cmask].mean(), rtol=rtol,
                               atol=1e-7)
    assert float(met["update_skipped"]) == 0 and np.isfinite(float(met["grad_norm"]))
    assert float(met["grad_norm"]) > 0
    # every LoRA leaf (and the trainable norm) moved; the frozen NVFP4 base did not
    assert jax.tree.structure(state.params) == jax.tree.structure(lora)
    for old, new in zip(jax.tree.leaves(lora), jax.tree.leaves(state.params)):
        assert not np.array_equal(np.asarray(old), np.asarray(new))
        assert np.all(np.isfinite(np.asarray(new)))
    for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(base)):
        assert np.array_equal(a, np.asarray(b)) and a.dtype == np.asarray(b).dtype
    # a second iteration on the same rollout (num_iterations = 2) sees a ratio != 1
    state2, met2 = step_fn(state, batch, 0, jax.random.key(1))
    assert float(met2["update_skipped"]) == 0 and np.isfinite(float(met2["loss"]))
    assert float(met2["loss"]) != float(met["loss"])


# --------------------------------------------------------------------------- DAPO's filter and overlong term

def test_informative_groups_hand_worked():
  """Groups of 4: mixed rewards; all equal; equal among the finite ones (a NaN is missing); a spread of 0.1;
  one finite reward only (no std with ddof 1); two finite unequal rewards."""
  nan = float("nan")
  r = np.array([1, 1, 0, 1, 0, 0, 0, 0, 1, nan, 1, 1, 0.5, 0.5, 0.5, 0.6,
                nan, nan, 1, nan, nan, 0, nan, 1], np.float32)
  np.testing.assert_array_equal(np.asarray(grpo.informative_groups(r, 4)),
                                [True, False, False, True, False, True])
  # exactly the groups whose advantages are not all zero
  adv = np.asarray(grpo.group_advantages(r, 4)).reshape(-1, 4)
  np.testing.assert_array_equal((adv != 0).any(axis=1), [True, False, False, True, False, True])
  with pytest.raises(ValueError, match="not a multiple of group_size"):
    grpo.informative_groups(r[:5], 4)


def test_overlong_penalty_hand_worked():
  """DAPO eq. 13 with L = 10, C = 4: 0 up to 6 tokens, then -1/4 a token, -1 at and beyond 10."""
  lengths = np.array([[0, 5, 6, 7], [8, 9, 10, 12]], np.int32)
  np.testing.assert_allclose(np.asarray(grpo.overlong_penalty(lengths, 10, 4)),
                             [[0, 0, 0, -0.25], [-0.5, -0.75, -1, -1]])
  assert not np.signbit(np.asarray(grpo.overlong_penalty(lengths, 10, 4))[0, :3]).any()  # 0, not -0.
  np.testing.assert_allclose(np.asarray(grpo.overlong_penalty(lengths, 10, 4, 0.5)),
                             [[0, 0, 0, -0.125], [-0.25, -0.375, -0.5, -0.5]])
  np.testing.assert_array_equal(np.asarray(grpo.overlong_penalty(lengths, 10, 0)), np.zeros((2, 4)))
  # C = L: the ramp starts at 0 tokens
  np.testing.assert_allclose(np.asarray(grpo.overlong_penalty(np.array([0, 2, 4]), 4, 4)), [0, -0.5, -1])
  for args, needle in (((lengths, 10, 11), "buffer_length"), ((lengths, 10, -1), "buffer_length"),
                       ((lengths, 0, 0), "max_length"), ((lengths, 10, 4, -1.0), "penalty_factor"),
                       ((lengths, 10, 4, float("inf")), "penalty_factor"),
                       ((lengths.astype(np.float32), 10, 4), "integers")):
    with pytest.raises(ValueError, match=needle):
      grpo.overlong_penalty(*args)


def test_update_step_checks_the_trl_loss_fields_at_build_time():
    """TRL's importance_sampling_level, delta and top_entropy_quantile are implemented; bad values are refused
    when the step is built, not at its first call."""
    for field, value, needle in (("importance_sampling_level", "seq", "importance_sampling_level must be one of"),
                                 ("delta", -1.0, "delta must be"), ("top_entropy_quantile", 1.5,
                                                                    "top_entropy_quantile must be")):
        with pytest.raises(ValueError, match=needle):
            update.make_update_step(toy_logprob_fn, {"loss_type": "dapo", field: value})


@pytest.mark.parametrize("cfg", [{"loss_type": "dapo", "delta": 1.1, "epsilon_high": 0.28},
                                 {"loss_type": "grpo", "top_entropy_quantile": 0.3}])
def test_update_step_with_delta_or_entropy_mask_matches_numpy(cfg):
    """The update step's loss with INTELLECT-2's delta or TRL's entropy mask against a float64 reference; the
    entropy quantile is each micro-batch's, as TRL's (one micro-batch here, so the whole batch's)."""
    params, batch = _toy(4)
    sgd = optax.sgd(1.0)
    step_fn = update.make_update_step(toy_logprob_fn, cfg, optimizer=sgd)
    _, met = step_fn(update.make_train_state(params, sgd), batch, 3, jax.random.key(0))
    lp, ent = (np.asarray(x, np.float64) for x in toy_logprob_fn(params, batch))
    m = np.asarray(batch["completion_mask"]) == 1
    r = np.exp(lp - np.asarray(batch["old_logprobs"], np.float64))
    a = np.asarray(batch["advantages"], np.float64)[:, None]
    eps_high = cfg.get("epsilon_high", 0.2)
    per = -np.minimum(np.minimum(r, cfg.get("delta", np.inf)) * a, np.clip(r, 0.8, 1 + eps_high) * a)
    if "top_entropy_quantile" in cfg:
        per = np.where(ent >= np.quantile(ent[m], 1 - cfg["top_entropy_quantile"]), per, 0.0)
    per = np.where(m, per, 0.0)
    want = ((per.sum(1) / np.maximum(m.sum(1), 1)).sum() / B if cfg["loss_type"] == "grpo" else per.sum() / m.sum())
    np.testing.assert_allclose(float(met["loss"]), want, rtol=1e-5)
    plain, _ = _reference_grad(params, batch, {"loss_type": cfg["loss_type"], "epsilon_high": eps_high})
    assert abs(float(plain) - want) > 1e-4  # the option changed the loss on this batch
    # at their neutral values they are accepted
    update.make_update_step(toy_logprob_fn, {"loss_type": "dapo", "max_steps": 10, "importance_sampling_level": "token",
                                             "delta": None, "top_entropy_quantile": 1.0})
