"""The round's parts and who reduces them (swarm/combine.py), as hivemind's TensorPartContainer cuts them: every
member computes every group's owners from the round alone, so the plan must match what the container does."""

from __future__ import annotations

import random

import pytest
import torch
from hivemind.averaging.load_balancing import hagenbach_bishoff
from hivemind.averaging.partition import TensorPartContainer

from p2p_diloco.swarm.combine import part_lengths, part_owners

SHAPES = [(40, 50), (3000,), (7, 11, 13), (1,), (1025,)]


@pytest.mark.parametrize("part_values", [1024, 1000, 64, 4096])
@pytest.mark.parametrize("seed", range(6))
def test_part_owners_are_the_containers_assignment(part_values, seed):
    rng = random.Random(seed)
    members = rng.randint(1, 9)
    scores = [rng.choice([0.0, 1.0, 1.0, 2.5]) for _ in range(members)]
    scores[rng.randrange(members)] = 1.0  # at least one reducer
    tensors = [torch.zeros(shape) for shape in SHAPES]
    total = sum(t.numel() for t in tensors)
    fractions = list(hagenbach_bishoff(total, scores))
    container = TensorPartContainer(tensors, fractions, part_size_bytes=4 * part_values)
    actual = [k for k, parts in enumerate(container._input_parts_by_peer) for _ in parts]
    lengths = part_lengths(SHAPES, part_values)
    assert lengths == [len(part) for parts in container._input_parts_by_peer for part, _ in parts]
    assert part_owners(lengths, fractions) == actual
