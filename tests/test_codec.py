"""The wire codecs (p2p_diloco/codec.py): exact sizes, error bounds, determinism, refusal of bad bytes."""

from __future__ import annotations

import math

import pytest
import torch

from p2p_diloco.codec import (
    BLOCK,
    CODECS,
    DENSE,
    INT4_BLOCK,
    SPARSE,
    TOPK_CHUNK,
    Codec,
    CodecError,
    get_codec,
    roundtrip_parts,
)
from p2p_diloco.swarm.wire import WireCodec


def _part(numel: int = 1000, seed: int = 0, scale: float = 1e-3) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("name", [*CODECS, "sparse4"])
@pytest.mark.parametrize("numel", [1, 2, 63, 64, 65, 127, 128, 129, 250])
def test_the_encoding_has_exactly_the_stated_size_and_decodes_to_the_roundtrip(name, numel):
    codec = Codec(name)
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
    ratios = {name: get_codec(name).encoded_size(numel) / (4 * numel) for name in DENSE}
    assert ratios == {
        "none": 1.0,
        "fp16": 0.5,
        "bf16": 0.5,
        "int8": (1 + 4 / BLOCK) / 4,
        "int4": (0.5 + 4 / INT4_BLOCK) / 4,
    }
    assert math.isclose(get_codec("int8").bytes_per_value, 1 + 4 / BLOCK)
    assert math.isclose(get_codec("int4").bytes_per_value, 0.5 + 4 / INT4_BLOCK)


@pytest.mark.parametrize("name", list(SPARSE))
def test_top_k_sends_the_largest_magnitudes_with_their_signs_in_two_levels(name):
    """Each chunk of TOPK_CHUNK values (the last one shorter) keeps its own share: 5000 values are chunks of 4096 and
    904."""
    part = _part(5000, 7)
    out = Codec(name).roundtrip(part)
    density = SPARSE[name]
    sent = out.nonzero().view(-1)
    chunks = [(0, TOPK_CHUNK), (TOPK_CHUNK, 5000)]
    expected = set()
    for start, end in chunks:  # exactly each chunk's largest magnitudes
        top = part[start:end].abs().topk(math.ceil(density * (end - start))).indices + start
        expected |= set(top.tolist())
    assert sent.numel() == len(expected) == math.ceil(density * 4096) + math.ceil(density * 904)
    assert set(sent.tolist()) == expected
    assert torch.equal(out[sent].sign(), part[sent].sign())
    levels = sorted(set(out[sent].abs().tolist()))
    assert len(levels) == 2 and levels[0] < levels[1]  # 2 bits a value: a sign and one of two magnitudes
    low, high = levels
    magnitudes = part[sent].abs()
    assert low >= float(magnitudes.min()) and high <= float(magnitudes.max())  # means of the kept magnitudes
    nearer_high = (magnitudes - high).abs() < (magnitudes - low).abs()
    assert torch.equal(out[sent].abs() == high, nearer_high)  # each value gets the nearer magnitude


def test_top_k_positions_survive_gaps_of_255_and_more():
    """A gap of 255 or more is written with escape bytes: positions just before, at and after the byte's limit."""
    numel = 100_000
    at = [0, 254, 255, 509, 510, 1275, 1276, 99_999]
    part = torch.zeros(numel)
    part[at] = torch.tensor([1.0, -1.0] * 4)
    codec = Codec("topk1")  # 1000 values: the 8 above, the rest zeros that decode to 0
    out = codec.roundtrip(part)
    assert torch.equal(out, part)
    data = codec.encode(part)
    assert len(data) > codec.encoded_size(numel)  # zeros may sit anywhere: some gaps needed escapes
    mean = torch.zeros(numel)
    mean[at] = 1.0
    assert torch.equal(Codec("sparse4").roundtrip(mean), mean)
    gaps = [b - a - 1 for a, b in zip([-1, *at], at)]  # 0, 253, 0, 253, 0, 764, 0, 98722
    escapes = sum(gap // 255 for gap in gaps)
    assert escapes == 389 and len(Codec("sparse4").encode(mean)) == 4 + 4 + 4 + 8 + escapes  # count, scale, codes


def test_the_mean_of_top_k_parts_keeps_every_position_in_int4():
    parts = [Codec("topk3").roundtrip(_part(3000, seed)) for seed in range(4)]
    mean = torch.stack(parts).mean(0)
    data = Codec("topk3").mean.encode(mean)
    out = Codec("topk3").mean.roundtrip(mean)
    assert Codec("topk3").mean.name == "sparse4" and Codec("int8").mean == Codec("int8")
    union = mean != 0
    assert int.from_bytes(data[:4], "little") == int(union.sum()) > 90  # every position of the senders' supports
    assert not bool(out[~union].any())  # and nothing else
    for start in range(0, int(union.sum()), INT4_BLOCK):  # int4 over the nonzeros, block by block
        chunk = mean[union][start : start + INT4_BLOCK]
        got = out[union][start : start + INT4_BLOCK]
        assert float((got - chunk).abs().max()) <= 0.5 * float(chunk.abs().max()) / 7 * (1 + 1e-5)
    assert Codec("sparse4").encode(torch.zeros(10)) == b""  # as every codec writes a part of zeros


def test_sparse_bytes_that_are_no_encoding_are_refused():
    codec, numel = Codec("topk1"), 20_000
    data = codec.encode(_part(numel))
    assert torch.equal(codec.decode(data, numel), codec.roundtrip(_part(numel)))
    with pytest.raises(CodecError, match="no topk1 encoding"):
        codec.decode(data[:-1], numel)  # the last gap cut: one position short
    with pytest.raises(CodecError, match="no topk1 encoding"):
        codec.decode(data + bytes([255]), numel)  # an escape with no gap after it
    with pytest.raises(CodecError, match="no topk1 encoding"):
        codec.decode(data, 2 * numel)  # the count is not k of that many values
    last = _part(numel)
    last[-1] = 1.0  # the largest value, sent at the last position
    with pytest.raises(CodecError, match="past the part"):
        codec.decode(codec.encode(last), numel - 10)  # the same k of fewer values: the position is past them
    bad = bytearray(data)
    bad[4:8] = torch.tensor([float("nan")]).numpy().tobytes()
    with pytest.raises(CodecError, match="magnitudes"):
        codec.decode(bytes(bad), numel)
    mean = Codec("sparse4")
    with pytest.raises(CodecError, match="no sparse4 encoding"):
        mean.decode(mean.encode(_part(50))[:-2], 50)
    with pytest.raises(CodecError, match="no sparse4 encoding"):
        mean.decode(b"\x01", 50)


def test_a_sparse_wire_sends_parts_in_top_k_and_means_in_sparse4():
    wire = WireCodec(Codec("topk1"))
    assert wire.means.codec.name == "sparse4" and WireCodec(Codec("int8")).means.codec.name == "int8"
    mean = wire.means.compress(_part(500))
    with pytest.raises(CodecError, match="expected 'p2p_diloco/topk1'"):
        wire.extract(mean)  # a mean where a part belongs is refused
    assert torch.equal(wire.means.extract(mean), Codec("sparse4").roundtrip(_part(500)))


def test_roundtrip_parts_reports_each_tensors_bytes():
    tensor = _part(2500, 9).view(50, 50)
    for name in ("none", "int8", "topk3"):
        sizes: list[int] = []
        roundtrip_parts([tensor, tensor[:2]], Codec(name), 1000, sizes)
        flat = tensor.reshape(-1)
        expected = sum(len(Codec(name).encode(p)) for p in flat.split(1000)) if name != "none" else 10_000
        assert sizes[0] == expected and len(sizes) == 2
