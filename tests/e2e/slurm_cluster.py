"""A real one-machine Slurm cluster for the end-to-end tests: munged + slurmctld + slurmd.

Debian's slurm-wlm 22.05 and munge, started as root without systemd or cgroups, every file
under one directory so that it never touches /etc/slurm, /run/munge or another cluster on
the machine:

    root/munge/    private munge key and socket (AuthInfo=socket=...)
    root/slurm.conf, root/state/, root/spool/, root/log/, root/*.pid

- proctrack/linuxproc and task/affinity: nothing needs cgroups.
- MpiDefault=pmix: Debian's OpenMPI has PMIx only (srun --mpi=pmi2 fails).
- NodeName line from `slurmd -C`, RealMemory at most what slurmd detects, and
  SlurmdParameters=config_overrides with a larger CPUs count: without it a job asking more
  tasks than the machine's cores pends forever.
- A requeued job becomes eligible cred_expire + 1 seconds after its requeue (default
  cred_expire 120) and is then started by the next periodic scheduler pass (sched_interval,
  default 60 s): both are short here, so a requeue costs about 6 s instead of 1-3 minutes.

Clients find the cluster through SLURM_CONF (``cluster.env()``). The daemons run in the
foreground as our children and are stopped by their PIDs (and any slurmstepd left behind,
found by the SLURM_CONF it inherited from our slurmd).

    cluster = SlurmCluster(tmp_dir, cpus=4)
    cluster.start()
    try:
        job = cluster.sbatch(["slurm/train.sbatch"])
        record = cluster.wait_done(job.job_id)
    finally:
        cluster.stop()
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("munge", "sinfo", "squeue", "sbatch", "srun", "scontrol", "scancel")
SBIN = ("/usr/sbin", "/sbin")
# Job states after which a job never runs again (a requeued job passes through REQUEUED, PENDING).
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


class ClusterUnavailable(RuntimeError):
    """Slurm or munge is not installed, or we are not root: the tests cannot run here."""


def which(name: str) -> str | None:
    path = os.environ.get("PATH", "") + os.pathsep + os.pathsep.join(SBIN)
    return shutil.which(name, path=path)


class NotRoot(ClusterUnavailable):
    """slurmd must run as root to start jobs as their users."""


def check_prerequisites() -> None:
    """Raise ClusterUnavailable with what is missing and how to get it."""
    missing = [n for n in DAEMONS + CLIENTS if which(n) is None]
    if missing:
        raise ClusterUnavailable(
            f"Slurm/munge not installed (missing: {' '.join(missing)}); "
            "`make setup` installs them (apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        raise NotRoot("the local Slurm cluster needs root: slurmd starts jobs as their users")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_line() -> dict[str, str]:
    """slurmd -C's NodeName line as a dict (NodeName, CPUs, ..., RealMemory)."""
    out = subprocess.run([which("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout
    line = next(l for l in out.splitlines() if l.startswith("NodeName="))
    return dict(kv.split("=", 1) for kv in line.split())


@dataclass
class Job:
    """What sbatch returned."""
    job_id: int
    returncode: int  # sbatch's: with --wait, the job's exit code
    stdout: str
    stderr: str


def exit_code(record: dict[str, str]) -> int:
    """The job's exit code from its scontrol record (ExitCode=code:signal; a signal counts as 128+sig)."""
    code, sig = (int(x) for x in record["ExitCode"].split(":"))
    return code or (128 + sig if sig else 0)


class SlurmCluster:
    def __init__(self, root: Path, cpus: int = 4, partition: str = "debug"):
        self.root = Path(root)
        self.cpus = cpus
        self.partition = partition
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.procs: dict[str, subprocess.Popen] = {}
        self.node = ""

    # --- lifecycle ---------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> None:
        """Write the configuration, start the three daemons, wait until the node is idle."""
        check_prerequisites()
        try:
            self._start_munge(timeout)
            self._write_conf()
            self._spawn("slurmctld", [which("slurmctld"), "-D", "-i", "-f", str(self.conf),
                                      "-L", str(self.root / "log" / "slurmctld.log")])
            self._spawn("slurmd", [which("slurmd"), "-D", "-f", str(self.conf),
                                   "-L", str(self.root / "log" / "slurmd.log")])
            self._wait_idle(timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = 20.0) -> None:
        """Cancel every job, then stop the daemons by PID (SIGTERM, then SIGKILL)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            subprocess.run([which("scancel"), "--full", "--user", "root"], env=self.env(),
                           capture_output=True, timeout=timeout)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.squeue().strip():
                time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is not None:
                _terminate(proc, timeout)
        # slurmstepd double-forks away from slurmd; it inherited our SLURM_CONF, so it is ours.
        for pid in _pids_with_env("SLURM_CONF", str(self.conf)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __enter__(self) -> "SlurmCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- clients ---------------------------------------------------------------------

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = env.get("PATH", "") + os.pathsep + os.pathsep.join(SBIN)
        env.update(extra)
        return env

    def run(self, *cmd: str, check: bool = True, timeout: float = 60.0, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("env", self.env())
        return subprocess.run(list(cmd), capture_output=True, text=True, check=check, timeout=timeout, **kw)

    def sbatch(self, args: list[str], wait: bool = False, timeout: float = 600.0,
               env: dict[str, str] | None = None, cwd: str | Path | None = None) -> Job:
        """Submit a batch job. wait=True runs `sbatch --wait`: it returns when the job has ended
        for good (it follows a requeued job) and its returncode is the job's exit code; it polls
        at 2, 10 and 42 s, then every 32 s, so it may return up to 32 s late (wait_done polls
        every 0.5 s)."""
        cmd = [which("sbatch"), "--parsable"] + (["--wait"] if wait else []) + list(args)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           env=env or self.env(), cwd=cwd)
        m = re.search(r"^(\d+)", r.stdout, re.M)
        if m is None:
            raise RuntimeError(f"sbatch {' '.join(args)} gave no job id (rc {r.returncode}):\n"
                               f"{r.stdout}{r.stderr}\n{self.logs()}")
        return Job(int(m.group(1)), r.returncode, r.stdout, r.stderr)

    def squeue(self) -> str:
        return self.run(which("squeue"), "-h", "-o", "%i %T", check=False).stdout

    def job(self, job_id: int) -> dict[str, str]:
        """scontrol show job as a dict: JobState, ExitCode, Restarts, StdOut, ... ({} once purged)."""
        r = self.run(which("scontrol"), "-o", "show", "job", str(job_id), check=False)
        if r.returncode != 0:
            return {}
        return dict(re.findall(r"(\w+(?::\w+)?)=(\S*)", r.stdout))

    def wait_job(self, job_id: int, done, timeout: float = 300.0, poll: float = 0.5) -> dict[str, str]:
        """Poll the job's record until done(record) is true; that record."""
        deadline = time.monotonic() + timeout
        rec: dict[str, str] = {}
        while time.monotonic() < deadline:
            rec = self.job(job_id)
            if rec and done(rec):
                return rec
            time.sleep(poll)
        raise TimeoutError(f"job {job_id} not done after {timeout}s: {rec}\n{self.logs()}")

    def wait_done(self, job_id: int, timeout: float = 300.0, min_restarts: int = 0) -> dict[str, str]:
        """Until the job has ended for good: a final state, after at least min_restarts requeues."""
        return self.wait_job(job_id, lambda r: r.get("JobState") in FINAL_STATES
                             and int(r.get("Restarts", 0)) >= min_restarts, timeout)

    def logs(self, lines: int = 30) -> str:
        """The daemons' log tails, for failure messages."""
        out = []
        for p in sorted((self.root / "log").glob("*.log")):
            tail = p.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {p} (last {len(tail)} lines)\n" + "\n".join(tail))
        return "\n".join(out)

    # --- internals -------------------------------------------------------------------

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")
        # A new session: a ^C to pytest reaches us, and we stop the daemons in order.
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.env(),
                                            start_new_session=True)
        log.close()

    def _start_munge(self, timeout: float) -> None:
        mdir = self.root / "munge"
        (self.root / "log").mkdir(parents=True, exist_ok=True)
        mdir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        os.chmod(mdir, 0o700)
        key = mdir / "munge.key"
        if not key.exists():
            with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400), "wb") as f:
                f.write(os.urandom(1024))
        self._spawn("munged", [which("munged"), "-F", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={key}", f"--pid-file={mdir / 'munged.pid'}",
                               f"--seed-file={mdir / 'munged.seed'}",
                               f"--log-file={self.root / 'log' / 'munged.log'}"])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs["munged"].poll() is not None:
                raise RuntimeError(f"munged exited with {self.procs['munged'].returncode}\n{self.logs()}")
            cred = subprocess.run([which("munge"), "-n", "-S", str(self.munge_socket)],
                                  capture_output=True)
            if cred.returncode == 0:
                return
            time.sleep(0.2)
        raise TimeoutError(f"munged not answering on {self.munge_socket} after {timeout}s\n{self.logs()}")

    def _write_conf(self) -> None:
        node = node_line()
        self.node = node["NodeName"]
        r = self.root
        for d in ("state", "spool"):
            (r / d).mkdir(exist_ok=True)
        (r / "plugstack.conf").write_text("")  # not /etc/slurm's SPANK plugins
        cpus = max(self.cpus, int(node["CPUs"]))
        memory = int(node["RealMemory"])
        self.conf.write_text(f"""\
# Generated by tests/e2e/slurm_cluster.py: a one-machine cluster, every path under {r}.
ClusterName=hvctrtest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire=5
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
PlugStackConfig={r}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=pmix
SwitchType=switch/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=600
InactiveLimit=0
SlurmdTimeout=60
SlurmctldTimeout=60
MessageTimeout=20
SlurmdParameters=config_overrides
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} Boards=1 SocketsPerBoard=1 CoresPerSocket={cpus} ThreadsPerCore=1 RealMemory={memory} State=UNKNOWN
PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}\n{self.logs()}")
            r = self.run(which("sinfo"), "-h", "-N", "-o", "%T", check=False, timeout=30)
            state = r.stdout.strip()
            if state == "idle":
                return
            time.sleep(0.3)
        raise TimeoutError(f"node not idle after {timeout}s (sinfo: {state!r})\n{self.logs()}")


def _terminate(proc: subprocess.Popen, timeout: float) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


def _pids_with_env(name: str, value: str) -> list[int]:
    """PIDs of processes whose environment has name=value exactly."""
    want = f"{name}={value}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if want in (d / "environ").read_bytes().split(b"\0"):
                pids.append(int(d.name))
        except OSError:
            continue
    return pids
