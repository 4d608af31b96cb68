"""hvctr.memcg: where the job's memory cgroup stands, v1 and v2, from files laid out as the kernel
lays them out (and, where this machine has cgroup v1 and root, from a real group)."""

import os
import subprocess
import sys
import uuid

import pytest

from hvctr import memcg


def _v1(tmp_path, limit, usage, cache, rss, dirty=0, failcnt=0):
    g = tmp_path / "memory" / "slurm" / "job_7"
    g.mkdir(parents=True)
    (g / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (g / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (g / "memory.max_usage_in_bytes").write_text(f"{usage + 5}\n")
    (g / "memory.failcnt").write_text(f"{failcnt}\n")
    (g / "memory.stat").write_text(f"cache 1\nrss 1\ntotal_cache {cache}\ntotal_rss {rss}\ntotal_dirty {dirty}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("12:pids:/slurm/job_7\n4:memory:/slurm/job_7\n0::/\n")
    return g, proc


def test_v1_group_found_from_proc_self_cgroup_and_read(tmp_path):
    g, proc = _v1(tmp_path, limit=2 << 30, usage=3 << 29, cache=1 << 29, rss=1 << 30, dirty=1 << 27, failcnt=12)
    m = memcg.current(str(proc), v1_root=str(tmp_path / "memory"), v2_root=str(tmp_path / "none"))
    assert (m.path, m.version, m.limit, m.usage, m.page_cache, m.anon, m.dirty) == \
        (str(g), 1, 2 << 30, 3 << 29, 1 << 29, 1 << 30, 1 << 27)
    assert m.peak == (3 << 29) + 5 and m.limit_hits == 12
    assert m.available == (2 << 30) - ((3 << 29) - ((1 << 29) - (1 << 27)))  # clean page cache is reclaimable
    assert "(v1): 1.50 GiB charged of its limit 2.00 GiB" in memcg.describe(m) and "12 times" in memcg.describe(m)


def test_v1_without_a_limit_is_no_limit(tmp_path):
    _, proc = _v1(tmp_path, limit=9223372036854771712, usage=1, cache=0, rss=1)
    assert memcg.current(str(proc), v1_root=str(tmp_path / "memory"), v2_root=str(tmp_path / "none")) is None


def test_v2_group_and_its_pressure_note(tmp_path):
    g = tmp_path / "v2" / "job.slice"
    g.mkdir(parents=True)
    (g / "memory.max").write_text(f"{1 << 30}\n")
    (g / "memory.current").write_text(f"{(1 << 30) - 10}\n")
    (g / "memory.stat").write_text(f"anon {1 << 28}\nfile {(1 << 30) - (1 << 28)}\nfile_dirty {1 << 29}\n")
    (g / "memory.events").write_text("low 0\nhigh 0\nmax 41\noom 0\noom_kill 0\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job.slice\n")
    m = memcg.current(str(proc), v1_root=str(tmp_path / "nov1"), v2_root=str(tmp_path / "v2"))
    assert (m.version, m.limit, m.limit_hits, m.dirty) == (2, 1 << 30, 41, 1 << 29)
    note = memcg.pressure_note(m)
    assert "at its limit and dirty pages wait for write-back" in note and "--mem" in note
    (g / "memory.current").write_text(f"{1 << 28}\n")
    assert memcg.pressure_note(memcg.read_group(str(g))) == ""


def test_a_process_in_a_real_v1_group_sees_its_limit():
    root = memcg.V1_ROOT
    if os.geteuid() != 0 or not os.path.isfile(os.path.join(root, "memory.limit_in_bytes")):
        pytest.skip("needs root and cgroup v1's memory controller at /sys/fs/cgroup/memory")
    g = os.path.join(root, f"hvctr-test-{uuid.uuid4().hex[:8]}")
    os.mkdir(g)
    try:
        with open(os.path.join(g, "memory.limit_in_bytes"), "w") as f:
            f.write(str(512 << 20))
        code = ("import os, sys\nopen(sys.argv[1] + '/cgroup.procs', 'w').write(str(os.getpid()))\n"
                "from hvctr import memcg\nm = memcg.current()\nprint(m.path, m.version, m.limit)\n")
        r = subprocess.run([sys.executable, "-c", code, g], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == [g, "1", str(512 << 20)]
    finally:
        os.rmdir(g)


def test_an_ancestors_limit_binds_a_group_without_its_own(tmp_path):
    """Slurm limits the job's group; its tasks run in groups below it with no limit of their
    own: v1 says so in memory.stat's hierarchical_memory_limit, v2 in the parents' memory.max."""
    g, proc = _v1(tmp_path, limit=9223372036854771712, usage=1, cache=0, rss=1)
    with open(g / "memory.stat", "a") as f:
        f.write(f"hierarchical_memory_limit {3 << 30}\n")
    m = memcg.current(str(proc), v1_root=str(tmp_path / "memory"), v2_root=str(tmp_path / "none"))
    assert m is not None and m.limit == 3 << 30
    job = tmp_path / "v2" / "job_9"
    task = job / "step_0" / "task_0"
    task.mkdir(parents=True)
    for d, limit in ((job, str(1 << 30)), (job / "step_0", "max"), (task, "max")):
        (d / "memory.max").write_text(f"{limit}\n")
        (d / "memory.current").write_text("4096\n")
    (tmp_path / "cgroup2").write_text("0::/job_9/step_0/task_0\n")
    m = memcg.current(str(tmp_path / "cgroup2"), v1_root=str(tmp_path / "nov1"), v2_root=str(tmp_path / "v2"))
    assert m is not None and (m.version, m.limit) == (2, 1 << 30)
