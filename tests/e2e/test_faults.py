"""Faults injected into real training jobs (mpirun, real processes, real files, real disks).

Each test names the fault, injects it into a running or starting job, and checks what
RELIABILITY.md promises: the job ends (non-zero, in bounded time, no rank left behind), the
error names what is wrong and is reported once, the last complete checkpoint is intact, and
a resumed run ends with exactly the parameters of a run that never failed.

Jobs that are independent run at the same time (the failing ones all at once: most of them
end in their first seconds); every subprocess has a timeout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import pytest

from hvctr.checkpoint.format import file_sha256, read_manifests
from tests.conftest import mount_tmpfs, unmount
from tests.e2e.helpers import assert_same_model, launch, make_dataset, session_pids, signal_job, train

# Windows of 2 steps, a checkpoint every 2 windows (steps 4, 8, 12, 16: base, delta, base,
# delta) and one at the end; all kept, so that their sizes are known to the disk-full tests.
FLAGS = ["--merge.every_k_steps=2", "--checkpoint.every_windows=2", "--checkpoint.compact_every=2",
         "--checkpoint.keep=10", "--storage.cpu_cache_bytes=3e5", "--train.max_steps=16"]
JOB_TIMEOUT = 240
HVCTR_ERROR = "hvctr train: error:"
CRASH_SIGNS = ("Traceback", "Segmentation fault", "Bus error", "signal 7", "signal 11", "core dumped")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory)


# --- helpers --------------------------------------------------------------------------------


@dataclass
class Ended:
    returncode: int | None  # None: still running after the grace period (then killed)
    output: str
    run: Path


def finish(p: subprocess.Popen, log: Path, run: Path, timeout: float = JOB_TIMEOUT) -> Ended:
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        signal_job(p, signal.SIGKILL)
        p.wait(timeout=60)
        rc = None
    return Ended(rc, log.read_text(errors="replace"), run)


def rank_pids(mpirun_pid: int) -> dict[int, int]:
    """{rank: pid} of mpirun's children, from their OMPI_COMM_WORLD_RANK."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        rank = [e.split(b"=", 1)[1] for e in env if e.startswith(b"OMPI_COMM_WORLD_RANK=")]
        if ppid == mpirun_pid and rank:
            out[int(rank[0])] = int(entry)
    return out


def signal_rank_after_checkpoint(p: subprocess.Popen, run: Path, log: Path, seq: int, rank: int, sig: int,
                                 grace: float) -> tuple[int | None, float | None]:
    """Sends ``sig`` to one rank of job ``p`` once checkpoint ``seq`` is complete; returns the
    job's exit status and the seconds it took to end after the signal ((None, None) if it did
    not end within ``grace`` seconds: it is then killed)."""
    marker = run / "checkpoints" / f"ckpt-{seq:06d}" / "manifest.json"
    deadline = time.monotonic() + JOB_TIMEOUT
    while not marker.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    pids = rank_pids(p.pid)
    assert marker.exists() and rank in pids, log.read_text()
    os.kill(pids[rank], sig)
    t0 = time.monotonic()
    try:
        return p.wait(timeout=grace), time.monotonic() - t0
    except subprocess.TimeoutExpired:  # not ended in time: the caller's test says so
        signal_job(p, signal.SIGKILL)
        p.wait(timeout=60)
        return None, None


def live_processes(marker: str) -> list[str]:
    """Processes (not zombies) whose command line contains ``marker`` (a run's unique path)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in cmdline and state != "Z":
            found.append(f"{entry}: {cmdline[:200]}")
    return found


def assert_nothing_left(run: Path) -> None:
    """No process of the job is left: the ranks exit with mpirun (a short grace for the kernel)."""
    deadline = time.monotonic() + 15
    while live_processes(str(run)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live_processes(str(run)) == []


def assert_clean_error(ended: Ended, *expected: str) -> None:
    """Non-zero exit, each expected text in the one hvctr error message, no crash."""
    assert ended.returncode not in (None, 0), f"rc {ended.returncode}:\n{ended.output[-3000:]}"
    errors = ended.output.count(HVCTR_ERROR)
    assert errors == 1, f"the error is reported {errors} times:\n{ended.output[-3000:]}"
    for text in expected:
        assert re.search(text, ended.output), f"{text!r} not in:\n{ended.output[-3000:]}"
    for sign in CRASH_SIGNS:
        assert sign not in ended.output, f"{sign!r} in:\n{ended.output[-3000:]}"
    assert_nothing_left(ended.run)


def verified_newest(ckdir: Path) -> dict:
    """The newest complete checkpoint, after checking every file of its chain against the
    manifests' sizes and sha256 (what resume checks)."""
    manifests = read_manifests(ckdir)
    assert manifests, f"no complete checkpoint in {ckdir}"
    by_seq = {m["seq"]: m for m in manifests}
    newest = manifests[0]
    for seq in newest["chain"]:
        for rec in by_seq[seq]["files"]:
            path = ckdir / f"ckpt-{seq:06d}" / rec["file"]
            assert path.stat().st_size == rec["bytes"] and file_sha256(path) == rec["sha256"], path
    return newest


