"""Line charts as PNG files with nothing but the standard library (``zlib``, ``struct``): axes, ticks,
grid lines, a legend, and text in a built-in 5x7 bitmap font (digits, capitals, a little punctuation;
lower case is drawn in capitals). Enough for the simulator's plots, no plotting dependency.
"""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

Color = tuple[int, int, int]
WHITE: Color = (255, 255, 255)
BLACK: Color = (0, 0, 0)
GRID: Color = (225, 225, 225)
# Distinct on white and to most colour-blind readers (matplotlib's "tab10").
PALETTE: tuple[Color, ...] = (
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
    (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207),
)  # fmt: skip

# Each glyph: 5 columns, left to right, as hex bytes; bit 0 is the top row of 7.
_FONT: dict[str, str] = {
    " ": "0000000000", "0": "3E5149453E", "1": "00427F4000", "2": "4261514946", "3": "2141454B31",
    "4": "1814127F10", "5": "2745454539", "6": "3C4A494930", "7": "0171090503", "8": "3649494936",
    "9": "064949291E", "A": "7E1111117E", "B": "7F49494936", "C": "3E41414122", "D": "7F4141221C",
    "E": "7F49494941", "F": "7F09090901", "G": "3E4149497A", "H": "7F0808087F", "I": "00417F4100",
    "J": "2040413F01", "K": "7F08142241", "L": "7F40404040", "M": "7F020C027F", "N": "7F0408107F",
    "O": "3E4141413E", "P": "7F09090906", "Q": "3E4151215E", "R": "7F09192946", "S": "4649494931",
    "T": "01017F0101", "U": "3F4040403F", "V": "1F2040201F", "W": "3F4038403F", "X": "6314081463",
    "Y": "0708700807", "Z": "6151494543", ".": "0060600000", ",": "0050300000", ":": "0036360000",
    "-": "0808080808", "+": "08083E0808", "=": "1414141414", "_": "4040404040", "/": "2010080402",
    "%": "2313086462", "(": "001C224100", ")": "0041221C00", "?": "0201510906", "@": "324979413E",
}  # fmt: skip
_GLYPHS = {ch: bytes.fromhex(cols) for ch, cols in _FONT.items()}
GLYPH_W, GLYPH_H = 5, 7


def text_width(text: str, scale: int = 1) -> int:
    """Pixels ``text`` takes across (a one-pixel gap between glyphs)."""
    return max(0, len(text) * (GLYPH_W + 1) - 1) * scale


