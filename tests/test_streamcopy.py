"""The CPU copies' streaming stores and maru's checksum (`maru._streamcopy`): rows land
bit-exactly at any alignment, size and stride, nothing around them is touched, and on
x86-64 the stores are the streaming ones (the build compiled them in); the sum is the
one its definition gives however its bytes are fed (copied or not, in any pieces), and
changes with any flipped bit, stripes out of order and trailing zeros."""

from __future__ import annotations

import platform

import numpy as np
import pytest
from maru._streamcopy import (
    STREAMING,
    SUM_STATE_BYTES,
    copy_rows,
    copy_rows_summing,
    sum_feed,
    sum_portable,
    sum_value,
)

ROW_BYTES = [0, 1, 15, 63, 64, 65, 200, 4096 + 7]


def address(array: np.ndarray, offset: int = 0) -> int:
    return array.ctypes.data + offset


@pytest.mark.parametrize("row_bytes", ROW_BYTES)
@pytest.mark.parametrize("misalign", [(0, 0), (1, 0), (0, 9), (33, 17)])
def test_rows_land_exactly_and_nothing_around_them_changes(
    row_bytes: int, misalign: tuple[int, int]
) -> None:
    rng = np.random.default_rng(row_bytes)
    rows, guard = 5, 64
    dst_skew, src_skew = misalign
    dst_stride, src_stride = row_bytes + 3 * guard, row_bytes + 11
    source = rng.integers(0, 256, rows * src_stride + src_skew + guard, dtype=np.uint8)
    target = rng.integers(0, 256, rows * dst_stride + dst_skew + guard, dtype=np.uint8)
    expected = target.copy()
    for row in range(rows):
        at, frm = dst_skew + row * dst_stride, src_skew + row * src_stride
        expected[at : at + row_bytes] = source[frm : frm + row_bytes]
    copy_rows(
        address(target, dst_skew),
        dst_stride,
        address(source, src_skew),
        src_stride,
        row_bytes,
        rows,
    )
    np.testing.assert_array_equal(target, expected)


def test_one_large_run_copies_like_memcpy() -> None:
    source = np.random.default_rng(1).integers(0, 256, 3 * 2**20 + 5, dtype=np.uint8)
    target = np.zeros_like(source)
    copy_rows(address(target), 0, address(source), 0, source.size, 1)
    np.testing.assert_array_equal(target, source)


def test_negative_sizes_are_refused_by_name() -> None:
    buffer = np.zeros(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="rows -1"):
        copy_rows(address(buffer), 0, address(buffer), 0, 8, -1)


def test_x86_64_builds_use_streaming_stores() -> None:
    """Elsewhere the copies are plain memcpy (still correct, as the tests above show)."""
    assert (platform.machine() in ("x86_64", "AMD64")) == STREAMING


# --- the checksum ------------------------------------------------------------------

MASK = (1 << 64) - 1
GOLDEN, SCRAMBLE_PRIME = 0x9E3779B97F4A7C15, 0x9E3779B1
SUM_LENGTHS = [0, 1, 8, 63, 64, 65, 1023, 1024, 1025, 4096 + 7, 3 * 1024 + 64 * 5]


def mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def sum_by_definition(data: bytes) -> int:
    """The sum as its C file defines it, in plain Python: per 64-byte stripe (the last
    padded with zeros) lane i adds word i^1 and lo*hi of word i xor GOLDEN*(p+1) (p the
    word's index in the data); every 16 stripes each lane is xorshifted and multiplied
    by a 32-bit prime; the length and the lanes are mixed at the end."""
    padded = data + bytes(-len(data) % 64)
    words = np.frombuffer(padded, dtype="<u8").tolist()
    lanes = [0] * 8
    for stripe in range(len(words) // 8):
        word = words[8 * stripe : 8 * stripe + 8]
        for i in range(8):
            x = word[i] ^ ((GOLDEN * (8 * stripe + i + 1)) & MASK)
            lanes[i] = (lanes[i] + (x & 0xFFFFFFFF) * (x >> 32) + word[i ^ 1]) & MASK
        if (stripe + 1) % 16 == 0:
            lanes = [((lane ^ (lane >> 47)) * SCRAMBLE_PRIME) & MASK for lane in lanes]
    value = mix((len(data) * GOLDEN) & MASK)
    for lane in lanes:
        value = mix(value ^ lane)
    return value


def sum_of(*pieces: bytes) -> int:
    state = bytearray(SUM_STATE_BYTES)
    for piece in pieces:
        sum_feed(state, piece)
    return sum_value(state)


def random_bytes(size: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("size", SUM_LENGTHS)
def test_the_sum_is_its_definition_fed_whole_or_in_pieces(size: int) -> None:
    data = random_bytes(size, size)
    expected = sum_by_definition(data)
    cuts = sorted(np.random.default_rng(size).integers(0, size + 1, 4).tolist())
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, size], strict=True)]
    assert sum_of(data) == expected
    assert sum_of(*pieces) == expected
    assert sum_portable(data) == expected


def test_reading_the_sum_leaves_it_running() -> None:
    data = random_bytes(200)
    state = bytearray(SUM_STATE_BYTES)
    sum_feed(state, data[:70])
    sum_value(state)
    sum_feed(state, data[70:])
    assert sum_value(state) == sum_by_definition(data)


def test_every_flipped_bit_changes_the_sum() -> None:
    data = bytearray(random_bytes(2048 + 24))
    original = sum_of(data)
    for bit in range(0, len(data) * 8, 13):
        data[bit // 8] ^= 1 << bit % 8
        assert sum_of(data) != original, f"bit {bit}"
        data[bit // 8] ^= 1 << bit % 8


@pytest.mark.parametrize("piece", [8, 64, 1024])
def test_pieces_that_trade_places_change_the_sum(piece: int) -> None:
    data = random_bytes(8 * 1024)
    swapped = data[piece : 2 * piece] + data[:piece] + data[2 * piece :]
    assert sum_of(swapped) != sum_of(data)


def test_trailing_zeros_and_zero_runs_change_the_sum() -> None:
    assert len({sum_of(bytes(n)) for n in range(0, 200)}) == 200
    data = random_bytes(100)
    assert sum_of(data) != sum_of(data + bytes(1))


@pytest.mark.parametrize("row_bytes", [0, 1, 64, 200, 4096, 4096 + 7])
@pytest.mark.parametrize("dst_skew", [0, 8])
@pytest.mark.parametrize("fed_before", [0, 64, 5])
def test_a_summing_copy_copies_exactly_and_sums_what_it_copied(
    row_bytes: int, dst_skew: int, fed_before: int
) -> None:
    """Also where the destination is not 64-byte aligned or the sum has a partial
    stripe pending (the copy's lines are then not the sum's stripes)."""
    rows, guard = 4, 64
    before = random_bytes(fed_before, 1)
    source = np.frombuffer(random_bytes(rows * row_bytes + guard, 2), dtype=np.uint8)
    dst_stride = row_bytes + 128
    target = np.zeros(rows * dst_stride + guard + 64 + dst_skew, dtype=np.uint8)
    skew = (-target.ctypes.data) % 64 + dst_skew
    expected = target.copy()
    for row in range(rows):
        at = skew + row * dst_stride
        expected[at : at + row_bytes] = source[row * row_bytes : (row + 1) * row_bytes]
    state = bytearray(SUM_STATE_BYTES)
    sum_feed(state, before)
    copy_rows_summing(state, address(target, skew), dst_stride, address(source), row_bytes, rows)
    np.testing.assert_array_equal(target, expected)
    assert sum_value(state) == sum_by_definition(before + source[: rows * row_bytes].tobytes())


def test_a_state_of_the_wrong_size_is_refused_with_both_sizes() -> None:
    with pytest.raises(ValueError, match=f"{SUM_STATE_BYTES} bytes, not 10"):
        sum_feed(bytearray(10), b"data")
