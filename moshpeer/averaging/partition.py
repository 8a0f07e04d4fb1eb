"""How a flat vector is split among a group: one contiguous part per member, each part in chunks."""

from __future__ import annotations

from typing import List, Tuple


class Partition:
    """Part j = [part_starts[j], part_starts[j+1]); chunk c of part j = `chunk_numel` values (the last shorter).

    Every member computes the same partition from (numel, group size, chunk_numel), so nothing about
    it travels on the wire; receivers check chunk indices and sizes against it.
    """

    def __init__(self, numel: int, group_size: int, chunk_numel: int):
        if numel < 0 or group_size < 1 or chunk_numel < 1:
            raise ValueError(f"bad partition numel={numel} group_size={group_size} chunk_numel={chunk_numel}")
        self.numel, self.group_size, self.chunk_numel = numel, group_size, chunk_numel
        base, extra = divmod(numel, group_size)
        starts = [0]
        for j in range(group_size):
            starts.append(starts[-1] + base + (1 if j < extra else 0))
        self.part_starts: List[int] = starts

    def part_range(self, part: int) -> Tuple[int, int]:
        return self.part_starts[part], self.part_starts[part + 1]

    def part_numel(self, part: int) -> int:
        return self.part_starts[part + 1] - self.part_starts[part]

    def num_chunks(self, part: int) -> int:
        return -(-self.part_numel(part) // self.chunk_numel)

    def chunk_range(self, part: int, chunk: int) -> Tuple[int, int]:
        """Absolute [start, end) of chunk `chunk` of part `part` in the flat vector."""
        start = self.part_starts[part] + chunk * self.chunk_numel
        return start, min(start + self.chunk_numel, self.part_starts[part + 1])
