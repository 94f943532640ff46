"""The policy loss as pure tensor math: gradient direction, clipping, IS caps, corrections, masking."""

from __future__ import annotations

import math

import pytest
import torch

from rlorch.config.schema import Correction, LossAgg, UnlikelihoodLevel
from rlorch.trainer.loss import LossStats, aggregate, loglinear_proximal, policy_loss, token_logprobs

ARGS = dict(clip_eps=0.2, is_cap=2.0)


def _leaf(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def _grad(logp: torch.Tensor, behaviour, mask, adv, correction, prox=None, **kwargs):
    loss, stats = policy_loss(logp, torch.tensor(behaviour, dtype=torch.float64),
                              torch.tensor(mask, dtype=torch.float64),
                              torch.tensor(adv, dtype=torch.float64), correction=correction,
                              prox=prox, **{**ARGS, **kwargs})
    loss.backward()
    return loss, stats, logp.grad


@pytest.mark.parametrize("correction", list(Correction))
def test_on_policy_is_plain_policy_gradient(correction):
    """ratio = 1: every mode's gradient is -A * grad(logp) / tokens (raise logp where A > 0)."""
    values = [[-1.0, -2.0, -0.5], [-0.3, -1.5, -2.5]]
    logp = _leaf(values)
    _, stats, grad = _grad(logp, values, [[1, 1, 1], [1, 1, 1]], [1.0, -0.5], correction,
                           prox=torch.tensor(values, dtype=torch.float64))
    expected = torch.tensor([[-1.0] * 3, [0.5] * 3], dtype=torch.float64) / 6
    assert torch.allclose(grad, expected)
    assert stats.summary()["ratio_mean"] == pytest.approx(1.0)
    assert stats.summary()["kl"] == pytest.approx(0.0)
    assert stats.summary()["clip_frac"] == 0.0


def test_ppo_clip_removes_gradient_outside_the_trust_region():
    behaviour = [[-1.0, -1.0]]
    logp = _leaf([[-1.0 + math.log(1.5), -1.0 + math.log(0.5)]])  # ratios 1.5 and 0.5
    _, stats, grad = _grad(logp, behaviour, [[1, 1]], [1.0], Correction.none)
    assert grad[0, 0] == 0.0  # A > 0 and ratio above 1 + eps: clipped
    assert grad[0, 1] == pytest.approx(-0.5 / 2)  # A > 0, ratio below 1 - eps: min keeps it
    assert stats.summary()["clip_frac"] == 0.5
    assert stats.summary()["ratio_max"] == pytest.approx(1.5)

    logp = _leaf([[-1.0 + math.log(1.5), -1.0 + math.log(0.5)]])
    _, _, grad = _grad(logp, behaviour, [[1, 1]], [-1.0], Correction.none)
    assert grad[0, 0] == pytest.approx(1.5 / 2)  # A < 0: a too-likely token is still pushed down
    assert grad[0, 1] == 0.0


def test_decoupled_weights_by_capped_behaviour_ratio_and_clips_against_prox():
    prox = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64)
    behaviour = [[-1.0 - math.log(1.5), -1.0 - math.log(5.0), -1.0]]  # weights 1.5, 5 -> cap 2, 1
    logp = _leaf(prox.tolist())
    _, stats, grad = _grad(logp, behaviour, [[1, 1, 1]], [1.0], Correction.decoupled, prox=prox)
    assert torch.allclose(grad, -torch.tensor([[1.5, 2.0, 1.0]], dtype=torch.float64) / 3)
    assert stats.summary()["is_capped_frac"] == pytest.approx(1 / 3)

    moved = _leaf([[-1.0 + math.log(1.5), -1.0, -1.0]])  # ratio to prox 1.5 > 1 + eps
    _, stats, grad = _grad(moved, behaviour, [[1, 1, 1]], [1.0], Correction.decoupled, prox=prox)
    assert grad[0, 0] == 0.0 and stats.summary()["clip_frac"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("correction", [Correction.none, Correction.decoupled])
def test_clip_high_lets_a_positive_advantage_grow_past_one_plus_clip_eps(correction):
    """Ratio 1.25: above 1 + clip_eps (0.2), below 1 + clip_high (0.28): its gradient survives
    for A > 0; ratio 1.3 is clipped at 1 + clip_high; the low side stays clip_eps."""
    behaviour = [[-1.0, -1.0, -1.0]]
    prox = torch.tensor(behaviour, dtype=torch.float64)
    ratios = [1.25, 1.3, 0.75]
    moved = [[-1.0 + math.log(r) for r in ratios]]
    _, _, symmetric = _grad(_leaf(moved), behaviour, [[1, 1, 1]], [1.0], correction, prox=prox)
    assert symmetric[0, 0] == 0.0
    _, stats, grad = _grad(_leaf(moved), behaviour, [[1, 1, 1]], [1.0], correction, prox=prox, clip_high=0.28)
    assert grad[0, 0] == pytest.approx(-1.25 / 3)
    assert grad[0, 1] == 0.0
    assert grad[0, 2] == pytest.approx(-0.75 / 3)
    assert stats.summary()["clip_frac"] == pytest.approx(1 / 3)
    _, _, negative = _grad(_leaf([[-1.0 + math.log(0.75)]]), [[-1.0]], [[1]], [-1.0], correction,
                           prox=torch.tensor([[-1.0]], dtype=torch.float64), clip_high=0.28)
    assert negative[0, 0] == 0.0  # A < 0, ratio below 1 - clip_eps: clipped at the low side


def test_decoupled_needs_prox():
    with pytest.raises(ValueError, match="prox"):
        _grad(_leaf([[-1.0]]), [[-1.0]], [[1]], [1.0], Correction.decoupled)


def test_tis_truncates_the_importance_weight_without_clipping():
    behaviour = [[-2.0, -1.0 - math.log(3.0)]]
    logp = _leaf([[-2.0 + math.log(1.5), -1.0]])  # weights 1.5 and 3 -> 2
    _, stats, grad = _grad(logp, behaviour, [[1, 1]], [1.0], Correction.tis)
    assert torch.allclose(grad, -torch.tensor([[1.5, 2.0]], dtype=torch.float64) / 2)
    assert stats.summary()["clip_frac"] == 0.0 and stats.summary()["is_capped_frac"] == 0.5


def _one_token_grad(correction, current: float, prox: float, behaviour: float) -> float:
    logp = _leaf([[math.log(current)]])
    prox_t = torch.tensor([[math.log(prox)]], dtype=torch.float64)
    return _grad(logp, [[math.log(behaviour)]], [[1]], [1.0], correction, prox=prox_t)[2].item()


def test_corrections_differ_off_policy():
    """Stale data: ``none`` clips it away as if it were a large update, ``decoupled`` and ``tis``
    keep it, importance-weighted (capped); ``decoupled`` clips only the move away from prox;
    ``recompute`` keeps it unweighted, as if the proximal policy had sampled it."""
    fresh = {c: _one_token_grad(c, current=0.3, prox=0.3, behaviour=0.2) for c in Correction}
    assert fresh[Correction.none] == 0.0  # ratio 1.5 to behaviour: outside the clip
    assert fresh[Correction.decoupled] == pytest.approx(-1.5)  # weight 1.5, ratio 1 to prox
    assert fresh[Correction.tis] == pytest.approx(-1.5)
    assert fresh[Correction.recompute] == pytest.approx(-1.0)  # ratio 1 to prox, no weight
    very_stale = {c: _one_token_grad(c, current=0.3, prox=0.3, behaviour=0.1) for c in Correction}
    assert very_stale[Correction.decoupled] == pytest.approx(-2.0)  # weight 3 capped at is_cap
    assert very_stale[Correction.tis] == pytest.approx(-2.0)
    assert very_stale[Correction.recompute] == pytest.approx(-1.0)  # the behaviour never read
    moved = {c: _one_token_grad(c, current=0.3, prox=0.2, behaviour=0.2) for c in Correction}
    assert moved[Correction.decoupled] == 0.0  # already 1.5x the proximal policy: clipped
    assert moved[Correction.none] == 0.0
    assert moved[Correction.recompute] == 0.0
    assert moved[Correction.tis] == pytest.approx(-1.5)  # no trust region, only the cap


def test_recompute_is_decoupled_without_the_behaviour_weight():
    """Where behaviour and proximal policies agree (no staleness, no mismatch) the two are the
    same loss; apart, recompute's gradient is decoupled's divided by each token's weight."""
    prox = torch.tensor([[-0.75, -0.7, -1.5]], dtype=torch.float64)
    current = [[-0.7, -0.75, -1.3]]
    grads = {}
    for behaviour in (prox, torch.tensor([[-1.2, -0.6, -1.4]], dtype=torch.float64)):
        for correction in (Correction.decoupled, Correction.recompute):
            logp = _leaf(current)
            policy_loss(logp, behaviour, torch.ones(1, 3), torch.tensor([1.0]), correction=correction,
                        prox=prox, **ARGS)[0].backward()
            grads[correction] = logp.grad
        weight = torch.clamp(torch.exp(prox - behaviour), max=ARGS["is_cap"])
        assert torch.allclose(grads[Correction.decoupled], grads[Correction.recompute] * weight)
    assert not torch.allclose(grads[Correction.decoupled], grads[Correction.recompute])


def test_recompute_without_proximal_logprobs_is_refused():
    with pytest.raises(ValueError, match="recompute correction needs the proximal logprobs"):
        _grad(_leaf([[-1.0]]), [[-1.0]], [[1]], [1.0], Correction.recompute)


def test_loglinear_proximal_logprobs_move_each_token_by_its_age_toward_the_trained_weights():
    """Proximal version 7, weights half a version past it (the second of two minibatches). A token
    sampled by version 7 keeps its behaviour logprob; one sampled by 5 (age 2) is read 2 / 2.5
    of the way from its behaviour logprob at 5 to the trained one at 7.5; one by 6, 1 / 1.5."""
    logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.4, -1.0, -0.8, 0.0]])
    versions = torch.tensor([[7, 5, 6, -1]])
    estimate = loglinear_proximal(logp, behaviour, versions, proximal_version=7, current_version=7.5)
    expected = [-1.4, -1.0 + 0.8 * (-2.0 + 1.0), -0.8 + (1 / 1.5) * (-0.5 + 0.8)]
    assert estimate[0, :3].tolist() == pytest.approx(expected, abs=1e-6)
    assert torch.isfinite(estimate).all() and not estimate.requires_grad
    # At the proximal weights themselves (the first minibatch) an old token's estimate is exact.
    exact = loglinear_proximal(logp, behaviour, versions, proximal_version=7, current_version=7.0)
    assert exact[0, 1:3].tolist() == pytest.approx([-2.0, -0.5])


