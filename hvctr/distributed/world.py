"""The MPI world before Horovod starts: rank, size, and agreeing on set-up errors.

Light on purpose (mpi4py only, no torch, no Horovod): it runs before Horovod starts, and a
job with a bad config or bad input stops there.

A user error found by one rank must stop every rank, be reported once, and never leave a rank
waiting in a collective. ``agree_on_errors`` gets there without guessing: every rank runs the
same checks, none of which communicates, then all meet in one allgather of "my error, if
any". Rank 0 reports each distinct message once, with the ranks that hit it, and every rank
raises ``AgreedError``; the command line prints it where ``report`` is true.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar

import numpy as np

if TYPE_CHECKING:
    from hvctr.distributed.protocol import ObjectComm

T = TypeVar("T")

# Horovod's tensor fusion buffer, HOROVOD_FUSION_THRESHOLD bytes: a rank's dense merge is packed
# into it (a grouped allreduce larger than it goes in several cycles). Horovod's own default kept
# 128 MiB of anonymous memory a rank resident (measured at 2 ranks, issue 26) for a dense merge
# of a few MB; hvctr sets 16 MiB where the environment does not say (hvctr.distributed.comm),
# and hvctr simulate cuts its ring blocks at the same size (hvctr.sim.comm).
FUSION_THRESHOLD_BYTES = 16 << 20


def fusion_threshold_bytes(environ=os.environ) -> int:
    """The fusion buffer's size for this job: HOROVOD_FUSION_THRESHOLD where set, else hvctr's."""
    return int(environ.get("HOROVOD_FUSION_THRESHOLD", FUSION_THRESHOLD_BYTES))


def fusion_chunks(sizes: list[tuple[int, int]], threshold: int) -> list[list[int]]:
    """(index, bytes) of a grouped allreduce's tensors of one dtype, in list order -> the indices
    each fusion buffer packs: a tensor joins the current buffer while the buffer stays within
    ``threshold`` bytes, else starts the next (one larger than it goes alone). The summation
    order of hvctr.sim.comm and hvctr.distributed.torch_comm follows these buffers."""
    chunks: list[list[int]] = []
    size = 0
    for i, b in sizes:
        if chunks and size + b <= threshold:
            chunks[-1].append(i)
            size += b
        else:
            chunks.append([i])
            size = b
    return chunks


def ring_blocks(count: int, n: int) -> list[int]:
    """The lengths of the n blocks OpenMPI's ring allreduce cuts ``count`` elements into: the
    first ``count % n`` one element longer. Block j is summed from rank j upwards."""
    late, split = divmod(count, n)
    return [late + 1 if j < split else late for j in range(n)]


class AgreedError(ValueError):
    """The same user error on every rank, decided together; ``report``: print it here."""

    def __init__(self, message: str, report: bool) -> None:
        super().__init__(message)
        self.report = report


def _world():
    from mpi4py import MPI

    return MPI


def world_rank() -> int:
    """This process's MPI rank before Horovod starts (0 outside MPI)."""
    MPI = _world()
    return MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() else 0


def world_size() -> int:
    MPI = _world()
    return MPI.COMM_WORLD.Get_size() if MPI.Is_initialized() else 1


def agree_on_errors(error: str | None) -> list[tuple[str, list[int]]]:
    """Every rank's set-up error gathered on every rank: [(message, ranks that hit it)].

    Collective over COMM_WORLD: every rank must call it, failed or not. Messages travel as
    JSON bytes (nothing received is unpickled).
    """
    MPI = _world()
    world = MPI.COMM_WORLD
    payload = np.frombuffer(json.dumps(error).encode(), dtype=np.uint8)
    lengths = np.zeros(world.Get_size(), dtype=np.int64)
    # comm: mpi4py allgather of each rank's error length, then of the errors (before Horovod starts)
    world.Allgather(np.array([payload.size], dtype=np.int64), lengths)
    data = np.empty(int(lengths.sum()), dtype=np.uint8)
    world.Allgatherv(payload, [data, lengths])
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    return group_errors([json.loads(data[offsets[r]:offsets[r + 1]].tobytes().decode()) for r in range(lengths.size)])


