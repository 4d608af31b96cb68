"""``hvctr simulate --ranks W`` trains the model ``mpirun -np W ... hvctr train`` trains, bit for bit.

Both run the same configuration on the same small data; the test compares every rank's dense
state of the final checkpoint (parameters, Adam's m and v and step: with merge.states =
params the moments differ per rank), every sparse row (w, w1, m, v, step count) and the
validation metrics.

Why bit-equal is possible, and what it takes:
- The simulation runs the same Trainer per rank; collectives differ only in who moves the
  bytes. Exchanges, gathers and integer reductions are exact; the sparse owner merge sums in
  ascending source rank in both.
- Float allreduces: OpenMPI's algorithm is pinned to ring (coll_tuned_allreduce_algorithm =
  4, as every equality test pins it), and ThreadComm adds in that ring's order over Horovod's
  fusion buffer (block j of W summed from rank j upwards). With W = 2 any order gives the
  same bits (addition commutes); W = 3 is where the order shows.
- Torch's thread count changes the bits of the dense model's matmuls and reductions, in real
  jobs too: both sides run ``train.threads = 1`` (what an unbound mpirun rank uses).

Where the order must differ (``--reduce-order rank``: ascending rank order, not OpenMPI's),
the models agree within a tolerance instead: after 24 steps at W = 3, |difference| <= 1e-4 for
dense tensors and sparse rows (seen: about 1e-7 dense, 1e-5 sparse), because the last bits of
each merged sum differ and training carries them on.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest

from hvctr.cli import main
from hvctr.formats import RowLayout
from tests.conftest import VENV_PY
from tests.e2e.helpers import SMALL, final_model, make_dataset, train

SAME = ["--train.threads=1", "--train.max_steps=24"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory)


def simulate(ranks: int, run_dir: Path, data: Path, *flags: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [VENV_PY, "-m", "hvctr", "simulate", "--ranks", str(ranks), f"--data.train_dir={data}",
           f"--train.run_dir={run_dir}", *SMALL, *flags]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if check and r.returncode != 0:
        raise AssertionError(f"simulate failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    return r


def every_rank_dense(run_dir: Path) -> dict[tuple[str, str], np.ndarray]:
    ck = run_dir / "checkpoints"
    last = max((json.loads(p.read_text()) for p in ck.glob("ckpt-*/manifest.json")), key=lambda m: m["seq"])
    out = {}
    for rec in last["files"]:
        with h5py.File(ck / f"ckpt-{last['seq']:06d}" / rec["file"], "r") as f:
            out.update({(rec["file"], k): v[...] for k, v in f["dense"].items()})
    return out


def compare(a: Path, b: Path, atol: float = 0.0) -> None:
    da, db = every_rank_dense(a), every_rank_dense(b)
    assert da.keys() == db.keys()
    for k in da:
        if atol:
            np.testing.assert_allclose(da[k], db[k], rtol=0, atol=atol, err_msg=str(k))
        else:
            assert np.array_equal(da[k], db[k]), f"dense {k} differs by up to {np.abs(da[k] - db[k]).max()}"
    _, sa = final_model(a)
    _, sb = final_model(b)
    assert sa.keys() == sb.keys()
    keys = sorted(sa)
    ra, rb = np.stack([sa[k] for k in keys]), np.stack([sb[k] for k in keys])
    if atol:
        np.testing.assert_allclose(ra, rb, rtol=0, atol=atol)
    else:
        assert np.array_equal(ra, rb), f"sparse rows differ by up to {np.abs(ra - rb).max()}"


def evaluation(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())["eval"]


@pytest.mark.parametrize("np_,mode", [(2, "kstep"), (3, "kstep"), (3, "sync"), (3, "kstep-dense2"), (3, "kstep-matched"),
                                      (3, "kstep-powersgd"), (3, "kstep-shared"),
                                      (3, "kstep-shared-fp32"), (3, "kstep-rowwise_adam"),
                                      (3, "kstep-rowwise_adagrad"), (3, "sync-rowwise_adagrad")])
def test_simulation_equals_mpirun_bit_for_bit(dataset, tmp_path, np_, mode):
    flags = [*SAME, f"--merge.mode={mode.split('-')[0]}", "--merge.every_k_steps=4"]
    if mode.startswith("sync"):
        flags[1] = "--train.max_steps=12"
    if "rowwise" in mode:  # the row-wise states: the owners average Adam's, sum Adagrad's increments (kstep), step (sync)
        flags += [f"--train.sparse_optimizer={mode.split('-')[1]}"]
    if mode == "kstep-dense2":  # the dense model also merges inside each window, its moves in fp16
        flags += ["--merge.dense_every_steps=2", "--merge.compression=fp16"]
    if mode == "kstep-matched":  # the owners' rule of 16 ranks and more (merge.sparse_rule = auto), forced at 3
        flags += ["--merge.sparse_rule=matched"]
    if mode == "kstep-powersgd":  # the dense gradients averaged every step as rank-4 factors
        flags += ["--merge.dense_gradients=powersgd"]
    if mode == "kstep-shared":  # the rows the most ranks touch synchronised every step at their owners
        flags += ["--merge.shared_rows=64"]
    if mode == "kstep-shared-fp32":  # the same, their gradients and values as float32 on the wire
        flags += ["--merge.shared_rows=64", "--merge.shared_rows_bf16=false"]
    train(np_, tmp_path / "mpi", dataset, *flags, "--storage.push_behind=on")  # auto: off on 2 cores
    r = simulate(np_, tmp_path / "sim", dataset, *flags)
    compare(tmp_path / "mpi", tmp_path / "sim")
    assert evaluation(tmp_path / "mpi") == evaluation(tmp_path / "sim")  # float64 histogram sums, same order
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert line["ranks"] == np_ and line["auc"] == evaluation(tmp_path / "sim")["auc"]
    assert line["peak_rss_bytes"] > 0
    summary = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert summary["simulate"]["ranks"] == np_ and summary["steps"] == int(flags[1].split("=")[1])
    assert sorted(p.name for p in (tmp_path / "sim" / "logs").iterdir()) == [f"rank-{i:05d}.log" for i in range(np_)]
    if "rowwise" in mode:
        optimizer = mode.split("-")[1]
        _, rows = final_model(tmp_path / "mpi")
        assert {r.size for r in rows.values()} == {RowLayout(8, optimizer).width}
        assert all(r[-1] > 0 for r in rows.values())  # every stored row stepped (its step column)
    if not mode.startswith("sync"):  # mpirun's pushes left rows behind for the prefetch thread (storage.push_behind), the simulation's not
        behind = [json.loads((tmp_path / d / "summary.json").read_text())["exchange"].get("push_behind_rows", 0)
                  for d in ("mpi", "sim")]
        assert behind[0] > 0 and behind[1] == 0, behind
    if mode == "kstep-dense2":  # two dense merges a window of 4, each the parameters' moves in fp16 and 2 flags
        dense = every_rank_dense(tmp_path / "mpi")
        first = min(f for f, _ in dense)
        params = sum(v.size for (f, k), v in dense.items() if f == first and k.startswith("param."))
        windows = 24 // 4
        for s in (summary, json.loads((tmp_path / "mpi" / "summary.json").read_text())):
            assert s["dense_merge_calls"] == 2 * windows and s["dense_merge_bytes"] == 2 * windows * (2 * params + 8)
    if mode == "kstep-powersgd":  # every rank took the same dense steps: one model, never merged
        dense = every_rank_dense(tmp_path / "mpi")
        files = sorted({f for f, _ in dense})
        assert len(files) == np_
        for (f, k), v in dense.items():
            if k.startswith("param."):
                assert np.array_equal(v, dense[(files[0], k)]), (f, k)
        s = json.loads((tmp_path / "mpi" / "summary.json").read_text())
        assert s["dense_merge_calls"] == 2 * 24 + 24 // 4  # two allreduces a step, the flags a window
    if mode == "kstep-shared":  # 64 rows a window (the owners' quotas, 22 each, filled), 24 steps
        for s in (summary, json.loads((tmp_path / "mpi" / "summary.json").read_text())):
            assert s["shared_rows"]["rows"] == 66 * (24 // 4)
            # only touched rows travel: less than the allreduce of all 66 a step this replaced
            assert 0 < s["shared_rows"]["bytes_sent"] < 24 * 66 * (8 + 2) * 4
        sent = [json.loads((tmp_path / d / "summary.json").read_text())["shared_rows"]["bytes_sent"]
                for d in ("mpi", "sim")]
        assert sent[0] == sent[1]
    if np_ == 3 and mode == "kstep":
        # the ascending-rank order differs from OpenMPI's ring: equal within the stated tolerance
        simulate(np_, tmp_path / "sim-rank", dataset, *flags, "--reduce-order=rank")
        compare(tmp_path / "mpi", tmp_path / "sim-rank", atol=1e-4)
        # and hvctr export reads a simulated run as it reads a real one
        assert main(["export", "--run-dir", str(tmp_path / "sim"), "--out", str(tmp_path / "export")]) == 0
        assert json.loads((tmp_path / "export" / "manifest.json").read_text())["world_size"] == 3


def test_simulation_reports_input_errors_once(dataset, tmp_path):
    r = simulate(7, tmp_path / "sim", dataset, check=False)  # 6 data shards: rank 6 would read nothing
    assert r.returncode == 2
    assert "hvctr simulate: error:" in r.stderr and "fewer than 7 ranks" in r.stderr
    assert "Traceback" not in r.stderr