def test_masked_tokens_contribute_nothing():
    logp = _leaf([[-1.0, -7.0, -2.0]])
    loss, stats, grad = _grad(logp, [[-1.0, -0.1, -2.0]], [[1, 0, 1]], [2.0], Correction.none)
    assert grad[0, 1] == 0.0
    assert stats.tokens == 2 and stats.summary()["ratio_max"] == pytest.approx(1.0)
    unmasked = _leaf([[-1.0, 0.0, -2.0]])
    same, _, _ = _grad(unmasked, [[-1.0, 5.0, -2.0]], [[1, 0, 1]], [2.0], Correction.none)
    assert loss.item() == pytest.approx(same.item())


def test_global_token_mean_across_micro_batches():
    """Summing micro-batch losses normalised by the batch's token count equals one big batch."""
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.7, -0.9]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    whole, whole_stats = policy_loss(logp, logp, mask, adv, correction=Correction.none, **ARGS)
    parts = [policy_loss(logp[i:i + 1], logp[i:i + 1], mask[i:i + 1], adv[i:i + 1],
                         correction=Correction.none, normalizer=5, **ARGS) for i in range(2)]
    assert sum(p[0] for p in parts).item() == pytest.approx(whole.item())
    merged = parts[0][1].merge(parts[1][1])
    assert merged.tokens == whole_stats.tokens == 5
    assert LossStats.from_tensor(merged.as_tensor(), merged.ratio_max).summary() == whole_stats.summary()


