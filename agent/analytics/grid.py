"""The DEBS 2015 Grand Challenge grid, as Spark column expressions (no Python UDF).

Definition (DEBS 2015 call): the point 41.474937, -74.913585 is the CENTRE of cell 1.1; cells are
500 m x 500 m; moving 500 m south changes the latitude by 0.004491556 degrees, moving 500 m east
changes the longitude by 0.005986 degrees; cell x.y is the x-th cell east and the y-th cell south,
1-based, 300 x 300 cells. (Some notes swap the two degree values; the ones here are the
challenge's and the physically right ones: 500 m of latitude is ~0.0045 degrees everywhere, 500 m
of longitude at 41 N is ~0.0060 degrees.)

Query 2 of the original challenge uses a 600 x 600 grid of 250 m cells; issue 7 asks for 500 m
cells for both queries, so both use this grid (documented in docs/spill.md).
"""

from __future__ import annotations

from typing import Tuple

ORIGIN_LAT = 41.474937
ORIGIN_LON = -74.913585
CELL_LAT = 0.004491556  # degrees per 500 m south
CELL_LON = 0.005986  # degrees per 500 m east
CELLS = 300


def cell_index(lat: float, lon: float) -> Tuple[int, int]:
    """Pure-Python reference (tests, small tools): 1-based (x, y), possibly outside 1..CELLS."""
    import math

    x = math.floor((lon - ORIGIN_LON) / CELL_LON + 0.5) + 1
    y = math.floor((ORIGIN_LAT - lat) / CELL_LAT + 0.5) + 1
    return x, y


def cell_columns(lat_col: str, lon_col: str) -> "Tuple[object, object]":
    """(x, y) integer Column expressions; floor, not truncation, so points just west/north of the
    grid get index 0 (outside) instead of being folded into cell 1."""
    from pyspark.sql import functions as F

    x = (F.floor((F.col(lon_col) - F.lit(ORIGIN_LON)) / F.lit(CELL_LON) + F.lit(0.5)) + 1).cast("int")
    y = (F.floor((F.lit(ORIGIN_LAT) - F.col(lat_col)) / F.lit(CELL_LAT) + F.lit(0.5)) + 1).cast("int")
    return x, y


def in_grid(x: object, y: object) -> object:
    from pyspark.sql import functions as F

    return F.coalesce(x.between(1, CELLS) & y.between(1, CELLS), F.lit(False))  # type: ignore[attr-defined]
