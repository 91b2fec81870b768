"""benchmarks/server_footprint.py's summary: medians over rounds, the server apart from its
workers, the first structured request's figures, and the verdict against issue 49's 450 MB."""

from __future__ import annotations

from benchmarks.server_footprint import summary


def _sample(server_mb: float, worker_mb: float, ready_s: float, lag_s: float = 0.01) -> dict:
    server = {"pid": 1, "rss": server_mb * 1e6, "anon": server_mb * 0.7e6,
              "file": server_mb * 0.3e6, "shmem": 0}
    worker = {"pid": 2, "rss": worker_mb * 1e6, "anon": worker_mb * 1e6, "file": 0, "shmem": 0}
    return {"ready_s": ready_s, "rss_bytes": (server_mb + worker_mb) * 1e6, "processes": 2,
            "by_process": [server, worker], "first_structured_s": ready_s / 10,
            "loop_lag_max_le_s": lag_s, "rss_after_structured_bytes": (server_mb + 30) * 1e6}


def test_the_summary_takes_medians_and_judges_the_total():
    within = summary([_sample(400, 20, 9.0), _sample(410, 21, 8.0, lag_s=0.25),
                      _sample(500, 22, 30.0)])
    assert within["rss_mb"] == 431.0 and within["server_rss_mb"] == 410.0
    assert within["rss_after_structured_mb"] == 440.0 and within["first_structured_s"] == 0.9
    assert within["loop_lag_max_le_s"] == 0.25  # the longest, not the median
    assert within["workers_rss_mb"] == 21.0 and within["ready_s"] == 9.0
    assert within["server_anon_mb"] == 287.0 and within["within_target"] is True
    over = summary([_sample(430, 21, 9.0)] * 3)  # the workers count too
    assert over["rss_mb"] == 451.0 and over["within_target"] is False
