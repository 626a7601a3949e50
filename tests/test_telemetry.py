"""Queue telemetry's storage, without a fabric: looks kept as numpy rows, samples made
when asked for."""
from __future__ import annotations

import struct

import numpy as np

from lab.fabric.telemetry import Columns, QueueSample


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
    from lab.kernel import dataplane

    class Memory:
        max_entries = 2

        def mmap(self):
            return bytearray(2 * dataplane.PORT_BYTES)

    t = dataplane.PortTable(Memory())
    at = t._state_at(1, 3)
    for i, name in enumerate(("ce_marked", "pfc_tx_pause", "pfc_tx_resume", "pfc_rx_pause",
                              "pfc_rx_resume", "trimmed")):
        struct.pack_into("=Q", t.mem, at + dataplane.STATE_FIELDS.index(name) * 8, 10 + i)
    struct.pack_into("=Q", t.mem, t._state_at(1, 7) + dataplane.STATE_FIELDS.index(
        "pfc_rx_resume") * 8, 99)
    assert t.pfc_and_marks(1)[3] == (11, 12, 13, 14, 10, 15)
    assert t.pfc_and_marks(1)[7] == (0, 0, 0, 99, 0, 0)
    assert t.pfc_and_marks(1)[2] == t.pfc_and_marks(0)[3] == (0, 0, 0, 0, 0, 0)
    assert t.counters(1, 3)["trimmed"] == 15


