"""The policy loss: a token-level clipped policy-gradient objective with off-policy correction.

Pure functions on tensors. Shapes: ``[rows, seq]`` per-token tensors aligned with the input
tokens (position ``t`` holds the logprob of token ``t`` given tokens ``< t``); advantages either
``[rows]`` (one per row: a padded row is one rollout) or ``[rows, seq]`` (each token its
rollout's: a packed row holds several). Per-sequence aggregation reads which sequence each
position belongs to from ``segments`` (``[rows, seq]``; default: a sequence a row).

Aggregation (``trainer.loss_agg``, :data:`AGGREGATIONS`) is exact across micro-batches and
ranks: every term is a sum over this micro-batch's rows divided by a count of the whole
minibatch (all micro-batches, all ranks), so the caller passes those counts (``normalizer`` =
masked tokens, ``sequences`` = sequences) and sums the returned losses (gradient accumulation)
instead of averaging them. A row's own token count is local to the row, so the per-sequence
mean needs no collective either.

Corrections (``behaviour`` = logprobs of the engine that sampled the tokens; ``prox`` = the
trainer's logprobs before the batch's first optimizer step, computed once per batch):

* ``decoupled``: PPO clip of ``exp(logp - prox)`` against the proximal policy, each token
  weighted by the detached behaviour importance weight ``min(exp(prox - behaviour), is_cap)``.
  The clip bounds how far the minibatch updates of one batch move the policy; the weight
  corrects for the data being sampled by an older policy.
* ``tis``: truncated importance sampling, no PPO clip: ``-min(exp(logp.detach() - behaviour),
  is_cap) * A * logp``: the importance-weighted policy gradient with the weight truncated at
  ``is_cap``, recomputed against the current weights at every minibatch.
* ``none``: PPO clip of ``exp(logp - behaviour)``, no weighting: PPO without recomputation,
  the behaviour policy standing in for the proximal one. Its ratio is still an importance
  weight, so stale tokens are weighted, but the clip's trust region is centred on the sampler,
  not on the weights the batch starts from: a token the policy has moved past the clip since
  it was sampled gives no gradient, so staleness slows the update rather than biasing it.
* ``recompute``: PPO clip of ``exp(logp - prox)``, no weighting: the behaviour logprobs are
  ignored and every token is trained as if the proximal policy had sampled it, as a trainer that
  recomputes the old logprobs and applies no rollout correction does. Unbiased only when
  behaviour and proximal policies agree (staleness 0, no training-inference mismatch).

Tokens marked ``unlikelihood`` (a flat wrong group under ``trainer.flat_advantage=unlikelihood``)
have their advantage scaled before any of these: by ``p / (1 - p)`` of the current policy per
token (:func:`unlikelihood_weights`), or by ``P / (1 - P)``, ``P`` the whole answer's probability
(:func:`sequence_unlikelihood_weights`, ``trainer.unlikelihood_level=sequence``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from rlorch.config.schema import Correction, KlEstimator, LossAgg, UnlikelihoodLevel



def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Logprob of each token under the logits of the position before it; position 0 gets 0.

    ``logits``: ``[batch, seq, vocab]``, ``tokens``: ``[batch, seq]`` -> ``[batch, seq]``.
    Sampling at ``temperature`` draws from ``softmax(logits / temperature)``, the distribution
    the engines report behaviour logprobs of, so ratios compare like with like (0 = greedy,
    reported unscaled).
    """
    logits = logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    picked = torch.gather(logits, -1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    shifted = picked - torch.logsumexp(logits, dim=-1)
    return torch.nn.functional.pad(shifted, (1, 0), value=0.0)


def k3_kl(log_ratio: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(behaviour || trainer) from tokens the behaviour policy
    sampled, ``log_ratio = logp_trainer - logp_behaviour``: ``r - 1 - log r`` (>= 0, unbiased).

    The mirrored form ``1/r - 1 + log r`` estimates the other direction only from the trainer's
    own samples; on behaviour samples it grows like ``1/r``, so one token the trainer has moved
    away from (r = 1e-4) reads as a KL of 10^4.
    """
    return torch.exp(log_ratio) - 1.0 - log_ratio


def _k1(log_ratio):
    return log_ratio


def _k2(log_ratio):
    return 0.5 * log_ratio ** 2


def _k3(log_ratio):
    return torch.exp(-log_ratio) - 1.0 + log_ratio


REFERENCE_KL = {KlEstimator.k1: _k1, KlEstimator.k2: _k2, KlEstimator.k3: _k3}
"""Per-token estimators of KL(policy || reference) from tokens the policy sampled, of
``log_ratio = logp_policy - logp_reference`` (Schulman's k1, k2, k3): k1 is unbiased but
signed and noisy, k2 is >= 0 with a low bias, k3 (``r - 1 - log r``, ``r = reference /
policy``) is unbiased and >= 0. Gradients flow through the policy's logprobs only."""


def reference_kl(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KlEstimator = KlEstimator.k3) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate (``trainer.kl_estimator``); the reference's
    logprobs are detached (it is frozen)."""
    return REFERENCE_KL[KlEstimator(estimator)](logp - ref_logp.detach().to(logp.dtype))


@dataclass
class LossStats:
    """Sums over masked tokens, so micro-batches and ranks combine exactly (see :meth:`merge`)."""

    tokens: float = 0.0
    kl_sum: float = 0.0
    ratio_sum: float = 0.0
    ratio_max: float = 0.0
    clipped: float = 0.0
    capped: float = 0.0
    ref_kl_sum: float = 0.0
    """Summed KL-to-reference estimate (0 without a reference)."""

    def merge(self, other: "LossStats") -> "LossStats":
        return LossStats(tokens=self.tokens + other.tokens, kl_sum=self.kl_sum + other.kl_sum,
                         ratio_sum=self.ratio_sum + other.ratio_sum,
                         ratio_max=max(self.ratio_max, other.ratio_max),
                         clipped=self.clipped + other.clipped, capped=self.capped + other.capped,
                         ref_kl_sum=self.ref_kl_sum + other.ref_kl_sum)

    def as_tensor(self) -> torch.Tensor:
        """Summable fields (for an all-reduce SUM); ``ratio_max`` goes through a MAX reduce."""
        return torch.tensor([self.tokens, self.kl_sum, self.ratio_sum, self.clipped, self.capped,
                             self.ref_kl_sum], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, sums: torch.Tensor, ratio_max: float) -> "LossStats":
        tokens, kl_sum, ratio_sum, clipped, capped, ref_kl_sum = sums.tolist()
        return cls(tokens, kl_sum, ratio_sum, ratio_max, clipped, capped, ref_kl_sum)

    def summary(self) -> dict[str, float]:
        """Per-token means: ``kl`` approximates KL(behaviour || current) (k3 estimator),
        ``ratio_*`` describe exp(current - behaviour), ``clip_frac`` the tokens whose gradient
        the PPO clip removed, ``is_capped_frac`` the tokens whose weight hit ``is_cap``."""
        n = max(self.tokens, 1.0)
        return {"kl": self.kl_sum / n, "ratio_mean": self.ratio_sum / n, "ratio_max": self.ratio_max,
                "clip_frac": self.clipped / n, "is_capped_frac": self.capped / n}


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the sampling distribution that produced each token (aligned like
    :func:`token_logprobs`; position 0 gets 0)."""
    logits = logits[:, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.nn.functional.pad(entropy, (1, 0), value=0.0)


UNLIKELY_FLOOR = 1e-6
"""Smallest ``1 - p`` the unlikelihood weight divides by. Below it (a float32 softmax rounds
such a ``p`` to 1) the weight's gradient ``p (1 - p) / UNLIKELY_FLOOR`` on the logit stays under 1."""


def unlikelihood_weights(logp: torch.Tensor) -> torch.Tensor:
    """``p / (1 - p)`` per token (detached) from its logprob: an advantage of -1 scaled by it
    makes the policy-gradient step the gradient of ``-log(1 - p)``, whose size on the token's
    logit is ``p``: about 1 where the policy is sure of the token, where ``-1`` alone moves
    the logit by ``1 - p``."""
    logp = logp.detach()
    return torch.exp(logp) / torch.clamp(-torch.expm1(logp), min=UNLIKELY_FLOOR)


def sequence_unlikelihood_weights(logp: torch.Tensor, marked: torch.Tensor,
                                  segments: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``P / (1 - P)`` on each token (detached), ``P`` the probability of its whole sequence's
    ``marked`` tokens (``exp`` of their summed logprobs; a sequence is a row, or a ``segments``
    id): an advantage of -1 scaled by it makes the step the gradient of ``-log(1 - P)``, the
    unlikelihood of the answer, whose size on token ``t``'s logit is ``P (1 - p_t) / (1 - P)``.
    It lands on the tokens the policy is least sure of (a nearly right answer's wrong digit)
    and is spread evenly over an answer the policy is sure of throughout; at most 1 on a logit,
    as ``1 - p_t <= 1 - P``, and where the floor holds ``1 - P`` up, ``1 - p_t`` is below it."""
    logp = logp.detach()
    picked = torch.where(marked, logp, torch.zeros_like(logp))
    if segments is None:
        total = picked.sum(-1, keepdim=True).expand_as(logp)
    else:
        ids = segments.reshape(-1)
        count = int(ids.max()) + 1 if ids.numel() else 0
        total = picked.new_zeros(count).index_add(0, ids, picked.reshape(-1))[ids].reshape(logp.shape)
    return torch.exp(total) / torch.clamp(-torch.expm1(total), min=UNLIKELY_FLOOR)


def _ppo_term(log_ratio: torch.Tensor, adv: torch.Tensor, clip: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate (to minimise) and where the clip took the gradient away;
    ``clip`` = (low, high): the ratio is clamped to [1 - low, 1 + high]."""
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip[0], 1.0 + clip[1]) * adv
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).detach()


def _decoupled(logp, behaviour, prox, adv, clip, is_cap):
    if prox is None:
        raise ValueError("decoupled correction needs the proximal logprobs (prox)")
    per_token, clipped = _ppo_term(logp - prox, adv, clip)
    raw = torch.exp(prox - behaviour)
    return per_token * torch.clamp(raw, max=is_cap), clipped, raw > is_cap


def _tis(logp, behaviour, prox, adv, clip, is_cap):
    raw = torch.exp(logp.detach() - behaviour)
    return -torch.clamp(raw, max=is_cap) * adv * logp, torch.zeros_like(raw, dtype=torch.bool), raw > is_cap


def _uncorrected(logp, behaviour, prox, adv, clip, is_cap):
    per_token, clipped = _ppo_term(logp - behaviour, adv, clip)
    return per_token, clipped, torch.zeros_like(clipped)


def _recomputed(logp, behaviour, prox, adv, clip, is_cap):
    if prox is None:
        raise ValueError("recompute correction needs the proximal logprobs (prox)")
    return _uncorrected(logp, prox, None, adv, clip, is_cap)    # none's loss, clipped around prox


LOSSES = {Correction.decoupled: _decoupled, Correction.tis: _tis, Correction.none: _uncorrected,
          Correction.recompute: _recomputed}
"""One per-token loss per correction: ``(logp, behaviour, prox, adv, (clip low, clip high), is_cap) ->
(loss to minimise, where the PPO clip removed the gradient, where the IS weight hit its cap)``.
Only ``decoupled`` and ``recompute`` read ``prox``."""


def _token_mean(per_token, mask, tokens, sequences, segments):
    return (per_token * mask).sum() / tokens


def _seq_mean_token_sum(per_token, mask, tokens, sequences, segments):
    return (per_token * mask).sum() / sequences


def _seq_mean_token_mean(per_token, mask, tokens, sequences, segments):
    if segments is None:
        # A row without trained tokens (filler for a rank short of data) adds 0, not 0/0.
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / sequences
    count = int(segments.max()) + 1 if segments.numel() else 0
    ids = segments.reshape(-1)
    sums = per_token.new_zeros(count).index_add(0, ids, (per_token * mask).reshape(-1))
    lengths = mask.new_zeros(count).index_add(0, ids, mask.reshape(-1))
    return (sums / lengths.clamp(min=1.0)).sum() / sequences


AGGREGATIONS = {LossAgg.token_mean: _token_mean, LossAgg.seq_mean_token_sum: _seq_mean_token_sum,
                LossAgg.seq_mean_token_mean: _seq_mean_token_mean}
"""One aggregation per ``trainer.loss_agg``: ``(per_token [b, s], mask [b, s], tokens, sequences,
segments [b, s] or None) -> scalar``, where ``tokens`` and ``sequences`` count the whole minibatch:

* ``token_mean``: sum over every masked token / the minibatch's masked tokens (DAPO);
* ``seq_mean_token_sum``: the same sum / the minibatch's sequences (Dr. GRPO: a normaliser that
  does not depend on lengths, so long answers are not down-weighted per token);
* ``seq_mean_token_mean``: each sequence's mean over its own tokens, summed / the minibatch's
  sequences (GRPO as first published: every sequence weighs the same, whatever its length)."""


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: LossAgg = LossAgg.token_mean, *,
              tokens: Optional[float] = None, sequences: Optional[float] = None,
              segments: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``per_token`` over ``mask`` aggregated per ``agg``; the counts default to this
    micro-batch's (masked tokens, rows); ``segments`` says which sequence each position is
    (default: one a row)."""
    mask = mask.to(per_token.dtype)
    tokens = float(tokens) if tokens is not None else max(mask.sum().item(), 1.0)
    sequences = float(sequences) if sequences is not None else max(float(mask.shape[0]), 1.0)
    return AGGREGATIONS[LossAgg(agg)](per_token, mask, tokens, sequences, segments)


def policy_loss(logp: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor,
                advantages: torch.Tensor, *, correction: Correction, clip_eps: float, is_cap: float,
                prox: Optional[torch.Tensor] = None, normalizer: Optional[float] = None,
                agg: LossAgg = LossAgg.token_mean, sequences: Optional[float] = None,
                segments: Optional[torch.Tensor] = None,
                clip_high: Optional[float] = None,
                unlikelihood: Optional[torch.Tensor] = None,
                unlikelihood_scale: float = 1.0,
                unlikelihood_level: UnlikelihoodLevel = UnlikelihoodLevel.token) -> tuple[torch.Tensor, LossStats]:
    """The loss of one micro-batch (its share of the minibatch's ``agg``) and its stats.

    ``prox`` is required for ``decoupled`` and ``recompute`` (no gradient flows through it). ``normalizer`` (the
    minibatch's masked tokens) and ``sequences`` (its sequences) default to this micro-batch's.
    The PPO clip keeps the ratio within [1 - clip_eps, 1 + clip_high] (``clip_high`` None:
    clip_eps, symmetric). ``unlikelihood`` (``[rows, seq]`` bool) marks the tokens whose
    advantage is scaled by :func:`unlikelihood_weights` of ``logp`` (``unlikelihood_level``
    token) or :func:`sequence_unlikelihood_weights` over the marked tokens in ``mask`` (sequence),
    times ``unlikelihood_scale``.
    """
    mask = mask.to(logp.dtype)
    behaviour = behaviour.to(logp.dtype)
    adv = advantages.to(logp.dtype)
    adv = adv.unsqueeze(-1).expand_as(logp) if adv.dim() == 1 else adv
    if unlikelihood is not None and bool(unlikelihood.any()):
        if UnlikelihoodLevel(unlikelihood_level) is UnlikelihoodLevel.sequence:
            weights = sequence_unlikelihood_weights(logp, unlikelihood & (mask > 0), segments)
        else:
            weights = unlikelihood_weights(logp)
        adv = torch.where(unlikelihood, adv * (unlikelihood_scale * weights), adv)
    if prox is not None:
        prox = prox.detach().to(logp.dtype)
    per_token, clipped, capped = LOSSES[Correction(correction)](
        logp, behaviour, prox, adv, (clip_eps, clip_eps if clip_high is None else clip_high), is_cap)
    loss = aggregate(per_token, mask, agg, tokens=normalizer, sequences=sequences, segments=segments)
    return loss, _stats(logp.detach(), behaviour, mask, clipped, capped)


def loglinear_proximal(logp: torch.Tensor, behaviour: torch.Tensor, versions: torch.Tensor, *,
                       proximal_version: int, current_version: float) -> torch.Tensor:
    """An estimate of the proximal policy's logprobs without a forward pass over it (AReaL's
    log-linear approximation): each token's logprob is taken to move linearly in the policy
    version, from ``behaviour`` at the version that sampled it (``versions``) to ``logp`` (the
    weights being trained, ``current_version``, fractional between published versions), and is
    read at ``proximal_version``. A token sampled by the proximal weights keeps its behaviour
    logprob (exact up to the training-inference mismatch); one sampled ``a`` versions earlier
    gets ``a / (a + current_version - proximal_version)`` of the way to ``logp``. No gradient
    flows through the estimate."""
    version = versions.to(logp.dtype)
    span = current_version - version
    alpha = torch.where(span > 0, (proximal_version - version) / span.clamp(min=1e-6), torch.zeros_like(span))
    behaviour = behaviour.to(logp.dtype)
    return behaviour + alpha.clamp(0.0, 1.0) * (logp.detach() - behaviour)


@dataclass
class MismatchStats:
    """Training-inference mismatch over tokens the trainer's own weights generated (age 0):
    sums of the k3 estimate of KL(behaviour || trainer) and the largest |logprob difference|."""

    tokens: float = 0.0
    kl_sum: float = 0.0
    max_abs: float = 0.0

    def add(self, trainer_logp: torch.Tensor, behaviour: torch.Tensor, selected: torch.Tensor) -> None:
        if not bool(selected.any()):
            return
        log_ratio = (trainer_logp.double() - behaviour.double())[selected]
        self.tokens += float(selected.sum())
        self.kl_sum += float(k3_kl(log_ratio).sum())
        self.max_abs = max(self.max_abs, float(log_ratio.abs().max()))

    def summary(self) -> dict:
        """``mismatch_kl`` and ``mismatch_max`` (None when no token was generated at age 0)."""
        if not self.tokens:
            return {"mismatch_kl": None, "mismatch_max": None, "mismatch_tokens": 0}
        return {"mismatch_kl": self.kl_sum / self.tokens, "mismatch_max": self.max_abs,
                "mismatch_tokens": int(self.tokens)}


def _stats(logp: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor,
           clipped: torch.Tensor, capped: torch.Tensor) -> LossStats:
    log_ratio = (logp - behaviour) * mask
    ratio = torch.exp(log_ratio)
    on = mask > 0
    return LossStats(tokens=float(mask.sum()), kl_sum=float((k3_kl(log_ratio) * mask).sum()),
                     ratio_sum=float((ratio * mask).sum()),
                     ratio_max=float(ratio[on].max()) if on.any() else 0.0,
                     clipped=float((clipped & on).sum()), capped=float((capped & on).sum()))
