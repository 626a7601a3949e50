"""Queue telemetry's storage, without a fabric: looks kept as numpy rows, samples made
when asked for."""
from __future__ import annotations

import struct

import numpy as np

from lab.telemetry import Columns, QueueSample


def test_columns_keep_every_look_past_their_first_allocation():
    cols = Columns(["s:1:3", "s:2:3"])
    looks = 2500                    # past 1024 and 2048 rows: grown twice
    for i in range(looks):
        cols.add(float(i), np.array([[i, 1, i, 0, 0, i % 2], [0, 0, 7, 1, 2, 0]]))
    series = cols.series()
    assert [len(series[k]) for k in cols.keys] == [looks, looks]
    assert series["s:1:3"][1234] == QueueSample(1234.0, 1234, 1, 1234, 0, 0, False)
    assert series["s:2:3"][-1] == QueueSample(2499.0, 0, 0, 7, 1, 2, False)
    assert cols.latest()["s:1:3"] == QueueSample(2499.0, 2499, 1, 2499, 0, 0, True)
    cols.add(2500.0, np.zeros((2, 6), dtype=np.int64))        # more after a read
    assert len(cols.series()["s:2:3"]) == looks + 1 and cols.series() is cols.series()


def test_the_csv_has_a_row_where_a_queue_holds_held_or_changed(tmp_path):
    cols = Columns(["s:1:3", "s:2:0"])
    for t, busy, idle in ((1.0, [0, 0, 5, 0, 0, 0], [0, 0, 0, 0, 0, 0]),
                          (2.0, [9, 1, 5, 0, 0, 1], [0, 0, 0, 0, 0, 0]),
                          (3.0, [0, 0, 6, 0, 0, 0], [0, 0, 0, 0, 0, 0]),
                          (4.0, [0, 0, 6, 0, 0, 0], [0, 0, 0, 0, 0, 0])):
        cols.add(t, np.array([busy, idle]))
    with open(tmp_path / "q.csv", "w") as f:
        cols.write_csv(f)
    assert (tmp_path / "q.csv").read_text().splitlines() == [
        "1.0000,s,1,3,0,0,5,0,0,0", "1.0000,s,2,0,0,0,0,0,0,0",   # the first look: all
        "2.0000,s,1,3,9,1,5,0,0,1",                                # holds (and paused)
        "3.0000,s,1,3,0,0,6,0,0,0"]                                # held before; sent more


def test_the_table_reads_pfc_counts_and_marks_in_one_unpack():
    """What the controller reports of every port (controllers/congestion.py), from the
    table's own layout: an array in memory stands in for the mapped BPF map."""
    from lab import dataplane

    class Memory:
        max_entries = 2

        def mmap(self):
            return bytearray(2 * dataplane.PORT_BYTES)

    t = dataplane.PortTable(Memory())
    at = t._state_at(1, 3)
    for i, name in enumerate(("ce_marked", "pfc_tx_pause", "pfc_tx_resume", "pfc_rx_pause",
                              "pfc_rx_resume")):
        struct.pack_into("=Q", t.mem, at + dataplane.STATE_FIELDS.index(name) * 8, 10 + i)
    assert t.pfc_and_marks(1, 3) == (11, 12, 13, 14, 10)
    assert t.pfc_and_marks(1, 2) == t.pfc_and_marks(0, 3) == (0, 0, 0, 0, 0)
