"""Stands in for ``python -m mpi4py -m hvctr train`` in the sweep worker tests (hvctr sweep run
--launcher "python tests/unit/fake_train.py" puts it in front of the real command, which it
reads but does not run): writes the run directory's summary.json as hvctr train would, with a
validation AUC that depends on train.dense_lr and the steps, in milliseconds instead of a
minute. Each call is recorded in <run_dir>/calls.txt (its max_steps and pid).

FAKE_TRAIN_SLEEP=S, FAKE_TRAIN_SLEEP_FROM=N: sleep S seconds first when max_steps >= N; SIGUSR1
ends it with 75, as it does hvctr train (after a checkpoint). FAKE_TRAIN_FAIL=TEXT: exit 3 when
the run directory's name contains TEXT. Like hvctr train without storage.shard_dir, it leaves a
working shard under the run directory (shards/shard-r00000.h5, 64 KiB here).
"""

import json
import math
import os
import signal
import sys
import time
from pathlib import Path

args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
run = Path(args["train.run_dir"])
steps = int(args["train.max_steps"])
run.mkdir(parents=True, exist_ok=True)
with open(run / "calls.txt", "a") as f:
    f.write(f"{steps} {os.getpid()}\n")
signal.signal(signal.SIGUSR1, lambda *_: sys.exit(75))
if os.environ.get("FAKE_TRAIN_FAIL") and os.environ["FAKE_TRAIN_FAIL"] in run.name:
    print("fake_train: this run fails, for the test", file=sys.stderr)
    sys.exit(3)
if steps >= int(os.environ.get("FAKE_TRAIN_SLEEP_FROM", "0")):
    time.sleep(float(os.environ.get("FAKE_TRAIN_SLEEP", "0")))
(run / "shards").mkdir(exist_ok=True)
(run / "shards" / "shard-r00000.h5").write_bytes(bytes(64 << 10))
lr = float(args.get("train.dense_lr", 1e-3))
auc = 0.76 - 0.03 * (math.log10(lr) + 2) ** 2 - 0.05 / steps
(run / "summary.json").write_text(json.dumps({"steps": steps, "eval": {"auc": auc, "logloss": 1 - auc}}))
