"""bench.scale's report from a run's results: every row renders, the shard's measured traffic
sits beside the planner's counts, and the targets are judged from the right counters (the
benchmark itself needs root, a memory cgroup and an hour: BENCHMARKS.md, "A table larger than
memory")."""

from bench.scale import report


def _run(samples_per_s: float, seconds: dict, reads: int) -> dict:
    traffic = {"warm": {"rows_read": reads, "index_blocks_read": reads, "read_calls": 2 * reads,
                        "seconds": seconds["warm"]},
               "pull": {"rows_read": reads // 4, "index_blocks_read": reads // 4, "read_calls": reads // 2,
                        "seconds": seconds["pull"]},
               "push": {"index_blocks_read": reads // 3, "seconds": 1.0},
               "writeback": {"write_calls": reads, "seconds": 2.0}}
    mem = {"peak": 3 << 29, "anon_peak": 1 << 30, "limit_hits": 7, "oom_kills": 0}
    return {"samples_per_s": samples_per_s, "cache_hit_rate": 0.5, "rows_read": 10 * reads, "read_calls": 3 * reads,
            "index_blocks_read": reads, "shard_s": 100.0, "shard_bytes": 17 * 10**9, "checkpoints": [("base", 40.0),
            ("delta", 4.0)], "resume_s": 150.0, "resume_wall_s": 170.0, "export_s": 80.0, "memory": mem,
            "memory_resume": mem, "memory_all": mem, "step_s": 0.4, "steps": 800, "rows_written": 5 * reads,
            "shard_traffic": traffic}


def test_the_report_renders_and_judges_cold_reads_from_the_warm_and_the_pull():
    plan = {"figures": {"step_s": 0.35, "bound_by": "merge", "shard_read_s_per_step": 0.1,
                        "shard_write_s_per_step": 0.12, "cache_hit_rate": 0.2, "shard_reads_from": "the device"},
            "passes": [{"shard_rows_read_per_window": 100.0, "shard_index_blocks_read_per_window": 100.0,
                        "shard_rows_written_per_window": 50.0, "shard_new_rows_written_per_window": 10.0,
                        "shard_push_index_blocks_per_window": 30.0}] * 2,
            "fits": [{"where": "SSD", "status": "unknown", "why": "size unknown"}], "notes": ["a note"],
            "disk_rows_per_s": 300000.0}
    res = {"config": {"rows": 1000, "unique_fields": 8, "batch": 2048, "k": 4, "cache_bytes": 1 << 25,
                      "rows_per_rank": 5000, "limit": 2 << 30, "kind": "v1", "write_behind": "on"},
           "device": {"tool": "fio", "iops_depth1": 10000, "iops_depth32": 90000, "pool_pages_per_s": 180000,
                      "pool_rows_per_s": 300000},
           "keys": 8000, "unlimited": _run(10000.0, {"warm": 10.0, "pull": 5.0}, 300000),
           "limited": _run(8000.0, {"warm": 20.0, "pull": 10.0}, 300000),
           "plan_unlimited": plan, "plan_limited": plan,
           "killed": {"step": 400, "every_windows": 25, "killed_after_s": 90.0, "partial_bytes": 10**9, "job_rc": 137,
                      "resumed_from": 0, "resume_wall_s": 60.0, "set_aside": True, "files": 3, "export_equal": True}}
    text = report(res)
    assert "**0.80x**" in text  # limited / unlimited samples/s
    # cold reads: 300k + 75k rows in 30 s of the warm's and the pull's calls = 12,500/s (25,000/s in the
    # unlimited run's 15 s), judged against the device; (2 * 300k + 150k) pool calls = 25,000/s beside them
    assert "| 25,000 | 12,500 | device best 90,000: **0.14x** |" in text
    assert "| 50,000 | 25,000 | 0.28x |" in text
    assert "Met: True, False, True; the planner's step within 25% in the cgroup: True" in text  # 350 ms of 400
    assert "| rows read by the warm and the pull | 375,000 | 375,000 | 20,000 |" in text  # 100 a window, 2 passes of 100 windows
    assert "| rows written back (evicted or written through) | 1,500,000 | 1,500,000 | 12,000 |" in text
    assert "storage.write_behind = on" in text and "sha256-equal" in text and "- a note" in text


def test_the_device_counters_give_the_depth_the_device_saw(tmp_path):
    """block_stat reads the counters of the device under a path (None without one); device_use
    turns two of them into reads a second, of its busy time, and reads in flight on average;
    the report shows them for both runs."""
    from bench.scale import _BLOCK_FIELDS, block_stat, device_use

    got = block_stat(tmp_path)
    assert got is None or set(_BLOCK_FIELDS) <= set(got)
    before = dict.fromkeys(_BLOCK_FIELDS, 0) | {"t": 100.0}
    # 10 s: 400k reads of 8 sectors that spent 60 s in the device together, busy 8 s of the 10
    after = before | {"reads": 400_000, "read_sectors": 3_200_000, "read_ms": 60_000, "busy_ms": 8_000,
                      "writes": 50_000, "t": 110.0}
    use = device_use(before, after)
    assert use["reads_per_s"] == 40_000 and use["reads_per_busy_s"] == 50_000 and use["busy"] == 0.8
    assert use["reads_in_flight"] == 6.0 and use["bytes_a_read"] == 4096 and use["writes_per_s"] == 5_000
    assert device_use(None, after) == {}


def test_the_report_shows_the_device_seen_from_the_block_layer():
    from bench.scale import _BLOCK_FIELDS, device_use

    before = dict.fromkeys(_BLOCK_FIELDS, 0) | {"t": 0.0}
    use = device_use(before, before | {"reads": 450_000, "read_sectors": 3_600_000, "read_ms": 90_000,
                                       "busy_ms": 10_000, "t": 10.0})
    res = {"config": {"rows": 1000, "unique_fields": 8, "batch": 2048, "k": 4, "cache_bytes": 1 << 25,
                      "rows_per_rank": 5000, "limit": 2 << 30, "kind": "v1"},
           "device": {"tool": "fio", "iops_depth1": 10000, "iops_depth32": 90000},
           "keys": 8000, "unlimited": _run(10000.0, {"warm": 10.0, "pull": 5.0}, 300000) | {"device_use": use},
           "limited": _run(8000.0, {"warm": 20.0, "pull": 10.0}, 300000) | {"device_use": use}}
    text = report(res)
    assert "device best 90,000: **0.50x** of its busy time" in text  # 45k reads/s, busy all 10 s
    assert "| 9.0 ; 4,096 ; 0 |" in text  # 90 s of reads in flight over 10 s
