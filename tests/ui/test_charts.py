"""What the live charts draw: bounded per-rank history, the SVG, and the straggler rule."""

from __future__ import annotations

import itertools
import math
import re

import pytest

from nbaccel.ui._chart import MAX_POINTS, MAX_RANK_LINES, render_svg
from nbaccel.ui._history import RECENT, History, Series
from nbaccel.ui._stragglers import FACTOR, FLOOR, find_stragglers


def test_series_stays_bounded_and_ends_at_the_latest_point():
    series = Series(limit=100)
    for step in range(100_000):
        series.add(step, float(step))
    points = series.points()
    assert len(points) <= 101 and len(series) == 100_000
    assert points[0] == (0, 0.0) and points[-1] == (99_999, 99_999.0)
    steps = [x for x, _ in points]
    assert steps == sorted(steps)
    gaps = {b - a for a, b in itertools.pairwise(steps[:-1])}  # the last one: the latest
    assert len(gaps) == 1  # evenly thinned, not truncated


def test_history_keeps_numbers_per_rank_and_skips_the_rest():
    history = History()
    for rank in (0, 1):
        for step in range(3):
            values = {"loss": 1.0 / (step + 1) + rank, "flag": True, "name": "x"}
            assert history.record(rank, "log", {"step": step, "values": values})
    assert not history.record(0, "log", {"step": "3", "values": {"loss": 1.0}})
    assert not history.record(0, "progress", {"n": 3})
    assert history.metrics() == ["loss"]
    data = history.data()
    assert data["loss"][0] == [(0.0, 1.0), (1.0, 0.5), (2.0, 1 / 3)]
    assert data["loss"][1][0] == (0.0, 2.0)


def test_a_diverging_loss_is_shown_not_dropped():
    history = History()
    for step, loss in enumerate([1.0, 0.5, math.nan, math.inf]):
        history.record(1, "log", {"step": step, "values": {"loss": loss, "gnorm": -math.inf}})
    svg = render_svg(history.data())
    assert "loss (nan at step 2, rank 1)" in svg and "gnorm (-inf at step 0, rank 1)" in svg
    assert svg.count('class="nbaccel-nonfinite"') == 2 + 4  # loss: nan, inf; gnorm: -inf x4
    assert 'data-metric="loss"' in svg and svg.count("<polyline") == 1  # the finite part


def test_history_system_charts_and_step_times():
    history = History()
    for i in range(RECENT + 3):
        for rank, busy in ((0, 0.01), (1, 0.2)):
            event = {"updates": 10 * i, "step_time": 0.25, "busy": busy, "rss": 2**30}
            history.record(rank, "system", event)
    assert history.metrics() == []
    assert history.metrics(system=True) == ["step time (s)", "RSS (MiB)"]
    assert history.data(system=True)["RSS (MiB)"][1][-1] == (70.0, 1024.0)
    kind, recent = history.step_times()
    assert kind == "busy" and recent == {0: [0.01] * RECENT, 1: [0.2] * RECENT}


def test_history_falls_back_to_the_time_between_logs():
    history = History()
    for step in range(6):
        for rank, per_step in ((0, 0.1), (1, 0.4)):
            history.record(rank, "log", {"step": step, "values": {}, "at": step * per_step})
    kind, recent = history.step_times()
    assert kind == "log interval"
    assert [round(x, 6) for x in recent[1]] == [0.4] * RECENT
    assert find_stragglers(recent) == {1: (pytest.approx(0.4), pytest.approx(0.1))}


def test_svg_has_a_panel_per_metric_and_a_line_per_rank():
    data = {
        "loss": {0: [(0, 1.0), (1, 0.5)], 1: [(0, 1.1), (1, 0.4)]},
        "a<b": {0: [(0, 3.0)]},  # a name that must be escaped; a single point
    }
    svg = render_svg(data)
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert re.findall(r'data-metric="([^"]*)"', svg) == ["loss", "a&lt;b"]
    assert re.findall(r'data-rank="(\w+)"', svg) == ["0", "1", "0"]
    assert "rank 0" in svg and "rank 1" in svg  # legend


def test_svg_draws_mean_and_spread_for_many_ranks():
    ranks = {r: [(s, float(r + s)) for s in range(5)] for r in range(MAX_RANK_LINES + 1)}
    svg = render_svg({"loss": ranks})
    assert re.findall(r'data-rank="(\w+)"', svg) == ["mean"]
    assert svg.count("nbaccel-band") == 1 and "min-max of 9 ranks" in svg
    assert re.findall(r'data-rank="(\w+)"', render_svg({"loss": ranks}, lines="ranks")) == [
        str(r) for r in range(9)
    ]
    with pytest.raises(ValueError, match="lines='bars'"):
        render_svg({"loss": ranks}, lines="bars")


def test_svg_thins_long_lines_to_its_width():
    svg = render_svg({"loss": {0: [(s, math.sin(s)) for s in range(10_000)]}})
    points = re.search(r'<polyline data-rank="0" points="([^"]*)"', svg).group(1).split()
    assert len(points) == MAX_POINTS


def test_straggler_rule_factor_floor_and_minimum_reports():
    fast, slow = [0.10, 0.11, 0.10], [0.20, 0.21, 0.19]
    assert find_stragglers({0: fast, 1: fast, 2: slow}) == {2: (0.2, 0.1)}
    # 1.5x above but only 4 ms: scheduler jitter on tiny steps is not a straggler
    assert find_stragglers({0: [0.008, 0.008], 1: [0.012, 0.012]}) == {}
    assert FLOOR > 0.012 - 0.008 and FACTOR * 0.0079 < 0.012
    assert find_stragglers({0: fast, 1: [0.2]}) == {}  # one report is not enough
    assert find_stragglers({0: slow}) == {}  # nobody to compare with
    assert find_stragglers({0: fast, 1: [0.14, 0.14]}) == {}  # 1.4x: below the factor
