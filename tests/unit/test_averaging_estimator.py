"""The owner's reconstruction under i.i.d. chunk loss: unbiased, and the naive estimator is not (in-process)."""

import torch

from averaging_stats import mean_within_bound, owner_pull
from moshpeer.averaging.estimator import biased_estimate, estimate_over_sum

GROUP, VALUES, ROUNDS, LOSS = 4, 64, 1500, 0.1


def _simulate(estimator: str, seed: int = 0) -> list:
    """Per round: every member owns one part; each other member's contribution is lost with p=LOSS."""
    gen = torch.Generator().manual_seed(seed)
    pulls = []
    for _ in range(ROUNDS):
        x = torch.randn(GROUP, GROUP, VALUES, generator=gen) + torch.arange(GROUP).view(GROUP, 1, 1).float()
        exact = x.mean(0)  # [part, values]
        errors, offsets = [], []
        for owner in range(GROUP):
            arrived = torch.rand(GROUP, generator=gen) >= LOSS
            others = [i for i in range(GROUP) if i != owner]
            s = sum((x[i, owner] for i in others if arrived[i]), torch.zeros(VALUES))
            a = float(sum(1.0 for i in others if arrived[i]))
            own = x[owner, owner].clone()
            if estimator == "unbiased":
                est = estimate_over_sum(own, 1.0, s, a, float(len(others)))
            else:
                est = biased_estimate(own, 1.0, s, a)
            errors.append(float((est - exact[owner]).mean()))
            offsets.append(float((x[owner, owner] - exact[owner]).mean()))
        pulls.append(owner_pull(errors, offsets))
    return pulls


def test_unbiased_estimator_passes_bias_check():
    mean, bound = mean_within_bound(_simulate("unbiased"))
    assert mean <= bound, (mean, bound)


def test_biased_estimator_fails_the_same_check():
    mean, bound = mean_within_bound(_simulate("biased"))
    assert mean > bound, (mean, bound)


def test_exact_without_loss():
    own = torch.tensor([1.0, 2.0])
    others_sum = torch.tensor([2.0 * 3.0, 2.0 * 5.0])  # two others, weight 1 each, mean (3, 5)
    expected = (2.0 * own + others_sum) / 4.0
    est = estimate_over_sum(own, 2.0, others_sum, 2.0, 2.0)  # own weight 2; written over the sum
    assert est is others_sum and torch.allclose(est, expected)
    assert torch.equal(own, torch.tensor([1.0, 2.0]))  # our value untouched until the caller accepts the estimate


def test_nothing_arrived_keeps_own_value():
    own = torch.tensor([1.0, 2.0])
    est = estimate_over_sum(own, 1.0, torch.zeros(2), 0.0, 3.0)
    assert est is own and torch.equal(est, torch.tensor([1.0, 2.0]))
