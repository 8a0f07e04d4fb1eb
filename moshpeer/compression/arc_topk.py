"""ARC-Top-K: all-reduce compatible top-k sparsification (Chen et al., 2025). Spec `arc-topk:DENSITY[:ROW[:RANK]]`.

The flat vector is cut into rows of `row_len` values (the last row zero-padded). Every group member:

  1. sketches its rows with a random projection V (row_len x rank, entries +-1/sqrt(rank)) drawn from the seed the
     whole group shares (derived from the group id and round), P_i = X_i V;
  2. all-reduces (averages) the sketch: P = mean_i P_i = (mean_i X_i) V, the sketch of the averaged vector;
  3. selects the k = ceil(density * rows) rows with the largest ||P_j||^2 (ties to the lower row index), the
     same set S on every member because P is the same everywhere;
  4. all-reduces only the rows in S: no indices travel.

Traffic per member: rows * rank + k * row_len values instead of rows * row_len, i.e. a fraction
rank / row_len + density of the dense vector (2.6% for the defaults row_len=256, rank=4, density 0.01).

`topk-int2:DENSITY[:ROW[:RANK]]` (and `topk-int4`, `topk-int8`) is the same selection with low-bit values, the
SparseLoCo recipe of top-k plus 2-bit values under error feedback: the sketch travels as int8, the selected rows
as int2 (ternary codes, one float32 scale per 128 values), and no index at all (every member selects the same
rows from the averaged sketch). Under EF21M a member's contribution is counted as the rows after the codec's
round trip, so the rounding error stays in its error-feedback residual and is sent in later rounds.

The averager calls `ArcTopK.allreduce` with a `dense_allreduce` callback that averages a flat float32 tensor
over the group and returns the same result on every member (a member whose result differs, e.g. after a lost
chunk, may select different rows; that member's selection is then mixed with its neighbours').
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

import torch

from moshpeer.compression.codec import Compression, NoCompression, register
from moshpeer.compression.kernels.reference import MASK32, hash32, rng_key
from moshpeer.errors import UserError

DEFAULT_ROW_LEN = 256
DEFAULT_RANK = 4
_PROJECTION_SALT = 0x5BD1E995  # keeps projection bits apart from stochastic-rounding bits drawn from the same seed

# Averages a flat float32 tensor over the group; called with a second argument, the `Compression` to send it with,
# for the selected rows of a sparsifier with `rows_compression` (else the round's own codecs).
DenseAllReduce = Callable[..., Awaitable[torch.Tensor]]


def projection(row_len: int, rank: int, seed: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """The shared random projection V (row_len x rank), entries +-1/sqrt(rank) from a counter-based hash.

    Integer hashing makes V bit-identical on every machine, device and torch version (unlike torch.randn).
    E ||v V||^2 = ||v||^2 for any row v.
    """
    key = (rng_key(seed) ^ _PROJECTION_SALT) & MASK32
    # Drawn where it is used (integer hashing and one float32 division: the same bits on every device).
    index = torch.arange(row_len * rank, dtype=torch.int64, device=device)
    sign_bit = hash32(index ^ key) >> 31
    signs = (1 - 2 * sign_bit).to(torch.float32) / math.sqrt(rank)
    return signs.view(row_len, rank)


def to_rows(flat: torch.Tensor, row_len: int) -> torch.Tensor:
    """View (or, when the length is not a multiple of row_len, zero-padded copy) of `flat` as rows."""
    flat = flat.reshape(-1)
    pad = -flat.numel() % row_len
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, row_len)


def sketch(rows: torch.Tensor, seed: int, rank: int) -> torch.Tensor:
    """P = rows @ V: (num_rows x rank) float32."""
    v = projection(rows.shape[1], rank, seed, device=rows.device)
    return rows.to(torch.float32) @ v


def select(avg_sketch: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (ascending) of the k rows with the largest sketch norm; ties go to the lower row index.

    The squared norms are summed column by column in float64 (fixed order, exact squares), so every member and
    device computes the same bits from the same averaged sketch and hence the same selection.
    """
    if avg_sketch.dim() != 2:
        raise ValueError("the sketch must be a 2-D (rows x rank) tensor")
    if not bool(torch.isfinite(avg_sketch).all()):
        raise ValueError("non-finite values in the averaged sketch")
    rows = avg_sketch.shape[0]
    k = min(max(int(k), 0), rows)
    sketch64 = avg_sketch.to(torch.float64)
    norms = torch.zeros(rows, dtype=torch.float64, device=avg_sketch.device)
    for column in range(sketch64.shape[1]):
        norms = norms + sketch64[:, column] * sketch64[:, column]
    order = torch.sort(norms, descending=True, stable=True).indices
    return torch.sort(order[:k]).values


