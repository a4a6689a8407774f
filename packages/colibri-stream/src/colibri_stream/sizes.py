"""Parsing and printing byte sizes: "600MB", "1.5GiB", "512 KiB", "1048576", and RAM budgets (a size, "auto",
or a share of the routed experts such as "25%").

Decimal units (KB, MB, GB, TB) are powers of 1000 and binary units (KiB, MiB, GiB, TiB) powers
of 1024, as in IEC 80000-13; a bare number is bytes. Units are case-insensitive ("mb" = "MB")
because nobody means millibits on a command line.
"""

from __future__ import annotations

import re

from .errors import SizeFormatError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
CACHE_LINE = 64
"""Bytes: where each part of an expert slot (cache/slab.py) or of the weights' huge-page arena
(io/huge_pages.py) starts."""


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to whole cache lines (CACHE_LINE)."""
    return -(-nbytes // CACHE_LINE) * CACHE_LINE


_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int | float) -> int:
    """Bytes in `value`: an int (bytes) or a string with an optional unit.

    >>> parse_size("600MB"), parse_size("1GiB"), parse_size("4096")
    (600000000, 1073741824, 4096)
    """
    if isinstance(value, bool):
        raise SizeFormatError(f"size {value!r}: expected a number of bytes or a string like '600MB'")
    if isinstance(value, (int, float)):
        if value < 0:
            raise SizeFormatError(f"size {value!r}: must not be negative")
        return int(value)
    match = _PATTERN.match(str(value))
    if not match:
        raise SizeFormatError(
            f"size {value!r}: expected a number with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise SizeFormatError(
            f"size {value!r}: unknown unit {unit!r} (use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    return int(float(number) * factor)


def parse_budget(ram_budget: str | int) -> int | str:
    """A RAM budget: bytes (`parse_size`), or "auto" (fit under this process's memory cap).

    >>> parse_budget("600MB"), parse_budget(" Auto ")
    (600000000, 'auto')
    """
    if isinstance(ram_budget, str) and ram_budget.strip().lower() == "auto":
        return "auto"
    return parse_size(ram_budget)


def budget_share(label: str) -> float | None:
    """The share of the routed experts that a budget like "25%" names (0.25); None for a size or "auto".

    >>> budget_share("25%"), budget_share("600MB")
    (0.25, None)

    Raises `SizeFormatError` for a percentage outside (0%, 100%].
    """
    text = str(label).strip()
    if not text.endswith("%"):
        return None
    try:
        share = float(text[:-1]) / 100
    except ValueError:
        share = float("nan")
    if not 0 < share <= 1:
        raise SizeFormatError(f"budget {label!r}: not a percentage in (0%, 100%]")
    return share


def format_size(n_bytes: int | float) -> str:
    """Human-readable decimal size, e.g. '600.0 MB', '1.25 GB', '36.9 KB'."""
    if n_bytes >= 1e9:
        return f"{n_bytes / 1e9:.2f} GB"
    if n_bytes >= 1e6:
        return f"{n_bytes / 1e6:.1f} MB"
    return f"{n_bytes / 1e3:.1f} KB"
