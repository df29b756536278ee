"""The wire codecs (p2p_diloco/codec.py): exact sizes, error bounds, determinism, refusal of bad bytes."""

from __future__ import annotations

import math

import pytest
import torch

from p2p_diloco.codec import BLOCK, CODECS, INT4_BLOCK, Codec, CodecError, get_codec, roundtrip_parts
from p2p_diloco.swarm.butterfly import WireCodec


def _part(numel: int = 1000, seed: int = 0, scale: float = 1e-3) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("numel", [1, 2, 63, 64, 65, 127, 128, 129, 1000])
def test_the_encoding_has_exactly_the_stated_size_and_decodes_to_the_roundtrip(name, numel):
    codec = get_codec(name)
    part = _part(numel)
    data = codec.encode(part)
    assert len(data) == codec.encoded_size(numel)
    decoded = codec.decode(data, numel)
    assert decoded.dtype == torch.float32 and decoded.shape == (numel,)
    assert torch.equal(decoded, codec.roundtrip(part))
    assert torch.equal(codec.roundtrip(part), codec.roundtrip(part.clone()))  # deterministic: same bytes, same values


@pytest.mark.parametrize(
    ("name", "bound"),
    [("none", 0.0), ("fp16", 2.0**-11), ("bf16", 2.0**-8)],
)
def test_float_codecs_round_each_value_to_nearest(name, bound):
    """Relative to the value, where it is a normal number of the format; fp16's subnormals (below 2**-14, Δ values
    of 1e-5 are) have a fixed step of 2**-24 instead, so their error is up to 2**-25."""
    part = _part(10_000)
    err = (get_codec(name).roundtrip(part) - part).abs()
    floor = 2.0**-25 if name == "fp16" else 0.0
    assert bool((err <= bound * part.abs() + floor).all()), float((err / part.abs()).max())


@pytest.mark.parametrize(("name", "block", "levels"), [("int8", BLOCK, 127), ("int4", INT4_BLOCK, 7)])
def test_integer_codec_error_is_at_most_half_a_step_of_its_block(name, block, levels):
    # blocks of very different scales, and an odd tail (int4 packs two codes a byte)
    part = torch.cat([_part(block, 1, 1e-6), _part(block, 2, 1.0), _part(77, 3, 1e-2)])
    out = Codec(name).roundtrip(part)
    for start in range(0, part.numel(), block):
        chunk, got = part[start : start + block], out[start : start + block]
        step = float(chunk.abs().max()) / levels
        assert float((got - chunk).abs().max()) <= 0.5 * step * (1 + 1e-5)
        assert float((got - chunk).abs().max()) > 0  # it does quantize (a bound that holds for any codec is no test)
    assert float(out[:block].abs().max()) > 0  # a tiny block keeps its own scale, not the large block's
    assert float(out.abs().max()) == float(part.abs().max())  # a block's largest value is exact (its scale's code)


def test_int4_packs_the_low_nibble_first():
    data = Codec("int4").encode(torch.tensor([7.0, -7.0, 0.0]))
    assert data[:4] == torch.tensor([1.0]).numpy().tobytes()  # the block's scale: absmax / 7
    assert data[4:] == bytes([(7 + 8) | ((-7 + 8) << 4), (0 + 8) | ((0 + 8) << 4)])  # codes 7, -7 | 0, padding 0


def test_zeros_and_fp16_overflow_stay_finite():
    zeros = torch.zeros(300)
    for name in CODECS:
        assert torch.equal(get_codec(name).roundtrip(zeros), zeros)
    big = torch.tensor([1e6, -1e6, 3.0])
    assert torch.equal(Codec("fp16").roundtrip(big), torch.tensor([65504.0, -65504.0, 3.0]))


def test_bytes_that_are_no_encoding_are_refused():
    codec = Codec("int8")
    data = codec.encode(_part(200))
    with pytest.raises(CodecError, match="no int8 encoding of 200"):
        codec.decode(data[:-1], 200)
    with pytest.raises(CodecError, match="no int8 encoding"):
        codec.decode(data, 10**9)
    with pytest.raises(CodecError, match="unknown"):
        get_codec("zip")


def test_a_part_in_another_codec_is_refused_by_the_wire():
    sent = WireCodec(Codec("fp16")).compress(_part(64))
    with pytest.raises(CodecError, match="expected 'p2p_diloco/int8'"):
        WireCodec(Codec("int8")).extract(sent)
    assert torch.equal(WireCodec(Codec("fp16")).extract(sent), Codec("fp16").roundtrip(_part(64)))


def test_roundtrip_parts_cuts_each_tensor_as_the_swarm_does():
    """Blocks restart at each part, as the swarm's parts are encoded one by one: a part of 300 values holds blocks
    of 128, 128 and 44 values, the next part starts a block afresh."""
    tensor = torch.cat([_part(300, 4, 1.0), _part(300, 5, 1e-4)]).view(20, 30)
    out = roundtrip_parts([tensor], Codec("int8"), part_values=300)[0]
    flat = tensor.reshape(-1)
    expected = torch.cat([Codec("int8").roundtrip(flat[:300]), Codec("int8").roundtrip(flat[300:])])
    assert out.shape == tensor.shape and torch.equal(out.reshape(-1), expected)
    assert Codec("int8").parts_size(600, 300) == 2 * Codec("int8").encoded_size(300)  # the bytes those parts take
    assert Codec("int8").parts_size(601, 300) == 2 * Codec("int8").encoded_size(300) + Codec("int8").encoded_size(1)
    assert torch.equal(roundtrip_parts([tensor], Codec("none"), 300)[0], tensor)


def test_compressed_sizes_per_value():
    numel = 1 << 20
    ratios = {name: get_codec(name).encoded_size(numel) / (4 * numel) for name in CODECS}
    assert ratios == {
        "none": 1.0,
        "fp16": 0.5,
        "bf16": 0.5,
        "int8": (1 + 4 / BLOCK) / 4,
        "int4": (0.5 + 4 / INT4_BLOCK) / 4,
    }
    assert math.isclose(get_codec("int8").bytes_per_value, 1 + 4 / BLOCK)
    assert math.isclose(get_codec("int4").bytes_per_value, 0.5 + 4 / INT4_BLOCK)