def select_by_norm(rows: torch.Tensor, k: int) -> torch.Tensor:
    """The k rows of largest exact norm (what the sketch estimates); the deterministic top-k baseline."""
    return select(rows, k)


def gather(rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The selected rows, (k x row_len)."""
    return rows.index_select(0, idx)


def scatter(values: torch.Tensor, idx: torch.Tensor, num_rows: int, numel: int) -> torch.Tensor:
    """A flat vector of `numel` values: `values` in rows `idx`, zeros elsewhere."""
    rows = torch.zeros(num_rows, values.shape[1], dtype=values.dtype, device=values.device)
    rows.index_copy_(0, idx, values)
    return rows.view(-1)[:numel]


@dataclass
class ArcTopKResult:
    """The compressed group average (zeros outside the selected rows) and the selected row indices."""

    average: torch.Tensor
    rows: torch.Tensor
    row_len: int


class ArcTopK:
    """The `Compression.sparsifier` of `arc-topk:DENSITY[:ROW[:RANK]]`; see the module docstring."""

    def __init__(self, density: float, row_len: int = DEFAULT_ROW_LEN, rank: int = DEFAULT_RANK,
                 rows_compression: Optional[Compression] = None):
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density}")
        if row_len < 1 or rank < 1:
            raise ValueError("row length and rank must be positive")
        self.density = float(density)
        self.row_len = int(row_len)
        self.rank = int(rank)
        self.rows_compression = rows_compression  # the selected rows' codecs (None: the round's, float32)

    def __repr__(self) -> str:
        rows = f", rows={self.rows_compression.name}" if self.rows_compression is not None else ""
        return f"ArcTopK(density={self.density}, row_len={self.row_len}, rank={self.rank}{rows})"

    def num_rows(self, numel: int) -> int:
        return -(-numel // self.row_len)

    def num_selected(self, numel: int) -> int:
        rows = self.num_rows(numel)
        return min(rows, max(1, math.ceil(self.density * rows))) if rows else 0

    def wire_values(self, numel: int) -> int:
        """float32 values each member contributes to the two all-reduces (sketch + selected rows)."""
        return self.num_rows(numel) * self.rank + self.num_selected(numel) * self.row_len

    def mask(self, flat: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """C_S(flat): `flat` in the selected rows, zeros elsewhere (a member's own compressed vector)."""
        table = to_rows(flat, self.row_len)
        return scatter(gather(table, rows), rows, table.shape[0], flat.numel())

    def contribution(self, flat: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """What the group receives of `flat` in the selected rows: C_S(flat) after the rows codec's round trip
        (its quantization blocks counted from the first selected value; the data plane's start at each chunk,
        which changes the rounding of a block that straddles a chunk edge, not what error feedback keeps)."""
        table = to_rows(flat, self.row_len)
        values = gather(table, rows)
        codec = self.rows_compression.reduce_codec if self.rows_compression is not None else None
        if codec is not None and not isinstance(codec, NoCompression) and values.numel():
            flat_values = values.reshape(-1).to(torch.float32).contiguous()
            decoded = torch.empty_like(flat_values)
            codec.decode_into(codec.encode(flat_values), decoded)
            values = decoded.view_as(values)
        return scatter(values, rows, table.shape[0], flat.numel())

    async def allreduce(self, flat: torch.Tensor, seed: int, dense_allreduce: DenseAllReduce) -> torch.Tensor:
        """The group's compressed average of `flat` (zeros outside the selected rows).

        `seed` must be the same on every member of the group (derive it from the group id and round);
        `dense_allreduce(t)` must return the group mean of the flat float32 tensor `t`, identical on every member.
        It is called twice: on the sketch (rows x rank values), then on the selected rows (k x row_len values).
        """
        return (await self.allreduce_selected(flat, seed, dense_allreduce)).average

    async def allreduce_selected(self, flat: torch.Tensor, seed: int,
                                 dense_allreduce: DenseAllReduce) -> ArcTopKResult:
        """Like `allreduce`, and also returns the selected rows (needed for error feedback)."""
        flat = flat.reshape(-1)
        numel = flat.numel()
        table = to_rows(flat.to(torch.float32), self.row_len)
        num_rows = table.shape[0]
        local_sketch = sketch(table, seed, self.rank)
        avg_sketch = await dense_allreduce(local_sketch.reshape(-1))
        if avg_sketch.numel() != num_rows * self.rank:
            raise ValueError(f"dense_allreduce returned {avg_sketch.numel()} values for a {num_rows}x{self.rank} sketch")
        idx = select(avg_sketch.reshape(num_rows, self.rank).to(table.device), self.num_selected(numel))
        selected = gather(table, idx).reshape(-1)
        avg_rows = await (dense_allreduce(selected, self.rows_compression) if self.rows_compression is not None
                          else dense_allreduce(selected))
        if avg_rows.numel() != idx.numel() * self.row_len:
            raise ValueError(f"dense_allreduce returned {avg_rows.numel()} values for {idx.numel()} rows")
        average = scatter(avg_rows.reshape(-1, self.row_len).to(table.device, torch.float32), idx, num_rows, numel)
        return ArcTopKResult(average, idx, self.row_len)

    async def allreduce_inplace(self, flat: torch.Tensor, seed: int, dense_allreduce: DenseAllReduce) -> ArcTopKResult:
        """Replace the selected rows of `flat` (contiguous) by their group average; leave the other rows as they are.

        For averaging values that must not be zeroed (parameters); `allreduce` returns the compressed average with
        zeros outside the selected rows (for gradients and EF21M differences).
        """
        result = await self.allreduce_selected(flat, seed, dense_allreduce)
        view = flat.view(-1)
        full_rows = view.numel() // self.row_len
        idx = result.rows.to(view.device)
        whole = idx[idx < full_rows]
        if whole.numel():  # one indexed copy for all complete rows (k can be tens of thousands)
            table = view[: full_rows * self.row_len].view(full_rows, self.row_len)
            source = result.average[: full_rows * self.row_len].view(full_rows, self.row_len)
            table.index_copy_(0, whole, source.index_select(0, whole).to(table.dtype))
        if whole.numel() != idx.numel():  # the zero-padded last row is selected: copy its real part
            start = full_rows * self.row_len
            view[start:].copy_(result.average[start:])
        return result


def _factory(arg: Optional[str]) -> Compression:
    if not arg:
        raise UserError("arc-topk needs a density, e.g. arc-topk:0.01")
    parts = arg.split(":")
    if len(parts) > 3:
        raise UserError(f"arc-topk:{arg}: expected arc-topk:DENSITY[:ROW_LEN[:RANK]]")
    try:
        density = float(parts[0])
        row_len = int(parts[1]) if len(parts) > 1 else DEFAULT_ROW_LEN
        rank = int(parts[2]) if len(parts) > 2 else DEFAULT_RANK
        sparsifier = ArcTopK(density, row_len, rank)
    except ValueError as e:
        raise UserError(f"arc-topk:{arg}: {e}") from None
    dense = NoCompression()  # the sketch and the selected rows are small: sent as float32
    return Compression(f"arc-topk:{arg}", dense, dense, sparsifier)


register("arc-topk", _factory)


def _lowbit_factory(bits: int):
    """`topk-intB:DENSITY[:ROW_LEN[:RANK]]`: ARC-Top-K rows as B-bit codes, the sketch as int8 (module docstring)."""
    name = f"topk-int{bits}"

    def factory(arg: Optional[str]) -> Compression:
        from moshpeer.compression.quantization import BlockQuantizer

        if not arg:
            raise UserError(f"{name} needs a density, e.g. {name}:0.0156")
        parts = arg.split(":")
        if len(parts) > 3:
            raise UserError(f"{name}:{arg}: expected {name}:DENSITY[:ROW_LEN[:RANK]]")
        try:
            values = BlockQuantizer(bits)
            rows = Compression(values.name, values, values)
            sparsifier = ArcTopK(float(parts[0]), int(parts[1]) if len(parts) > 1 else DEFAULT_ROW_LEN,
                                 int(parts[2]) if len(parts) > 2 else DEFAULT_RANK, rows_compression=rows)
        except ValueError as e:
            raise UserError(f"{name}:{arg}: {e}") from None
        sketch = BlockQuantizer(8)
        return Compression(f"{name}:{arg}", sketch, sketch, sparsifier)

    return factory


for _bits in (2, 4, 8):
    register(f"topk-int{_bits}", _lowbit_factory(_bits))
