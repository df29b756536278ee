"""repair.py's ranges: where each reducer's slice lies in the flat vector (the assumption the slice repair rests on,
checked against hivemind's own TensorPartContainer), and reading and writing a flat range across tensors as the
repair does it (state_parts.read_values / write_values)."""

from __future__ import annotations

import pytest
import torch
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import NoCompression

from p2p_diloco.state_parts import read_values, write_values
from p2p_diloco.swarm.repair import slice_ranges


@pytest.mark.parametrize("fractions", [[1.0, 1.0, 1.0], [3.0, 0.0, 1.0, 2.0], [1.0]])
def test_each_reducers_parts_are_its_slice_of_the_flat_vector(fractions):
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(*shape, generator=gen) for shape in ((30, 50), (6001,), (7, 11, 13))]
    container = TensorPartContainer(tensors, fractions, compression=NoCompression(), part_size_bytes=4096)
    shapes = [[part.shape for part, _ in parts] for parts in container._input_parts_by_peer]
    ranges = slice_ranges(shapes)
    assert sum(length for _, length in ranges) == sum(t.numel() for t in tensors)
    for k, (start, length) in enumerate(ranges):
        parts = [part for part, _ in container._input_parts_by_peer[k]]
        expected = torch.cat(parts) if parts else torch.empty(0)
        assert length == expected.numel()
        assert length == 0 or torch.equal(read_values(tensors, start, start + length), expected)


def test_a_range_across_tensors_is_read_and_written_in_place():
    tensors = [torch.arange(6.0).reshape(2, 3), torch.arange(10.0, 14.0), torch.arange(20.0, 22.0)]
    assert read_values(tensors, 4, 11).tolist() == [4.0, 5.0, 10.0, 11.0, 12.0, 13.0, 20.0]
    write_values(tensors, 5, -torch.ones(6))
    assert tensors[0].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, -1.0]]
    assert tensors[1].tolist() == [-1.0] * 4 and tensors[2].tolist() == [-1.0, 21.0]
