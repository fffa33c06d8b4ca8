"""Plain-text tables a person reads at a glance: aligned columns, numbers right-aligned, "-" for
unknown. No colours and no terminal width tricks, so that output pasted in an issue stays readable.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

__all__ = ["table", "fmt_num", "fmt_age"]


def fmt_num(v: Optional[float], digits: int = 1) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}"


def fmt_age(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.0f}s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _is_numeric(cell: str) -> bool:
    s = cell.replace(".", "", 1).replace("-", "", 1).replace("%", "").replace("/", "", 1)
    return s.isdigit()


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells: List[List[str]] = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_numeric(r[i]) or r[i] == "-" for r in cells[1:]) and len(cells) > 1 for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)
