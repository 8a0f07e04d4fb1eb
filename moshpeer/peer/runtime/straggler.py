"""`StragglerDelay`: injected compute delay per micro-batch, a configuration of the real training loop that
tests and benchmarks use to make stragglers (`moshpeer join --straggler`). Bad settings raise `UserError`."""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable

from moshpeer.errors import UserError

_DISTRIBUTIONS = ("lognormal", "exponential", "constant")


@dataclass
class StragglerDelay:
    """Sleeps a random, heavy-tailed time per micro-batch: call it once inside each micro-batch.

    This is a configuration of the real loop (the peer really is slower), used by tests and
    benchmarks to make stragglers. `mean_s` is the mean delay whatever the distribution:
    lognormal draws exp(N(mu, sigma^2)) with mu = ln(mean_s) - sigma^2 / 2; `probability` < 1
    delays only that fraction of micro-batches (spikes).
    """

    distribution: str = "lognormal"
    mean_s: float = 0.05
    sigma: float = 1.0
    probability: float = 1.0
    seed: int = 0
    spike_s: float = 0.0  # one extra delay, at micro-batch `spike_at` (0-based): a peer that stalls once
    spike_at: int = -1
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)

    def __post_init__(self) -> None:
        if self.distribution not in _DISTRIBUTIONS:
            raise UserError(f"straggler distribution must be one of {_DISTRIBUTIONS}, got {self.distribution!r}")
        if not (self.mean_s >= 0 and self.sigma >= 0 and 0 <= self.probability <= 1 and self.spike_s >= 0):
            raise UserError("straggler delay needs mean_s >= 0, sigma >= 0, spike_s >= 0 and probability in [0, 1]")
        self._rng = random.Random(self.seed)
        self.total_s = 0.0
        self.calls = 0

    def sample(self) -> float:
        """Draw one delay in seconds without sleeping."""
        if self.mean_s == 0 or self._rng.random() >= self.probability:
            return 0.0
        if self.distribution == "constant":
            return self.mean_s
        if self.distribution == "exponential":
            return self._rng.expovariate(1.0 / self.mean_s)
        return self._rng.lognormvariate(math.log(self.mean_s) - self.sigma**2 / 2, self.sigma)

    def __call__(self) -> float:
        """Sleep one drawn delay (plus the spike, at its micro-batch); returns it."""
        delay = self.sample() + (self.spike_s if self.calls == self.spike_at else 0.0)
        self.calls += 1
        if delay > 0:
            self.sleep(delay)
        self.total_s += delay
        return delay


def parse_straggler(text: str) -> StragglerDelay:
    """Parse "lognormal:mean_s=0.05,sigma=1.0,seed=3" (the distribution alone is fine too);
    "constant:mean_s=1,spike_s=3,spike_at=7": 1 s per micro-batch, and 3 s more on the eighth."""
    distribution, _, options = text.strip().partition(":")
    kwargs: dict[str, float | int] = {}
    for item in filter(None, (part.strip() for part in options.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in ("mean_s", "sigma", "probability", "seed", "spike_s", "spike_at"):
            raise UserError(f"bad straggler option {item!r}; expected mean_s=, sigma=, probability=, seed=, "
                            f"spike_s= or spike_at=")
        try:
            kwargs[key] = int(value) if key in ("seed", "spike_at") else float(value)
        except ValueError:
            raise UserError(f"bad straggler option {item!r}: {value!r} is not a number") from None
    return StragglerDelay(distribution or "lognormal", **kwargs)  # type: ignore[arg-type]


__all__ = ["StragglerDelay", "parse_straggler"]
