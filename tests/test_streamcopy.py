"""The CPU copies' streaming stores (`maru._streamcopy`): rows land bit-exactly at any
alignment, size and stride, nothing around them is touched, and on x86-64 the stores
are the streaming ones (the build compiled them in)."""

from __future__ import annotations

import platform

import numpy as np
import pytest
from maru._streamcopy import STREAMING, copy_rows

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