def test_collecting_the_data_paths_history_fills_periods_without_a_frame():
    """The programs note a queue's state in the look of the period a frame entered or
    left it (lab/kernel/dataplane.bpf.c, note()); telemetry turns the ring of looks into one
    row per queue per period: a period without a look holds the one before, a pause
    counts in the periods it outlasts, and what the ring overwrote before it was read
    is counted as lost. Fake ring and table: numpy arrays."""
    from lab.fabric.telemetry import QueueTelemetry
    from lab.kernel import dataplane

    period_ns, n = 5_000_000, dataplane.HISTORY_LOOKS
    fields = 1 + len(dataplane.LOOK_FIELDS)

    class History:
        looks = np.zeros((2, n, fields), dtype=np.uint64)

    class Table:
        now = np.zeros((2, 6), dtype=np.int64)

        def queue_states(self, slots, prios):
            return self.now.copy()

    def look(queue, period, backlog, sent, paused_until_ns=0):
        History.looks[queue, period % n] = [period, backlog, backlog // 1000, sent, 0, 0,
                                            paused_until_ns]

    tel = QueueTelemetry(None, None)
    tel.table, tel._slots, tel._prios = Table(), np.array([0, 1]), np.array([3, 3])
    tel._columns = Columns(["s:1:3", "s:2:3"])
    class Netlink:                          # the kernel's counters: none past the program
        def qdiscs(self):
            return []
    # queue 0 fills in period 1001 (paused until mid-1003), drains in 1003
    look(0, 1001, 9000, 5, paused_until_ns=1003 * period_ns + period_ns // 2)
    look(0, 1003, 0, 14, paused_until_ns=1003 * period_ns + period_ns // 2)
    look(1, 1002 - n, 4000, 99)             # queue 1: a look of an earlier lap only
    state = np.array([[2000, 2, 3, 0, 0, 0], [1000, 1, 7, 0, 0, 0]])
    Table.now = np.array([[0, 0, 14, 0, 0, 0], [0, 1, 7, 0, 0, 0]])   # queue 1 written off
    now_ns = 1006 * period_ns + 1           # 1005 may still be written: up to 1004
    done, state = tel._collect(Netlink(), History(), np.array([0, 1]), state, 1000, period_ns,
                               100.0, now_ns)
    assert done == 1005 and tel.periods_lost == 0
    rows = tel._columns.series()
    assert [(s.t, s.backlog_bytes, s.sent_packets, s.paused) for s in rows["s:1:3"]] == [
        (100.0 + 1001 * 0.005, 2000, 3, False), (100.0 + 1002 * 0.005, 9000, 5, True),
        (100.0 + 1003 * 0.005, 9000, 5, True), (100.0 + 1004 * 0.005, 0, 14, False),
        (100.0 + 1005 * 0.005, 0, 14, False)]
    assert [s.backlog_bytes for s in rows["s:2:3"]] == [1000] * 5
    # no frame touched queue 1 since: its backlog as the table has it now (a write-off)
    assert state.tolist() == [[0, 0, 14, 0, 0, 1003 * period_ns + period_ns // 2],
                              [0, 1, 7, 0, 0, 0]]
    # collected n + 10 periods late: the ring kept the last n - 3 safely
    done2, _ = tel._collect(Netlink(), History(), np.array([0, 1]), state, done, period_ns,
                            100.0, (done + n + 11) * period_ns)
    assert done2 == done + n + 10 and tel.periods_lost == 13
    assert tel._columns.n == 5 + n - 3


def test_the_summary_from_the_rows_equals_the_one_from_samples():
    """Columns.summary (numpy over the rows) against QueueTelemetry's summary of
    QueueSample lists (the sampling mode's), on the same random looks and windows."""
    from lab.fabric.telemetry import QueueTelemetry
    rng = np.random.default_rng(7)
    keys = ["s:1:3", "s:2:3", "s:3:0"]
    cols = Columns(keys)
    sent = np.zeros(3, dtype=np.int64)
    for i in range(3000):
        sent += rng.integers(0, 3, 3) * [1, 1, 0]          # s:3:0 carries nothing
        rows = np.stack([rng.integers(0, 9000, 3), rng.integers(0, 9, 3), sent,
                         sent // 50, sent // 7, rng.integers(0, 2, 3)], axis=1)
        cols.add(1000.0 + i * 0.005, rows)
    samples = QueueTelemetry(None, None)
    samples._series = cols.series()
    for since, until in ((0.0, float("inf")), (1003.0, 1007.5), (1005.0, 1005.004)):
        assert cols.summary(since, until) == samples.summary(since, until)
    assert "s:3:0" not in cols.summary(0.0, float("inf"))


def test_the_wire_marking_curve_recovers_what_a_red_queue_decided():
    """tests/wire.py's marking_curve (what the kernel tier holds BPF marking against
    kernel RED with) on a simulated FIFO whose marks are known: Poisson arrivals at a
    load swinging between 0.3x and 1.3x the port, RED's average and a mark drawn at its
    probability as each packet enters, captured as it leaves a queueing delay later.
    Per bin, the curve from 5 ms looks and departure times agrees with the marks as
    decided, within 0.04 (the estimated average against the exact one)."""
    from wire import marking_curve
    rng = np.random.default_rng(7)
    kmin, kmax, pmax, wlog, size, limit = 2048, 16384, 0.2, 4, 1000, 64
    period, drain, steps = 0.005, 3, 30         # 3 packets leave per 5 ms period
    fifo, avg, decided, looks, ce_times, sent, credit = [], 0.0, [], [], [], 0, 0.0
    for i in range(4000):
        for s in range(steps):
            for _ in range(rng.poisson(drain * (0.8 + 0.5 * np.sin(i / 40)) / steps)):
                if len(fifo) < limit:
                    avg += (len(fifo) * size - avg) / 2 ** wlog
                    p = 1.0 if avg >= kmax else max(0.0, (avg - kmin) / (kmax - kmin) * pmax)
                    fifo.append(rng.random() < p)
                    decided.append((avg, fifo[-1]))
            credit = min(1.0, credit + drain / steps) if fifo else 0.0
            if fifo and credit >= 1 - 1e-9:
                credit -= 1
                if fifo.pop(0):
                    ce_times.append((i + (s + 1) / steps) * period)
                sent += 1
        looks.append(((i + 1) * period, len(fifo) * size, len(fifo), sent))
    edges = [0, kmin, 6827, 11605, kmax, 1e9]
    packets, marked = marking_curve(np.array(looks, dtype=float), ce_times,
                                    [0.0, looks[-1][0]], wlog, edges)
    truth = np.array(decided)
    for i, (lo, hi) in enumerate(zip(edges, edges[1:])):
        here = truth[(truth[:, 0] >= lo) & (truth[:, 0] < hi), 1]
        assert packets[i] >= 300 and abs(len(here) - packets[i]) < 0.2 * len(here), i
        assert abs(marked[i] / packets[i] - here.mean()) <= 0.04, \
            (i, marked[i] / packets[i], here.mean())
