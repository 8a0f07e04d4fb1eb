"""The cross-check between two donors' states compares a sample of values drawn from a secret seed (issue 26):
a forgery that matches the values a fixed seed would compare, and differs everywhere else, is caught."""

from __future__ import annotations

import torch

from moshpeer.peer.state.validation import SAMPLE_VALUES, disagreeing_tensors


def _forgery_matching_the_sample_of(seed: int, honest: torch.Tensor) -> torch.Tensor:
    """94% of the matrix negated and tripled, the values a `seed` sample compares left as they are."""
    flat = honest.reshape(-1)
    compared = torch.randint(0, flat.numel(), (SAMPLE_VALUES,), generator=torch.Generator().manual_seed(seed))
    forged = flat * -3.0
    forged[compared] = flat[compared]
    return forged.reshape(honest.shape)


def test_a_forgery_built_for_a_known_sample_is_caught_by_a_secret_one():
    honest = {"w": torch.randn(256, 256, generator=torch.Generator().manual_seed(1))}
    forged = {"w": _forgery_matching_the_sample_of(0, honest["w"])}
    assert disagreeing_tensors(honest, forged, seed=0) == []  # the attack on a predictable sample
    assert all(disagreeing_tensors(honest, forged) == ["w"] for _ in range(20))
    assert disagreeing_tensors(honest, {"w": honest["w"].clone()}) == []