class Canvas:
    """An RGB image to draw on, top-left origin."""

    def __init__(self, width: int, height: int, background: Color = WHITE) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def pixel(self, x: int, y: int, color: Color) -> None:
        """One pixel (off-canvas: nothing)."""
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i : i + 3] = bytes(color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """A filled rectangle, corners included, clipped to the canvas."""
        x0, x1 = max(0, min(x0, x1)), min(self.width - 1, max(x0, x1))
        y0, y1 = max(0, min(y0, y1)), min(self.height - 1, max(y0, y1))
        if x0 > x1:
            return
        run = bytes(color) * (x1 - x0 + 1)
        for y in range(y0, y1 + 1):
            i = 3 * (y * self.width + x0)
            self.pixels[i : i + len(run)] = run

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, thickness: int = 1) -> None:
        """A straight line (Bresenham), ``thickness`` pixels square at each step."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            self.rect(x0, y0, x0 + thickness - 1, y0 + thickness - 1, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, text: str, color: Color = BLACK, scale: int = 1) -> None:
        """``text`` with its top-left corner at (x, y)."""
        for ch in text.upper():
            glyph = _GLYPHS.get(ch, _GLYPHS["?"])
            for col, bits in enumerate(glyph):
                for row in range(GLYPH_H):
                    if bits >> row & 1:
                        px, py = x + col * scale, y + row * scale
                        self.rect(px, py, px + scale - 1, py + scale - 1, color)
            x += (GLYPH_W + 1) * scale

    def png(self) -> bytes:
        """The image as a PNG file: 8-bit RGB, no interlace, every row filter 0."""
        stride = 3 * self.width
        raw = b"".join(
            b"\x00" + bytes(self.pixels[y * stride : (y + 1) * stride]) for y in range(self.height)
        )
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + _chunk(b"IHDR", header)
            + _chunk(b"IDAT", zlib.compress(raw, 6))
            + _chunk(b"IEND", b"")
        )


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


def nice_ticks(low: float, high: float, most: int = 6) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) covering [low, high]."""
    if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
        raise ValueError(f"nice_ticks needs finite low < high, got {low}, {high}")
    raw = (high - low) / max(1, most - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(low / step + 1e-9)
    last = math.ceil(high / step - 1e-9)
    return [round(k * step, 12) for k in range(first, last + 1)]


def _label(value: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    return f"{value:.{decimals}f}"


@dataclass(frozen=True, slots=True)
class Series:
    """One line of a chart: a name for the legend and its (x, y) points."""

    name: str
    points: Sequence[tuple[float, float]]


def _span(values: list[float], low: float | None, high: float | None) -> tuple[float, float]:
    lo = low if low is not None else min(values, default=0.0)
    hi = high if high is not None else max(values, default=1.0)
    if hi <= lo:  # one value: a range around it
        pad = abs(lo) * 0.5 or 1.0
        lo, hi = (lo if low is not None else lo - pad), (hi if high is not None else hi + pad)
    return lo, hi


def line_chart(
    series: Sequence[Series],
    *,
    title: str,
    x_label: str,
    y_label: str,
    width: int = 800,
    height: int = 480,
    y_min: float | None = 0.0,
    y_max: float | None = None,
) -> bytes:
    """A PNG of ``series`` as lines with markers (a one-point series shows as its marker), each in
    the next ``PALETTE`` colour; the y axis starts at ``y_min`` and ends at ``y_max`` (None: the data's)."""
    xs = [x for s in series for x, _ in s.points]
    ys = [y for s in series for _, y in s.points]
    x_ticks = nice_ticks(*_span(xs, None, None))
    y_ticks = nice_ticks(*_span(ys, y_min, y_max))
    x_lo, x_hi, y_lo, y_hi = x_ticks[0], x_ticks[-1], y_ticks[0], y_ticks[-1]
    y_labels = [_label(v, y_ticks[1] - y_ticks[0]) for v in y_ticks]
    legend_w = 30 + max((text_width(s.name) for s in series), default=0)
    left, right = 16 + max(text_width(t) for t in y_labels), width - 20 - legend_w
    top, bottom = 50, height - 44
    if right - left < 50 or bottom - top < 50:
        raise ValueError(f"a {width}x{height} chart is too small for its labels and legend")

    def px(x: float) -> int:
        return left + round((x - x_lo) / (x_hi - x_lo) * (right - left))

    def py(y: float) -> int:
        return bottom - round((y - y_lo) / (y_hi - y_lo) * (bottom - top))

    c = Canvas(width, height)
    big = 2 if text_width(title, 2) <= width - 20 else 1
    c.text((width - text_width(title, big)) // 2, 12, title, scale=big)
    c.text(max(4, left - text_width(y_label) // 2), top - 16, y_label)
    for value, label in zip(y_ticks, y_labels, strict=True):
        y = py(value)
        c.line(left, y, right, y, GRID)
        c.line(left - 4, y, left - 1, y, BLACK)
        c.text(left - 7 - text_width(label), y - GLYPH_H // 2, label)
    x_step = x_ticks[1] - x_ticks[0]
    for value in x_ticks:
        x = px(value)
        c.line(x, bottom + 1, x, bottom + 4, BLACK)
        label = _label(value, x_step)
        c.text(x - text_width(label) // 2, bottom + 8, label)
    c.text((left + right - text_width(x_label)) // 2, bottom + 24, x_label)
    c.line(left, top, left, bottom, BLACK)
    c.line(left, bottom, right, bottom, BLACK)
    for i, s in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        points = [(px(x), py(y)) for x, y in sorted(s.points)]
        for (x0, y0), (x1, y1) in itertools.pairwise(points):
            c.line(x0, y0, x1, y1, color, thickness=2)
        for x, y in points:
            c.rect(x - 2, y - 2, x + 3, y + 3, color)
        ly = top + 4 + 16 * i
        c.rect(right + 16, ly, right + 27, ly + GLYPH_H - 1, color)
        c.text(right + 32, ly, s.name)
    return c.png()
