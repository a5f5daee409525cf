"""The simulator's PNG line charts: a valid PNG of the right size whose pixels show the data."""

from __future__ import annotations

import struct
import zlib

import pytest

from vllm_disagg.cluster_sim.plot import PALETTE, WHITE, Canvas, Series, line_chart, nice_ticks, text_width

SIGNATURE = b"\x89PNG\r\n\x1a\n"


def decode(png: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB bytes) of an 8-bit RGB PNG, checking every chunk's CRC."""
    assert png[:8] == SIGNATURE
    pos, chunks = 8, []
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos : pos + 4])
        tag, data = png[pos + 4 : pos + 8], png[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", png[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(tag + data), tag
        chunks.append((tag, data))
        pos += 12 + length
    tags = [t for t, _ in chunks]
    assert tags[0] == b"IHDR" and tags[-1] == b"IEND" and b"IDAT" in tags
    width, height, depth, color_type, *_ = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color_type) == (8, 2)
    raw = zlib.decompress(b"".join(d for t, d in chunks if t == b"IDAT"))
    stride = 1 + 3 * width
    assert len(raw) == height * stride
    rows = [raw[y * stride : (y + 1) * stride] for y in range(height)]
    assert {row[0] for row in rows} == {0}  # filter type None on every row
    return width, height, [row[1:] for row in rows]


def colours(rows: list[bytes]) -> dict[tuple[int, int, int], int]:
    counts: dict[tuple[int, int, int], int] = {}
    for row in rows:
        for i in range(0, len(row), 3):
            rgb = (row[i], row[i + 1], row[i + 2])
            counts[rgb] = counts.get(rgb, 0) + 1
    return counts


def chart(*series: Series) -> bytes:
    return line_chart(series, title="goodput vs rate", x_label="rate (req/s)", y_label="req/s")


A = Series("ours", [(1.0, 0.9), (2.0, 1.8), (4.0, 3.1)])
B = Series("round-robin", [(1.0, 0.9), (2.0, 1.2), (4.0, 1.0)])


def test_a_chart_is_a_valid_png_of_the_size_asked_for() -> None:
    width, height, rows = decode(line_chart([A], title="t", x_label="x", y_label="y", width=640, height=400))
    assert (width, height, len(rows)) == (640, 400, 400)
    counts = colours(rows)
    assert counts[WHITE] < 640 * 400  # something was drawn
    assert counts.get(PALETTE[0], 0) > 100  # the line, its markers and its legend swatch


def test_each_series_gets_its_own_colour_and_different_data_draws_different_pixels() -> None:
    one = decode(chart(A))[2]
    two = decode(chart(A, B))[2]
    assert PALETTE[1] not in colours(one) and colours(two)[PALETTE[1]] > 100
    other = decode(chart(Series("ours", [(1.0, 0.2), (2.0, 3.0), (4.0, 0.5)])))[2]
    assert other != one  # same name, axes and ticks: only the line can differ
    assert decode(chart(A))[2] == one  # and drawing is deterministic


def test_a_one_point_series_still_shows_its_marker() -> None:
    rows = decode(chart(Series("ours", [(3.0, 2.0)])))[2]
    assert colours(rows)[PALETTE[0]] >= 36  # a 6x6 marker, and the legend swatch


def test_a_chart_too_small_for_its_labels_is_refused() -> None:
    with pytest.raises(ValueError, match="too small"):
        line_chart([A], title="t", x_label="x", y_label="y", width=120, height=60)


@pytest.mark.parametrize(
    ("low", "high", "ticks"),
    [
        pytest.param(0.0, 9.3, [0, 2, 4, 6, 8, 10], id="rounds-up-to-a-step-of-2"),
        pytest.param(0.0, 1.0, [0, 0.2, 0.4, 0.6, 0.8, 1.0], id="fractions"),
        pytest.param(10.0, 37.0, [10, 20, 30, 40], id="from-a-nonzero-start"),
        pytest.param(2.0, 4.5, [2, 2.5, 3, 3.5, 4, 4.5], id="steps-of-half"),
        pytest.param(0.0, 370.0, [0, 100, 200, 300, 400], id="hundreds"),
    ],
)
def test_ticks_are_round_numbers_covering_the_range(low: float, high: float, ticks: list[float]) -> None:
    assert nice_ticks(low, high) == pytest.approx(ticks)


def test_ticks_need_a_range() -> None:
    with pytest.raises(ValueError):
        nice_ticks(1.0, 1.0)


def test_text_is_drawn_from_the_bitmap_font_in_capitals() -> None:
    def ink(text: str) -> bytes:
        c = Canvas(40, 9)
        c.text(1, 1, text)
        return bytes(c.pixels)

    blank = bytes(Canvas(40, 9).pixels)
    assert ink("0") != blank and ink("0") != ink("8")
    assert ink("ab") == ink("AB")
    assert ink("~") == ink("?")  # a character the font lacks shows as "?"
    assert text_width("abc") == 17 and text_width("abc", 2) == 34