def flip_bit(path: Path, offset: int) -> None:
    """One bit of the byte at ``offset`` flipped, in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def truncate_half(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def copy_run(src: Path, dst: Path, parts: tuple[str, ...] = ("checkpoints",)) -> Path:
    for part in parts:
        shutil.copytree(src / part, dst / part)
    return dst


# --- the runs the others compare with and start from -------------------------------------------


@dataclass
class Killed:
    returncode: int | None
    seconds_to_exit: float | None  # None: not ended within 60 s of the kill
    output: str
    run: Path


@pytest.fixture(scope="module")
def first_runs(dataset, tmp_path_factory) -> tuple[Path, Killed]:
    """Two jobs at once: the uninterrupted reference run every recovered run must equal bit for
    bit, and the same run with rank 1 SIGKILLed once checkpoint 2 is complete (step 12 of 16)."""
    root = tmp_path_factory.mktemp("first")
    ref = launch(2, root / "reference", dataset, *FLAGS, log=root / "reference.log")
    run, log = root / "killed", root / "killed.log"
    p = launch(2, run, dataset, *FLAGS, log=log)
    try:
        rc, seconds = signal_rank_after_checkpoint(p, run, log, seq=2, rank=1, sig=signal.SIGKILL, grace=60)
    except BaseException:
        for job in (p, ref):
            signal_job(job, signal.SIGKILL)
        raise
    done = finish(ref, root / "reference.log", root / "reference")
    assert done.returncode == 0, done.output[-4000:]
    return root / "reference", Killed(rc, seconds, log.read_text(errors="replace"), run)


@pytest.fixture(scope="module")
def reference(first_runs) -> Path:
    return first_runs[0]


@pytest.fixture(scope="module")
def killed_rank(first_runs) -> Killed:
    return first_runs[1]


@pytest.fixture(scope="module")
def resumed(killed_rank, dataset, tmp_path_factory) -> dict[str, tuple[Ended, int]]:
    """Two resumed runs at once from copies of the killed run: as it was ("plain"), and with
    the files of its newest checkpoint and its working shards damaged ("damaged").
    {case: (the job, the newest checkpoint before resuming)}."""
    root = tmp_path_factory.mktemp("resumed")
    newest = verified_newest(killed_rank.run / "checkpoints")["seq"]
    jobs = {}
    for case in ("plain", "damaged"):
        run = copy_run(killed_rank.run, root / case, ("checkpoints", "shards"))
        if case == "damaged":
            ck = run / "checkpoints" / f"ckpt-{newest:06d}"
            truncate_half(ck / "rank-00000.h5")
            flip_bit(ck / "rank-00001.h5", os.path.getsize(ck / "rank-00001.h5") // 2)
            # The working shards are copies only: damaged ones are rebuilt from the checkpoint.
            truncate_half(run / "shards" / "shard-r00000.h5")
            flip_bit(run / "shards" / "shard-r00001.h5", 4096)
        log = root / f"{case}.log"
        jobs[case] = (launch(2, run, dataset, *FLAGS, resume=True, log=log), log, run)
    return {case: (finish(*job), newest) for case, job in jobs.items()}


# --- 1. a rank SIGKILLed mid-training --------------------------------------------------------


def test_rank_sigkill_ends_job_and_resume_is_exact(killed_rank, resumed, reference):
    k = killed_rank
    assert k.seconds_to_exit is not None, "the job did not end within 60 s of the kill"
    assert k.returncode != 0
    # mpirun names the rank that died
    assert re.search(r"process rank 1 with PID \d+ on node \S+ exited on signal 9", k.output), k.output[-3000:]
    assert_nothing_left(k.run)
    assert verified_newest(k.run / "checkpoints")["seq"] >= 2  # intact, checksums and all
    ended, newest = resumed["plain"]
    assert ended.returncode == 0, ended.output[-4000:]
    assert f"resumed from checkpoint {newest} " in ended.output
    assert_same_model(reference, ended.run)


# --- 2. a kill while a checkpoint is being written ---------------------------------------------


def _stop_inside_a_checkpoint_write(p: subprocess.Popen, ckdir: Path) -> int | None:
    """Freezes the job (SIGSTOP to mpirun and the ranks) at a moment a rank file of checkpoint
    >= 1 is still a temporary file (rank-NNNNN.h5.<random>.tmp) and that checkpoint has no manifest; returns its number (None if the
    job ended first). Killed while frozen, the job dies inside that write."""
    pids: list[int] = []
    while len(pids) < 3 and p.poll() is None:  # mpirun and 2 ranks, looked up once: signals must be quick
        pids = session_pids(p.pid)
        time.sleep(0.01)

    def send(sig: int) -> None:
        for pid in pids:
            os.kill(pid, sig)

    seq = 1
    while p.poll() is None:
        here = ckdir / f"ckpt-{seq:06d}"
        if (here / "manifest.json").exists():
            seq += 1  # missed that one: it completed between two looks
            continue
        if any(any(here.glob(f"rank-{r:05d}.h5.*.tmp")) for r in (0, 1)):  # a fresh temporary name (safefile)
            send(signal.SIGSTOP)
            if not (here / "manifest.json").exists():
                return seq
            send(signal.SIGCONT)
            seq += 1
        time.sleep(0.0005)
    return None


def test_kill_during_checkpoint_write_resumes_from_previous(dataset, reference, tmp_path):
    run, log = tmp_path / "run", tmp_path / "job.log"
    flags = [*FLAGS, "--checkpoint.every_windows=1"]  # a checkpoint every window: many to hit
    p = launch(2, run, dataset, *flags, log=log)
    try:
        seq = _stop_inside_a_checkpoint_write(p, run / "checkpoints")
    finally:
        signal_job(p, signal.SIGKILL)
        p.wait(timeout=60)
    assert seq is not None, f"the job ended before a checkpoint write could be interrupted:\n{log.read_text()}"
    partial = run / "checkpoints" / f"ckpt-{seq:06d}"
    assert partial.is_dir() and not (partial / "manifest.json").exists()
    assert verified_newest(run / "checkpoints")["seq"] == seq - 1
    assert_nothing_left(run)
    r = train(2, run, dataset, *flags, resume=True, timeout=JOB_TIMEOUT)
    assert f"resumed from checkpoint {seq - 1} " in r.stdout
    assert (run / "checkpoints" / "rejected" / partial.name).is_dir()  # kept aside, never loaded
    assert_same_model(reference, run)


# --- 3. damaged files: checkpoint, working shard, data shard -----------------------------------


def test_damaged_checkpoint_falls_back_to_previous(resumed, reference):
    """Newest checkpoint: rank 0's file truncated, rank 1's with a flipped bit; both working
    shards damaged too. Each rank names its file, both fall back together, nothing is lost."""
    ended, newest = resumed["damaged"]
    assert ended.returncode == 0, ended.output[-4000:]
    for rank in (0, 1):
        assert re.search(rf"skipping checkpoint {newest}: \S*ckpt-{newest:06d}/rank-0000{rank}.h5 does not match "
                         rf"its checksum", ended.output), ended.output[-3000:]
    assert f"resumed from checkpoint {newest - 1} " in ended.output
    assert (ended.run / "checkpoints" / "rejected" / f"ckpt-{newest:06d}").is_dir()  # set aside, not deleted
    assert_same_model(reference, ended.run)


def test_damaged_data_shards_are_named(failing_jobs):
    """Rank 0's shard truncated (found when opened, before Horovod starts); rank 1's shard
    with one flipped bit in its keys (found by the checksum check at start)."""
    truncated, _ = failing_jobs["data_truncated"]
    assert_clean_error(truncated, r"rank 0: \S+/train-00002.h5: cannot open the shard as HDF5 .*truncated")
    assert truncated.returncode == 2 and not (truncated.run / "shards").exists()
    flipped, _ = failing_jobs["data_bitflip"]
    assert_clean_error(flipped, r"\S+/train-00003.h5: dataset 'keys' does not match its checksum")
    assert not (flipped.run / "checkpoints").exists()


def test_no_loadable_checkpoint_stops_and_keeps_every_file(failing_jobs):
    """Every checkpoint damaged: --resume stops with one error and overwrites nothing (a fresh
    start would write checkpoint 0 over the old one)."""
    ended, damaged = failing_jobs["no_loadable_checkpoint"]
    assert_clean_error(ended, r"--resume: no checkpoint in \S+/checkpoints can be loaded")
    assert ended.returncode == 2
    assert "skipping checkpoint 0: " in ended.output
    ckdir = ended.run / "checkpoints"
    assert {p.relative_to(ckdir): p.stat().st_size for p in ckdir.rglob("*") if p.is_file()} == damaged


# --- 4. a full disk ----------------------------------------------------------------------------


def _disk_job(failing_jobs, case: str):
    if case not in failing_jobs:
        pytest.skip(failing_jobs["no_disk"][1])
    return failing_jobs[case]


@pytest.mark.parametrize("case,seq", [("full_disk_delta", 1), ("full_disk_compaction", 2)])
def test_full_disk_during_checkpoint_keeps_previous(failing_jobs, case, seq):
    ended, disk = _disk_job(failing_jobs, case)
    assert_clean_error(ended, rf"checkpoint {seq}: cannot write {disk}/ckpt-{seq:06d}/rank-0000[01].h5: "
                              rf"[Nn]o space left on device.*newest complete checkpoint is checkpoint {seq - 1}")
    assert verified_newest(disk)["seq"] == seq - 1
    assert list(disk.rglob("*.tmp")) == []  # the failed file was removed: the space is free again


def test_full_disk_for_the_shards_is_found_before_horovod(failing_jobs):
    # Room for one shard, not for the node's two: the preflight adds up what the node's ranks
    # reserve there (the creation's own check: tests/unit/test_reliability.py)
    ended, disk = _disk_job(failing_jobs, "full_disk_shard")
    assert_clean_error(ended, rf"hvctr train: error: not enough free space on the file system of {disk}: "
                              rf"40.0 MiB free, [0-9.]+ MiB needed \(2 working shard\(s\) of [0-9,]+ rows "
                              rf"\(storage.rows_per_rank\)")
    assert ended.returncode == 2 and "Horovod" not in ended.output and "training:" not in ended.output
    assert list(disk.rglob("*")) == []


# --- 5. bad input: one clear error before training, every rank gone ------------------------------

BAD_INPUTS = {
    "unknown_key": (["--merge.every_k_stepz=4"], r"unknown config key 'merge.every_k_stepz'; valid keys of \[merge\]"),
    "wrong_type": (["--data.batch_size_per_rank=lots"],
                   r"config key 'data.batch_size_per_rank': expected an integer, got 'lots'"),
    "k_below_1": (["--merge.every_k_steps=0"], r"config key 'merge.every_k_steps': must be >= 1, got 0"),
    "working_set_below_batch": (["--storage.max_working_set_rows=1000"],
                                r"config key 'storage.max_working_set_rows': 1000 is smaller than one batch"),
    "missing_data_shard": ([], r"rank 1: \S+/train-00001.h5: shard file missing"),
    "other_world_size": ([], r"checkpoint \d+ was written by 2 ranks, this run has 3"),
    "hwmap_numa_node": ([], r"names NUMA node\(s\) 1, which this machine \(\S+\) does not have"),
    "hwmap_ssd_not_a_directory": ([], r"cannot create the working-shard directory \S+/a-file/ssd/hvctr-shards/run-\w+ "
                                      r"\(the hardware map's ssd path\): Not a directory"),
}


def test_an_error_of_every_rank_after_horovod_started_is_printed_once(failing_jobs):
    # Not agreed (each rank finds it alone, at its own time): the first rank to fail creates
    # the job's error record and prints; the other only logs, and MPI_Abort ends it.
    ended, _ = failing_jobs["init_from_other_dim"]
    assert_clean_error(ended, r"hvctr train: error: \S+/checkpoints/ckpt-\d+/rank-0000[01].h5: rows of width 28, "
                              r"this run's rows have 16 \(storage.dim differs\)\n")
    assert ended.returncode == 2
    records = list((ended.run / "logs").glob("error-*.txt"))
    assert len(records) == 1 and records[0].read_text() in ended.output


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_clear_error_before_training(failing_jobs, case):
    ended, _ = failing_jobs[case]
    assert_clean_error(ended, BAD_INPUTS[case][1])
    assert ended.returncode == 2
    assert "training:" not in ended.output and not (ended.run / "shards").exists()


# --- the failing jobs, all at once -------------------------------------------------------------


def _pages(nbytes: int) -> int:
    return -(-nbytes // 4096) * 4096


def _checkpoint_bytes(run: Path, seq: int) -> tuple[int, int]:
    """(bytes on a tmpfs of checkpoint ``seq``: files and manifest, largest rank file)."""
    files = list((run / "checkpoints" / f"ckpt-{seq:06d}").iterdir())
    return sum(_pages(p.stat().st_size) for p in files), max(p.stat().st_size for p in files)


def _damaged_data(dataset: Path, root: Path) -> dict[str, Path]:
    out = {}
    for case in ("data_truncated", "data_bitflip", "missing_data_shard"):
        out[case] = data = root / case / "data"
        shutil.copytree(dataset, data)
    truncate_half(out["data_truncated"] / "train-00002.h5")  # rank 0 reads shards 0, 2, 4
    with h5py.File(out["data_bitflip"] / "train-00003.h5", "r") as f:  # rank 1 reads shards 1, 3, 5
        offset = f["keys"].id.get_offset() + 1000
    flip_bit(out["data_bitflip"] / "train-00003.h5", offset)
    (out["missing_data_shard"] / "train-00001.h5").unlink()
    return out


def _full_disks(reference: Path, root: Path) -> dict[str, tuple[Path, str]]:
    """Small tmpfs mounts: room for the checkpoints before, then for one rank file of the next
    but not for two; room for one 29 MiB shard, not two. One rank fails or both do (tmpfs
    allocates page by page, two reservations at once can both fall short): one report."""
    c0, _ = _checkpoint_bytes(reference, 0)
    c1, d1 = _checkpoint_bytes(reference, 1)
    _, b2 = _checkpoint_bytes(reference, 2)
    return {"full_disk_delta": (mount_tmpfs(root / "delta-disk", c0 + d1 * 3 // 2), "--checkpoint.dir"),
            "full_disk_compaction": (mount_tmpfs(root / "compaction-disk", c0 + c1 + b2 * 3 // 2), "--checkpoint.dir"),
            "full_disk_shard": (mount_tmpfs(root / "shard-disk", 40 << 20), "--storage.shard_dir")}


@pytest.fixture(scope="module")
def failing_jobs(dataset, reference, killed_rank, tmp_path_factory):
    """Every job that must fail, started at once (they spend their time importing):
    {case: (the job, its data directory or full disk)}."""
    root = tmp_path_factory.mktemp("failing")
    data = _damaged_data(dataset, root)
    hwmap = root / "numa1.toml"
    vm = (Path(__file__).resolve().parents[2] / "slurm/hwmaps/vm-2cpu.toml").read_text()
    hwmap.write_text(vm.replace("node = 0", "node = 1"))  # the map's NUMA node, and its NIC's and SSD's
    (root / "a-file").write_text("not a directory")
    bad_ssd = root / "bad-ssd.toml"  # the map's SSD path lies under a plain file
    bad_ssd.write_text(vm.replace('path = "/var/tmp/hvctr"', f'path = "{root / "a-file" / "ssd"}"'))
    try:
        disks = _full_disks(reference, root)
    except pytest.skip.Exception as e:  # not root: the other failing jobs still run
        disks, jobs_without_disk = {}, str(e)
    else:
        jobs_without_disk = ""
    try:
        jobs, where = {}, {}
        for case in [*BAD_INPUTS, "data_truncated", "data_bitflip", "no_loadable_checkpoint", "init_from_other_dim",
                     *disks]:
            flags, np_, resume, run = list(BAD_INPUTS.get(case, ([], None))[0]), 2, False, root / case / "run"
            where[case] = data.get(case, dataset)  # what the test looks at besides the job's output
            if case == "other_world_size":
                copy_run(killed_rank.run, run)
                np_, resume = 3, True
            elif case == "no_loadable_checkpoint":
                for rank_file in copy_run(killed_rank.run, run).glob("checkpoints/ckpt-*/rank-00000.h5"):
                    truncate_half(rank_file)
                resume = True
                where[case] = {p.relative_to(run / "checkpoints"): p.stat().st_size
                               for p in (run / "checkpoints").rglob("*") if p.is_file()}
            elif case == "hwmap_numa_node":
                flags = [f"--topology.hwmap={hwmap}"]
            elif case == "hwmap_ssd_not_a_directory":
                flags = [f"--topology.hwmap={bad_ssd}"]
            elif case == "init_from_other_dim":  # every rank fails loading it, after Horovod started
                flags = ["--init-from", str(reference), "--storage.dim=4"]
            elif case in disks:
                where[case], key = disks[case]
                flags = [f"{key}={where[case]}"]
            log = root / f"{case}.log"
            jobs[case] = (launch(np_, run, data.get(case, dataset), *FLAGS, *flags, resume=resume, log=log), log, run)
        ended = {case: (finish(*job), where[case]) for case, job in jobs.items()}
        yield {**ended, "no_disk": (None, jobs_without_disk)}
    finally:
        for disk, _ in disks.values():
            unmount(disk)


# --- 6. loading runs no code from the files ----------------------------------------------------


def _plain(dtype: np.dtype) -> bool:
    if dtype.names:
        return all(_plain(dtype.fields[n][0]) for n in dtype.names)
    return dtype.kind in "biuf"


def test_checkpoint_files_are_plain_hdf5_and_json(reference):
    ckdir = reference / "checkpoints"
    manifests = list(ckdir.glob("ckpt-*/manifest.json"))
    rank_files = list(ckdir.glob("ckpt-*/rank-*.h5"))
    assert manifests and rank_files
    for path in manifests:
        json.loads(path.read_text())  # JSON, nothing else
    for path in rank_files:
        assert path.read_bytes()[:8] == b"\x89HDF\r\n\x1a\n"
        with h5py.File(path, "r") as f:
            datasets = []
            f.visititems(lambda name, obj: datasets.append(obj) if isinstance(obj, h5py.Dataset) else None)
            assert datasets
            for ds in datasets:  # numbers only: no opaque blobs, no strings, no objects
                assert _plain(ds.dtype), (path, ds.name, ds.dtype)
            for value in f.attrs.values():
                assert isinstance(value, (int, float, str, np.integer, np.floating)), value


# --- a rank that hangs without dying --------------------------------------------------------------


def test_hung_rank_ends_the_job_within_the_stall_timeout(dataset, tmp_path):
    """Rank 1 frozen (SIGSTOP: alive, never reaching its next collective) after checkpoint 1:
    rank 0's watchdog ends the job once its collective has waited train.stall_timeout_s,
    naming the collective; no rank is left behind and the last checkpoint is intact."""
    run, log = tmp_path / "hung", tmp_path / "hung.log"
    p = launch(2, run, dataset, *FLAGS, "--train.stall_timeout_s=4", log=log)
    try:
        rc, seconds = signal_rank_after_checkpoint(p, run, log, seq=1, rank=1, sig=signal.SIGSTOP, grace=60)
    finally:
        if p.poll() is None:
            signal_job(p, signal.SIGKILL)
            p.wait(timeout=60)
    out = log.read_text(errors="replace")
    assert seconds is not None and rc != 0 and seconds >= 4, (rc, seconds, out[-3000:])
    found = re.findall(r"hvctr train: error: rank 0: collective '([^']+)' has waited (\d+) s", out)
    assert len(found) == 1, out[-3000:]
    # one report: rank 1, woken by the job's teardown (SIGCONT, then SIGTERM), sees the gap in
    # its own clock and does not take its frozen time for a wait
    assert out.count(HVCTR_ERROR) == 1, out[-3000:]
    assert int(found[0][1]) >= 4 and "train.stall_timeout_s = 4" in out
    assert not any(sign in out for sign in ("Traceback", "Segmentation fault", "Bus error")), out[-3000:]
    assert_nothing_left(run)
    assert verified_newest(run / "checkpoints")["seq"] >= 1