def test_token_logprobs_align_with_tokens():
    logits = torch.randn(2, 4, 7)
    tokens = torch.randint(0, 7, (2, 4))
    got = token_logprobs(logits, tokens)
    assert got.shape == (2, 4) and torch.all(got[:, 0] == 0)
    expected = torch.log_softmax(logits[0, 1], -1)[tokens[0, 2]]
    assert got[0, 2].item() == pytest.approx(expected.item(), abs=1e-5)


def test_token_logprobs_use_the_sampling_temperature():
    logits = torch.randn(1, 3, 5)
    tokens = torch.tensor([[1, 2, 3]])
    hot = token_logprobs(logits, tokens, temperature=2.0)
    assert torch.allclose(hot, token_logprobs(logits / 2.0, tokens))
    assert torch.allclose(token_logprobs(logits, tokens, temperature=0.0), token_logprobs(logits, tokens))


def test_token_entropy_is_log_vocab_for_uniform_logits_and_zero_when_certain():
    import math

    from rlorch.trainer.loss import token_entropy

    uniform = torch.zeros(1, 3, 10)
    assert torch.allclose(token_entropy(uniform)[0, 1:], torch.full((2,), math.log(10)))
    certain = torch.full((1, 3, 10), -1e4)
    certain[..., 0] = 1e4
    assert token_entropy(certain)[0].abs().max() < 1e-4


