"""distributed.backend = torch trains the model Horovod trains, bit for bit.

TorchComm (hvctr.distributed.torch_comm) sums in the order OpenMPI's ring allreduce sums under
Horovod (pinned by job_env: coll_tuned_allreduce_algorithm = 4), so at 2, 3 and 4 ranks the two
engines give the same bits: every rank's dense state (parameters, Adam's moments), every sparse
row, the validation metrics. The runs cover both threads' collectives (the prefetch thread's
warm and pull ahead, the push's rows left behind, sent by either thread: storage.push_behind =
on), merge.shared_rows' every-step exchange, sync mode, and at 4 ranks in 2 virtual nodes the
hierarchical dense merge.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.helpers import make_dataset, train
from tests.e2e.test_simulate import SAME, compare, evaluation

CASES = {
    "2-kstep": (2, ["--merge.every_k_steps=4", "--storage.push_behind=on"]),
    "3-kstep-shared": (3, ["--merge.every_k_steps=4", "--storage.push_behind=on", "--merge.shared_rows=64"]),
    "3-sync": (3, ["--merge.mode=sync", "--train.max_steps=8"]),
    "4-hierarchical": (4, ["--merge.every_k_steps=4", "--topology.ranks_per_virtual_node=2",
                           "--topology.hierarchical_allreduce=true", "--merge.dense_every_steps=2"]),
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory)


@pytest.mark.parametrize("case", list(CASES))
def test_torch_distributed_trains_horovods_model_bit_for_bit(dataset, tmp_path, case):
    np_, flags = CASES[case]
    flags = [*SAME, *flags]
    runs = {b: tmp_path / b for b in ("horovod", "torch")}
    for backend, run in runs.items():
        train(np_, run, dataset, *flags, f"--distributed.backend={backend}")
    compare(runs["horovod"], runs["torch"])
    assert evaluation(runs["horovod"]) == evaluation(runs["torch"])
    summaries = {b: json.loads((r / "summary.json").read_text()) for b, r in runs.items()}
    assert summaries["torch"]["steps"] == summaries["horovod"]["steps"] > 0
    if "shared" in case:
        assert summaries["torch"]["shared_rows"] == summaries["horovod"]["shared_rows"]
    if "push_behind=on" in " ".join(flags):  # rows were left behind, and sent by the "behind" stream
        assert summaries["torch"]["exchange"].get("push_behind_rows", 0) > 0
    if "hierarchical" in case:
        assert summaries["torch"]["dense_merge"] == "hierarchical" == summaries["horovod"]["dense_merge"]
    assert (runs["torch"] / "config.toml").read_text().count('backend = "torch"') == 1
