"""`BlockTables.key_rows` (the key rows attention reads, derived on the device) against the table's own
host-side rule, position by position (`BlockTables.row`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loopserve.cache.block_table import BlockTables


@settings(deadline=None)  # (a machine busy with other tests)
@given(st.integers(1, 8), st.integers(1, 6), st.integers(1, 9), st.data())
def test_key_rows_are_each_positions_row(block_size, num_slots, columns, data):
    tables = BlockTables(num_slots, columns, block_size)
    for slot in range(num_slots):
        tables.set_blocks(slot, 0, data.draw(st.lists(st.integers(0, 500), min_size=columns, max_size=columns)))
    slots = data.draw(st.lists(st.integers(0, num_slots - 1), min_size=1, max_size=5))  # repeats too
    length = data.draw(st.integers(1, columns * block_size))
    got = tables.key_rows(torch.tensor(slots), length)
    want = [[tables.row(s, p) for p in range(length)] for s in slots]
    assert got.tolist() == want
    positions = data.draw(st.lists(st.integers(0, columns * block_size - 1), min_size=len(slots), max_size=len(slots)))
    batch = tables.rows(np.array(slots, np.int64), np.array(positions, np.int64))  # (the compiled pass)
    assert batch.tolist() == [tables.row(s, p) for s, p in zip(slots, positions, strict=True)]
    with pytest.raises(IndexError):  # a column past the table, as numpy's indexing raised
        tables.rows(np.array(slots[:1], np.int64), np.array([columns * block_size], np.int64))
    with pytest.raises(ValueError, match="positions"):
        tables.rows(np.array(slots, np.int64), np.array(positions + [0], np.int64))
    with pytest.raises(IndexError, match="key_rows"):
        tables.key_rows(torch.tensor(slots), columns * block_size + 1)


def test_key_rows_read_the_device_copy_after_growth():
    """Growing the table (more columns) keeps the rows already written."""
    tables = BlockTables(2, 2, 4)
    tables.set_blocks(1, 0, [7, 3])
    tables.set_blocks(1, 2, [9])  # a third column: the table grows
    assert tables.key_rows(torch.tensor([1]), 10).tolist() == [[28, 29, 30, 31, 12, 13, 14, 15, 36, 37]]
    assert np.array_equal(tables.host[1, :3], [7, 3, 9])