def test_kl_is_k3_of_behaviour_to_trainer_and_stays_modest_when_the_trainer_moved_away():
    """Regression: the mirrored estimator (1/r - 1 + log r) read a token whose trainer
    probability fell 10^4-fold as a KL of ~10^4 (the blow-ups seen on long default runs)."""
    from rlorch.trainer.loss import MismatchStats, k3_kl

    moved_away = torch.tensor([math.log(1e-4)])
    assert k3_kl(moved_away).item() == pytest.approx(1e-4 - 1 + math.log(1e4))
    assert k3_kl(moved_away).item() < 10
    assert k3_kl(torch.tensor([0.0])).item() == 0.0
    values = [[-0.5, -2.0]]
    _, stats, _ = _grad(_leaf([[-0.5 + math.log(1e-4), -2.0]]), values, [[1, 1]], [1.0], Correction.tis)
    assert stats.summary()["kl"] == pytest.approx((1e-4 - 1 + math.log(1e4)) / 2)

    mismatch = MismatchStats()
    trainer = torch.tensor([[-1.0, -2.0, -3.0]])
    mismatch.add(trainer, trainer + torch.tensor([[0.0, 0.1, 5.0]]), torch.tensor([[True, True, False]]))
    summary = mismatch.summary()
    assert summary["mismatch_tokens"] == 2 and summary["mismatch_max"] == pytest.approx(0.1)
    assert summary["mismatch_kl"] == pytest.approx((math.exp(-0.1) - 1 + 0.1) / 2)
    assert MismatchStats().summary()["mismatch_kl"] is None


def test_after_an_update_the_corrections_give_different_gradients():
    """What a second minibatch sees: the weights moved since the proximal pass, and the data
    came from an older behaviour policy. decoupled clips against prox, tis weighs against the
    current policy, none clips against behaviour, recompute clips against prox unweighted: four
    different gradients (token 0 is inside decoupled's trust region around prox but outside
    none's around behaviour)."""
    behaviour = torch.tensor([[-1.2, -0.2, -2.0]], dtype=torch.float64)
    prox = torch.tensor([[-0.75, -0.7, -1.5]], dtype=torch.float64)
    current = [[-0.7, -0.75, -1.0]]
    grads = {}
    for correction in Correction:
        logp = _leaf(current)
        loss, stats = policy_loss(logp, behaviour, torch.ones(1, 3), torch.tensor([1.0]),
                                  correction=correction, clip_eps=0.2, is_cap=2.0, prox=prox)
        loss.backward()
        grads[correction] = logp.grad
        if correction is Correction.decoupled:
            assert stats.summary()["clip_frac"] > 0  # token 2: exp(-1.0 + 1.5) > 1.2, clipped
    assert not torch.allclose(grads[Correction.decoupled], grads[Correction.tis])
    assert not torch.allclose(grads[Correction.decoupled], grads[Correction.none])
    assert not torch.allclose(grads[Correction.tis], grads[Correction.none])
    assert not torch.allclose(grads[Correction.recompute], grads[Correction.decoupled])
    assert not torch.allclose(grads[Correction.recompute], grads[Correction.none])