def group_errors(per_rank: list[str | None]) -> list[tuple[str, list[int]]]:
    """[(message, ranks that hit it)] from each rank's error or None, in order of first rank."""
    found: dict[str, list[int]] = {}
    for r, msg in enumerate(per_rank):
        if msg is not None:
            found.setdefault(msg, []).append(r)
    return list(found.items())


def raise_agreed(errors: list[tuple[str, list[int]]], rank: int, size: int) -> None:
    """Raises AgreedError for the gathered errors (reported by rank 0 only); no-op when none."""
    if not errors:
        return
    lines = []
    for msg, ranks in errors:
        who = "every rank" if len(ranks) == size else "rank " + ",".join(map(str, ranks))
        lines.append(msg if len(errors) == 1 and len(ranks) == size else f"{who}: {msg}")
    raise AgreedError("\n".join(lines), report=rank == 0)


def check_collectively(check, size: int):
    """Runs ``check()`` on every rank, agrees on its ValueErrors, returns its result.

    ``check`` must not communicate. On any rank's error every rank raises AgreedError.
    """
    try:
        result, error = check(), None
    except ValueError as e:
        result, error = None, str(e)
    raise_agreed(agree_on_errors(error), world_rank(), size)
    return result


# Where a job's first error report is recorded (set once Horovod is up: hvctr.train.cmd). Its
# creation with O_EXCL decides which rank prints: the first to fail; the others only log.
_error_gate: Path | None = None
SECONDARY_DELAY_S = 2.0  # a rank that fails because another did waits this long before reporting


def set_error_gate(path: str | Path | None) -> None:
    """From now on, ``report_error`` prints once per job: ``path``, the same on every rank (a
    shared directory, a name unique to this start), is created by the rank that reports."""
    global _error_gate
    _error_gate = None if path is None else Path(path)


def report_error(line: str, secondary: bool = False) -> bool:
    """Prints ``line`` to stderr in one write (lines of ranks writing at once never mix), once
    per job where a gate is set: the rank that creates the gate file prints (and records the
    line in it), the others print nothing. ``secondary``: an error that follows another rank's
    (Horovod shut down under us): it waits SECONDARY_DELAY_S first, so that the cause, if it is
    reported at all, is the report. A gate that cannot be created for another reason than that it
    exists (a full or read-only disk) does not silence the report. Returns whether it printed."""
    data = (line.rstrip("\n") + "\n").encode(errors="replace")
    if _error_gate is not None:
        if secondary:
            time.sleep(SECONDARY_DELAY_S)
        try:
            fd = os.open(_error_gate, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            return False
        except OSError:
            pass
        else:
            try:
                os.write(fd, data)
            except OSError:
                pass
            finally:
                os.close(fd)
    sys.stderr.flush()
    try:
        os.write(sys.stderr.fileno(), data)
    except (AttributeError, OSError, ValueError):  # stderr replaced by an object without a file (tests)
        sys.stderr.write(data.decode())
    return True


def abort_job(code: int) -> None:
    """Ends every rank at once (MPI_Abort) when this process is one of several MPI ranks.

    For an error of this rank alone (its data shard, its disk) while the others may wait in
    a collective: left to Horovod's shutdown at exit, each of them would print a traceback
    of its own. A no-op outside MPI or alone.
    """
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(code)


def agree_on(comm: ObjectComm, fn: Callable[[], T], name: str) -> T:
    """``fn()`` on every rank of ``comm``; if it raised ValueError on any, every rank raises
    AgreedError (rank 0 reports each distinct message once, with its ranks). The body of
    ``Comm.agree`` and of the simulation's ``ThreadComm.agree``. ``fn`` must not communicate."""
    try:
        result, error = fn(), None
    except ValueError as e:
        result, error = None, str(e)
    # comm: allgather of every rank's error (None when it succeeded)
    raise_agreed(group_errors(comm.allgather_object(error, name=name)), comm.rank, comm.size)
    return result
