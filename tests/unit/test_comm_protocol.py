"""The three communicators implement hvctr.distributed.protocol's protocols, signature for signature.

- hvctr.distributed.comm.Comm (Horovod) and hvctr.sim.comm.ThreadComm: ``Comm``;
- data_prep.mpi.Comm and MPIComm: ``ObjectComm`` (broadcast_object, allgather_object, barrier).
The Horovod class and MPIComm are inspected as classes, never instantiated (that would start
Horovod or MPI). The protocol module itself loads neither torch, Horovod nor mpi4py.
"""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import pytest

from hvctr.distributed.protocol import Comm, ObjectComm
from tests.conftest import REPO

_P = inspect.Parameter


def _members(proto: type) -> tuple[list[str], dict[str, object]]:
    """(data attribute names, {method name: function}) the protocol declares, its bases' included."""
    data: list[str] = []
    methods: dict[str, object] = {}
    for k in reversed(proto.__mro__):
        if k not in (ObjectComm, Comm):
            continue
        data += [n for n in k.__dict__.get("__annotations__", {}) if n not in data]
        methods.update({n: f for n, f in k.__dict__.items() if inspect.isfunction(f) and not n.startswith("_")})
    return data, methods


def _has_data(cls: type, obj: object | None, name: str) -> bool:
    if obj is not None:
        return hasattr(obj, name)
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    return any(name in k.__dict__.get("__annotations__", {}) or name in k.__dict__ for k in cls.__mro__)


def _signature_problems(name: str, want, got) -> list[str]:
    """How ``got`` fails to accept every call ``want``'s signature allows (empty: it accepts them)."""
    w = [p for p in inspect.signature(want).parameters.values()][1:]  # without self
    g = [p for p in inspect.signature(got).parameters.values()][1:]
    out = []
    for k, p in enumerate(w):
        if k >= len(g) or g[k].name != p.name:
            out.append(f"{name}: parameter {k + 1} should be {p.name!r}, is "
                       f"{g[k].name if k < len(g) else 'missing'!r}")
        elif g[k].kind not in (_P.POSITIONAL_OR_KEYWORD, p.kind):
            out.append(f"{name}: parameter {p.name!r} is {g[k].kind.description}, the protocol's {p.kind.description}")
    for p in g[len(w):]:
        if p.default is _P.empty and p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD):
            out.append(f"{name}: extra parameter {p.name!r} without a default")
    return out


def protocol_problems(cls: type, proto: type, obj: object | None = None) -> list[str]:
    """What ``cls`` (or its instance ``obj``) lacks to implement ``proto``; [] when nothing."""
    data, methods = _members(proto)
    out = [f"attribute {n!r} missing" for n in data if not _has_data(cls, obj, n)]
    for n, f in methods.items():
        impl = getattr(cls, n, None)
        if impl is None or not callable(impl):
            out.append(f"method {n!r} missing")
        else:
            out += _signature_problems(n, f, impl)
    return out


def test_the_protocol_module_loads_nothing_heavy():
    code = ("import sys, hvctr.distributed.protocol, data_prep.mpi\n"
            "print('LOADED', [m for m in ('torch', 'horovod', 'mpi4py') if m in sys.modules])\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "LOADED []" in r.stdout, (r.stdout, r.stderr)


def test_object_comm_is_a_part_of_comm():
    data, methods = _members(ObjectComm)
    all_data, all_methods = _members(Comm)
    assert set(data) < set(all_data) and set(methods) < set(all_methods)
    assert {"rank", "size"} <= set(data) and {"broadcast_object", "allgather_object", "barrier"} == set(methods)


def test_the_simulation_implements_comm():
    from hvctr.sim.comm import ThreadComm, ThreadWorld

    comm = ThreadComm(ThreadWorld(2), 1)
    assert protocol_problems(ThreadComm, Comm, comm) == []
    assert isinstance(comm, Comm) and isinstance(comm, ObjectComm)


def test_horovods_comm_implements_comm_inspected_as_a_class():
    pytest.importorskip("horovod.torch")
    from hvctr.distributed.comm import Comm as HorovodComm

    assert protocol_problems(HorovodComm, Comm) == []


def test_torch_distributed_comm_implements_comm_inspected_as_a_class():
    from hvctr.distributed.torch_comm import TorchComm

    assert protocol_problems(TorchComm, Comm) == []


def test_data_preps_comms_implement_object_comm():
    from data_prep.mpi import Comm as OneProcess, MPIComm

    one = OneProcess()
    assert protocol_problems(OneProcess, ObjectComm, one) == []
    assert isinstance(one, ObjectComm)
    assert protocol_problems(MPIComm, ObjectComm) == []  # the class: an instance would start MPI
    assert one.broadcast_object({"a": 1}, 0, "x") == {"a": 1} and one.allgather_object(3, "x") == [3]


def test_the_check_sees_a_missing_or_misnamed_collective():
    class Old:  # data_prep's helper before the protocol: bcast, and allgather of objects
        rank, size = 0, 1

        def bcast(self, obj):
            return obj

        def allgather_object(self, value, name):
            return [value]

        def barrier(self, timeout):
            pass

    problems = protocol_problems(Old, ObjectComm, Old())
    assert "method 'broadcast_object' missing" in problems
    assert any("allgather_object: parameter 1 should be 'obj'" in p for p in problems)
    assert any("barrier: extra parameter 'timeout'" in p for p in problems)
    assert not isinstance(Old(), ObjectComm)