def _agg_batch():
    per_token = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 4.0, 0.0, 0.0], [0.0, 5.0, 7.0, 0.0],
                              [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.float64)
    return per_token, mask


@pytest.mark.parametrize("agg, expected", [
    # 6 masked tokens summing to 22 over 4 sequences (the last has no trained token).
    (LossAgg.token_mean, 22 / 6),
    (LossAgg.seq_mean_token_sum, 22 / 4),
    (LossAgg.seq_mean_token_mean, (6 / 3 + 4 / 1 + 12 / 2 + 0) / 4),
])
def test_each_aggregation_by_hand(agg, expected):
    per_token, mask = _agg_batch()
    assert aggregate(per_token, mask, agg).item() == pytest.approx(expected)


@pytest.mark.parametrize("agg", list(LossAgg))
def test_aggregations_are_exact_across_micro_batches_and_rank_strides(agg):
    """Rank r takes rows r, r + W, ...; each rank cuts its rows into micro-batches of one. With
    the minibatch's counts as normalisers, the summed pieces equal the whole minibatch's loss."""
    per_token, mask = _agg_batch()
    whole = aggregate(per_token, mask, agg)
    counts = dict(tokens=mask.sum().item(), sequences=4)
    world = 2
    pieces = [aggregate(per_token[row:row + 1], mask[row:row + 1], agg, **counts)
              for rank in range(world) for row in range(rank, 4, world)]
    assert sum(pieces).item() == pytest.approx(whole.item())
    # Normalising by a micro-batch's own counts instead would be wrong (the test can fail):
    local = [aggregate(per_token[row:row + 1], mask[row:row + 1], agg) for row in range(4)]
    assert sum(local).item() != pytest.approx(whole.item())


def test_policy_loss_uses_the_aggregation_and_the_default_is_the_token_mean():
    values = [[0.0, -1.0, -2.0, -0.5], [0.0, -0.3, 0.0, 0.0]]
    mask = [[0, 1, 1, 1], [0, 1, 0, 0]]
    expected = {LossAgg.token_mean: torch.tensor([[0, -1, -1, -1], [0, 2, 0, 0]]) / 4,
                LossAgg.seq_mean_token_sum: torch.tensor([[0, -1, -1, -1], [0, 2, 0, 0]]) / 2,
                LossAgg.seq_mean_token_mean: torch.tensor([[0, -1 / 3, -1 / 3, -1 / 3], [0, 2, 0, 0]]) / 2}
    for agg, grad in expected.items():
        logp = _leaf(values)
        _, _, got = _grad(logp, values, mask, [1.0, -2.0], Correction.tis, agg=agg)
        assert torch.allclose(got, grad.to(torch.float64)), agg
    default, _, _ = _grad(_leaf(values), values, mask, [1.0, -2.0], Correction.tis)
    token_mean, _, _ = _grad(_leaf(values), values, mask, [1.0, -2.0], Correction.tis, agg=LossAgg.token_mean)
    assert default.item() == token_mean.item()


