"""Two "nodes" on one machine for mpirun: network and UTS namespaces joined by a veth pair.

    root namespaces (this test)          nsenter
    +------------------------------+     +-------------------------------------------+
    | pytest                       |---->| node 0: netns + UTS ns, host hvctr-node0   |
    +------------------------------+     |   veth 10.77.0.1/24, lo; TMPDIR: tmpfs 0   |
                                         |   mpirun (the job's node 0, as on the first |
                                         |   node of an allocation) + ranks 0, 1       |
                                         +---------------------+---------------------+
                                                               | veth pair: the only link
                                         +---------------------+---------------------+
                                         | node 1: netns + UTS ns, host hvctr-node1   |
                                         |   veth 10.77.0.2/24, lo; TMPDIR: tmpfs 1   |
                                         |   orted (started by the rsh agent) + ranks  |
                                         +-------------------------------------------+

mpirun starts inside node 0's namespaces and reaches node 1 through an rsh agent (``agent``: a
script that plays ssh: ``agent HOST COMMAND`` runs COMMAND with ``nsenter`` in HOST's
namespaces, in the environment of a fresh login, so only what OpenMPI forwards reaches node
1's ranks, as over ssh). OpenMPI is kept to TCP on the veth subnet (``btl tcp,self``: no
shared-memory transport at all; ``btl_tcp_if_include`` and ``oob_tcp_if_include`` name the
subnet), so every byte between the nodes crosses the veth pair. The namespaces share the file
system (the "shared file system" of the run and data directories); each node gets its own
tmpfs as $TMPDIR (its "node-local disk").

Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN), iproute2's ``ip``, util-linux's ``unshare`` and
``nsenter``. Names carry this process's pid, so two test sessions do not collide; ``stop``
ends every process left in the namespaces, then removes them (the veth pair goes with them).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

from tests.conftest import mount_tmpfs, unmount

SUBNET = "10.77.0.0/24"
ADDRESSES = ("10.77.0.1", "10.77.0.2")
HOSTS = ("hvctr-node0", "hvctr-node1")
SCRATCH_BYTES = 256 << 20  # each node's TMPDIR: room for 2 ranks' working shards of the e2e SMALL config


class NodesUnavailable(Exception):
    """Why the namespaces cannot be made here (the test skips with it)."""


def check_prerequisites() -> None:
    if os.geteuid() != 0:
        raise NodesUnavailable("needs root: network and UTS namespaces, veth pairs and tmpfs mounts")
    missing = [t for t in ("ip", "unshare", "nsenter", "mpirun", "mount") if shutil.which(t) is None]
    if missing:
        raise NodesUnavailable(f"missing tools: {', '.join(missing)} (iproute2, util-linux, OpenMPI)")
    probe = f"hvctr-probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise NodesUnavailable(f"`ip netns add` fails here: {r.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)


def _run(*cmd: str) -> None:
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")


def _ns_inode(path: str | Path) -> int:
    return os.stat(path).st_ino


class TwoNodes:
    """``start()`` makes the nodes, ``stop()`` removes everything (safe after a partial start)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        tag = f"hvctr{os.getpid()}"
        self.netns = [f"{tag}-node{i}" for i in range(2)]
        # one interface name on both nodes (each end lives in its own namespace), as a cluster's nodes
        # name their NICs alike: GLOO_SOCKET_IFNAME names it once for every rank (15 chars at most)
        self.veth = [f"hv{os.getpid()}"[:15]] * 2
        self.uts = [workdir / f"uts-node{i}" for i in range(2)]  # bind mounts that keep the UTS namespaces
        self.scratch = [workdir / f"scratch-node{i}" for i in range(2)]
        self.agent = workdir / "rsh-agent.sh"
        self._made: list[tuple[str, object]] = []  # what stop() undoes, in reverse

    # --- set-up ----------------------------------------------------------------------------

    def start(self) -> "TwoNodes":
        for i in range(2):
            _run("ip", "netns", "add", self.netns[i])
            self._made.append(("netns", self.netns[i]))
            self.uts[i].touch()
            _run("unshare", f"--uts={self.uts[i]}", "hostname", HOSTS[i])  # a persistent UTS ns, named
            self._made.append(("uts", self.uts[i]))
        _run("ip", "link", "add", self.veth[0], "netns", self.netns[0], "type", "veth",
             "peer", "name", self.veth[1], "netns", self.netns[1])
        for i in range(2):
            _run("ip", "-n", self.netns[i], "addr", "add", f"{ADDRESSES[i]}/24", "dev", self.veth[i])
            _run("ip", "-n", self.netns[i], "link", "set", "lo", "up")
            _run("ip", "-n", self.netns[i], "link", "set", self.veth[i], "up")
            mount_tmpfs(self.scratch[i], SCRATCH_BYTES)
            self._made.append(("tmpfs", self.scratch[i]))
        self._write_agent()
        return self

    def _enter(self, i: int) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.netns[i]}", f"--uts={self.uts[i]}", "--"]

    def _write_agent(self) -> None:
        login = [f"PATH={os.environ.get('PATH', '/usr/bin:/bin')}", f"HOME={os.environ.get('HOME', '/root')}"]
        cases = "".join(
            f"  {HOSTS[i]}) exec {shlex.join([*self._enter(i), 'env', '-i', *login, f'TMPDIR={self.scratch[i]}'])}"
            f' /bin/sh -c "$*" ;;\n' for i in range(2))
        self.agent.write_text(f"""#!/bin/sh
# rsh agent for mpirun (--mca plm_rsh_agent): "agent HOST COMMAND..." runs COMMAND in HOST's
# network and UTS namespaces, with a fresh login's environment (as ssh would) and the node's
# own TMPDIR. Written by tests/e2e/netns_nodes.py.
host=$1; shift
case "$host" in
{cases}  *) echo "$0: unknown host $host" >&2; exit 255 ;;
esac
""")
        self.agent.chmod(0o755)

    # --- use -------------------------------------------------------------------------------

    def mpirun_prefix(self, ranks_per_node: int) -> list[str]:
        """The start of a command line that runs mpirun in node 0 with ranks on both nodes
        (the mpirun arguments that choose hosts, agent and transport follow ``mpirun``)."""
        return [*self._enter(0), "env", f"TMPDIR={self.scratch[0]}", "mpirun",
                "--host", ",".join(f"{h}:{ranks_per_node}" for h in HOSTS),
                "--mca", "plm_rsh_agent", str(self.agent),
                "--mca", "btl", "tcp,self",
                "--mca", "btl_tcp_if_include", SUBNET,
                "--mca", "oob_tcp_if_include", SUBNET]

    def tx_bytes(self) -> list[int]:
        """Bytes each node has sent over its end of the veth pair so far."""
        out = []
        for i in range(2):
            r = subprocess.run(["ip", "netns", "exec", self.netns[i], "cat",
                                f"/sys/class/net/{self.veth[i]}/statistics/tx_bytes"],
                               capture_output=True, text=True, timeout=30, check=True)
            out.append(int(r.stdout))
        return out

    def pids(self) -> list[int]:
        """Every process inside either node's network namespace."""
        inodes = {_ns_inode(f"/run/netns/{n}") for n in self.netns if os.path.exists(f"/run/netns/{n}")}
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.stat(f"/proc/{entry}/ns/net").st_ino in inodes:
                        found.append(int(entry))
                except OSError:
                    continue
        return found

    def kill_all(self) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # --- tear-down -------------------------------------------------------------------------

    def stop(self) -> None:
        """Ends what still runs in the nodes and removes namespaces, veth pair and mounts.
        Every step is tried, whatever failed before it."""
        self.kill_all()
        for kind, what in reversed(self._made):
            if kind == "netns":  # deleting either namespace destroys the veth pair
                subprocess.run(["ip", "netns", "del", str(what)], capture_output=True, timeout=30)
            elif kind == "uts":
                subprocess.run(["umount", str(what)], capture_output=True, timeout=30)
            elif kind == "tmpfs":
                unmount(Path(str(what)))
        self._made.clear()
