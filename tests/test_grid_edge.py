"""The edge's grid (agent.operators.builtin.cell_of, used by in_zone) and the batch job's pure
reference (agent.analytics.grid.cell_index) put every point in the same cell, borders included:
the DEBS queries computed at the edge and in Spark must agree on which trips are in the grid."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.analytics.grid import CELLS, cell_index
from agent.operators.builtin import GRID_ORIGIN, cell_of


def batch_cell(lat: float, lon: float):
    x, y = cell_index(lat, lon)
    return (x, y) if 1 <= x <= CELLS and 1 <= y <= CELLS else None


def test_the_band_west_and_north_of_cell_1_1_is_outside_on_both_sides() -> None:
    lat, lon = GRID_ORIGIN
    assert cell_of(lat, lon) == batch_cell(lat, lon) == (1, 1)
    west = lon - 0.005986 * 0.8  # 0.8 cells west of cell 1.1's centre: outside the grid
    north = lat + 0.004491556 * 0.8
    assert cell_of(lat, west) is None and batch_cell(lat, west) is None
    assert cell_of(north, lon) is None and batch_cell(north, lon) is None


@settings(max_examples=2000, deadline=None)
@given(st.floats(GRID_ORIGIN[0] - 1.5, GRID_ORIGIN[0] + 0.1), st.floats(GRID_ORIGIN[1] - 0.1, GRID_ORIGIN[1] + 1.9))
def test_edge_and_batch_agree_on_every_point(lat: float, lon: float) -> None:
    assert cell_of(lat, lon) == batch_cell(lat, lon)