def test_reference_kl_estimators_by_hand():
    """log_ratio = log 2 (the policy doubled a token's probability over the reference)."""
    from rlorch.config.schema import KlEstimator
    from rlorch.trainer.loss import reference_kl

    ref = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    expected = {KlEstimator.k1: (math.log(2), 1.0), KlEstimator.k2: (0.5 * math.log(2) ** 2, math.log(2)),
                KlEstimator.k3: (0.5 - 1 + math.log(2), 1 - 0.5)}  # (value, d value / d logp)
    for estimator, (value, slope) in expected.items():
        logp = _leaf([[math.log(0.5)]])
        kl = reference_kl(logp, ref, estimator)
        kl.sum().backward()
        assert kl.item() == pytest.approx(value) and logp.grad.item() == pytest.approx(slope), estimator
        same = _leaf([[math.log(0.25)]])
        at_reference = reference_kl(same, ref, estimator)
        at_reference.sum().backward()
        assert at_reference.item() == 0.0
        assert same.grad.item() == (1.0 if estimator is KlEstimator.k1 else 0.0)


def test_no_reference_is_built_at_kl_coef_zero():
    from rlorch.config.compose import compose
    from rlorch.trainer.fsdp import build_reference

    assert build_reference(compose([]), "no/such/model", torch.device("cpu")) is None
    with pytest.raises(Exception, match="trainer.kl_coef"):
        compose(["trainer.kl_coef=-0.1"])
    with pytest.raises(Exception, match="trainer.kl_estimator"):
        compose(["trainer.kl_estimator=k4"])


def _logit_grad(logits_row, adv, *, unlikelihood, scale=1.0):
    """Gradient of the on-policy loss with respect to the logits that sampled token 1."""
    logits = torch.tensor([logits_row], dtype=torch.float32, requires_grad=True)
    full = torch.cat([logits.unsqueeze(1), torch.zeros(1, 1, logits.shape[-1])], dim=1)
    logp = token_logprobs(full, torch.tensor([[0, 1]]))
    marks = torch.tensor([[False, unlikelihood]])
    loss, _ = policy_loss(logp, logp.detach(), torch.tensor([[0.0, 1.0]]), torch.tensor([adv]),
                          correction=Correction.decoupled, prox=logp.detach(), unlikelihood=marks,
                          unlikelihood_scale=scale, **ARGS)
    loss.backward()
    return logits.grad[0]


@pytest.mark.parametrize("gap", [3.0, 8.0, 12.0])
def test_unlikelihood_pushes_a_sure_wrong_token_down_where_a_plain_negative_advantage_cannot(gap):
    """Token 1 sampled with probability p = 1 - ~3 exp(-gap) (entropy down to 4e-5 nats): -1
    moves its logit by 1 - p, the unlikelihood weight by p (the gradient of -log(1 - p))."""
    row = [0.0, gap, 0.0, 0.0]
    p = torch.softmax(torch.tensor(row, dtype=torch.float64), -1)[1].item()
    plain = _logit_grad(row, -1.0, unlikelihood=False)
    unlikely = _logit_grad(row, -1.0, unlikelihood=True)
    assert plain[1].item() == pytest.approx(1 - p, rel=0.05)  # float32 softmax
    assert unlikely[1].item() == pytest.approx(p, rel=1e-3)
    assert unlikely[[0, 2, 3]].tolist() == pytest.approx([-p / 3] * 3, rel=0.05)  # the others rise


@pytest.mark.parametrize("gap", [20.0, 60.0])
def test_unlikelihood_stays_finite_and_bounded_where_float32_rounds_p_to_one(gap):
    unlikely = _logit_grad([0.0, gap, 0.0, 0.0], -1.0, unlikelihood=True)
    assert torch.isfinite(unlikely).all() and unlikely.abs().max().item() <= 1.0


def test_the_unlikelihood_weight_is_p_over_one_minus_p_times_its_scale():
    row = [0.0, 2.0, 0.0, 0.0]
    marked, plain = _logit_grad(row, -1.0, unlikelihood=True), _logit_grad(row, -1.0, unlikelihood=False)
    p = torch.softmax(torch.tensor(row), -1)[1].item()
    assert torch.allclose(marked, plain * p / (1 - p), rtol=1e-4)
    assert torch.allclose(_logit_grad(row, -1.0, unlikelihood=True, scale=0.1), marked * 0.1, rtol=1e-5)


