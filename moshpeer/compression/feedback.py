"""`ErrorFeedback`: what the averager needs of an error-feedback state around a sparsifier (EF21M for gradients,
compression/ef21m.py; SparseLoCo's residual feedback for DiLoCo, compression/residual_feedback.py)."""

from __future__ import annotations

from typing import Any, Dict, Protocol, Tuple

import torch

from moshpeer.compression.arc_topk import DenseAllReduce


class ErrorFeedback(Protocol):
    kind: str  # "ef21m" or "residual": a state of one kind never loads into the other
    state_tensors: Tuple[str, ...]  # the state's tensors, zeroed for a fresh state
    numel: int  # values per round: every round averages all of them
    shared: bool  # whether a newcomer adopts a donor's state (else it starts afresh)

    async def step(self, flat: torch.Tensor, seed: int, dense_allreduce: DenseAllReduce) -> torch.Tensor:
        """Fold `flat` in, all-reduce with the group (every member with the same `seed`), return what the caller
        applies."""

    def commit(self) -> bool:
        """The caller applied what the last `step` returned (the optimizer took the round); False if there was
        nothing to commit. A state that updates itself in `step` (EF21M) commits nothing."""

    def state_dict(self) -> Dict[str, Any]: ...

    def check_state(self, state: Any) -> None:
        """Raise ValueError unless `state` fits this state."""

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """UserError, with nothing changed, unless `state` fits."""
