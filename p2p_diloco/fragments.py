"""Streaming fragments (``swarm.fragments`` F): which of the model's tensors a round exchanges (pure, no torch).

Inputs:  the model's tensor sizes, in parameter order, and F; a round (the outer state's ``round``: the outer steps
         applied before it).
Output:  ``Fragments.of(sizes, F)``: each tensor's fragment, the tensors dealt largest first to the fragment with the
         fewest values so far (ties: the lower fragment, then the earlier tensor), so the fragments hold about equal
         values and every peer deals them alike; ``active(round)``: per tensor, whether round ``round`` exchanges it
         (fragment ``round mod F``).
State:   none beyond the assignment.
Failure: ValueError when F < 1 or the model has fewer tensors than F (a fragment would be empty).

As in Streaming DiLoCo (arXiv 2501.18512), each round's exchange carries one fragment: its Δ is measured from the
anchor it was last synchronised at, so it spans the F rounds since, and the peak bytes of a round fall by F while the
bytes per F rounds stay those of one whole-model exchange. The other tensors send zeros (codec.py writes an all-zero
part as no bytes) and their outer state does not move that round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Fragments"]


@dataclass(frozen=True)
class Fragments:
    count: int
    of_tensor: tuple[int, ...]  # per tensor, its fragment

    @classmethod
    def of(cls, sizes: Sequence[int], count: int) -> Fragments:
        if count < 1:
            raise ValueError(f"swarm.fragments {count} is invalid: must be >= 1")
        if count > len(sizes):
            raise ValueError(f"swarm.fragments {count} is more than the model's {len(sizes)} tensors")
        load = [0] * count
        of_tensor = [0] * len(sizes)
        for index in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
            fragment = min(range(count), key=lambda f: (load[f], f))
            of_tensor[index] = fragment
            load[fragment] += sizes[index]
        return cls(count, tuple(of_tensor))

    def active(self, round: int) -> list[bool]:
        """Per tensor: whether the round after ``round`` outer steps exchanges it."""
        return [f == round % self.count for f in self.of_tensor]

    def sizes(self, sizes: Sequence[int]) -> list[int]:
        """Values per fragment."""
        out = [0] * self.count
        for fragment, size in zip(self.of_tensor, sizes, strict=True):
            out[fragment] += size
        return out