def _answer_grads(gaps, level, *, scale=1.0, packed=False):
    """Two prompt tokens, then an answer whose token t the policy sampled with logit gap
    ``gaps[t]`` over three others, marked for unlikelihood (prompt included: the loss mask must
    keep it out of the answer's probability). Returns the loss's gradient with respect to each
    sampled token's logit and that token's probability. ``packed``: the same answer twice in one
    row, told apart by ``segments``."""
    copies = 2 if packed else 1
    width = 2 + len(gaps)
    logits = torch.zeros(1, width * copies, 4)
    for copy in range(copies):
        logits[0, copy * width + 1: copy * width + 1 + len(gaps), 1] = torch.tensor(gaps)
    logits.requires_grad_(True)
    tokens = torch.tensor([([0, 2] + [1] * len(gaps)) * copies])
    mask = torch.tensor([([0.0, 0.0] + [1.0] * len(gaps)) * copies])
    segments = torch.tensor([[copy for copy in range(copies) for _ in range(width)]]) if packed else None
    logp = token_logprobs(logits, tokens)
    advantages = torch.full_like(logp, -1.0) if packed else torch.tensor([-1.0])
    loss, _ = policy_loss(logp, logp.detach(), mask, advantages, correction=Correction.decoupled,
                          prox=logp.detach(), unlikelihood=torch.ones_like(mask, dtype=torch.bool),
                          unlikelihood_scale=scale, unlikelihood_level=level, normalizer=1.0,
                          segments=segments, **ARGS)
    loss.backward()
    answer = slice(1, 1 + len(gaps))
    return logits.grad[0, answer, 1], torch.softmax(logits.detach()[0, answer], -1)[:, 1]


def test_sequence_unlikelihood_is_the_gradient_of_minus_log_one_minus_the_answers_probability():
    gaps = [7.0, 6.5, 3.1]       # p = 0.997, 0.996, 0.88: two sure right digits, one wrong
    grads, p = _answer_grads(gaps, UnlikelihoodLevel.sequence)
    logits = torch.zeros(len(gaps), 4)
    logits[:, 1] = torch.tensor(gaps)
    logits.requires_grad_(True)
    answer = torch.log_softmax(logits, -1)[:, 1].sum()
    (-torch.log1p(-answer.exp())).backward()
    assert torch.allclose(grads, logits.grad[:, 1], rtol=1e-4)
    whole = p.prod()
    assert torch.allclose(grads, whole * (1 - p) / (1 - whole), rtol=1e-4)
    # The push lands on the digit the policy is least sure of; per token, it lands on every one.
    assert grads[2] > 10 * grads[:2].max()
    tokens, _ = _answer_grads(gaps, UnlikelihoodLevel.token)
    assert torch.allclose(tokens, p, rtol=1e-4) and grads[:2].max() < 0.05 * tokens[:2].min()


def test_sequence_unlikelihood_spreads_evenly_over_a_sure_answer_and_stays_bounded():
    for gap, bound in ((9.0, 1.0), (25.0, 1.0)):    # float32 rounds p to 1 at 25
        grads, p = _answer_grads([gap] * 3, UnlikelihoodLevel.sequence)
        assert torch.isfinite(grads).all() and grads.max().item() <= bound
        assert torch.allclose(grads, grads[0].expand(3), rtol=1e-3)
    grads, _ = _answer_grads([9.0] * 3, UnlikelihoodLevel.sequence)
    assert grads[0].item() == pytest.approx(1 / 3, rel=0.01)   # (1 - p) / (1 - p^3) for p near 1


def test_sequence_unlikelihood_reads_each_packed_sequence_alone_and_takes_its_scale():
    gaps = [7.0, 6.5, 3.1]
    alone, _ = _answer_grads(gaps, UnlikelihoodLevel.sequence)
    packed, _ = _answer_grads(gaps, UnlikelihoodLevel.sequence, packed=True)
    assert torch.allclose(packed, alone, rtol=1e-4)
    scaled, _ = _answer_grads(gaps, UnlikelihoodLevel.sequence, scale=0.1)
    assert torch.allclose(scaled, alone * 0.1, rtol=1e-4)
