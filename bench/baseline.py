"""The reference points hvctr's throughput is reported against, on the same data and model.

- ``plain``: plain single-process PyTorch, everything in RAM: the keys of the training set
  mapped once, up front, to rows of ONE ``nn.Embedding`` (sparse gradients, SparseAdam), the
  same DNN as hvctr (hvctr.models) with Adam, ``--threads`` torch threads (2 by default). It
  reports training samples/s and validation AUC, logloss and COPC (hvctr.metrics).
- ``torchrec``: the library an hvctr user would pick instead: TorchRec's
  FusedEmbeddingBagCollection (fbgemm's CPU kernels, the optimiser fused into the backward)
  over the same one table, the same DNN with Adam, ``--threads`` threads. fbgemm has no CPU
  Adam: the table trains with fused rowwise Adagrad (``--torchrec-optimizer``). Optional: the
  ``bench`` extra installs it (setup.cfg); where it is absent the run is skipped with a line
  saying so (``{"system": "torchrec", "skipped": why}``).
- ``ceiling``: the MLP alone on random inputs (forward, backward, Adam), run as
  ``--ceiling-procs`` processes of 1 thread at once (what 2 ranks could reach on this machine
  if embeddings, data and merges cost nothing), and as one process of ``--threads`` threads.
- ``floor``: the same, but the MLP also computes the gradient of its embedding input, as every
  embedding model must (the first layer's input-gradient GEMM: about a third more work), and
  takes it in blocks as hvctr's DNN does (hvctr.models.linear_over_blocks): the compute an
  hvctr step cannot avoid. hvctr against the floor says how much of its time is its own
  overhead; against the ceiling, what the embeddings cost in all.

Every result is one JSON line, so a benchmark driver can put them beside hvctr's figures:

    python -m bench.baseline --data runs/data --runs plain,ceiling --out runs/baseline.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from hvctr.data.bags import Bags
from hvctr.data.reader import ShardReader
from hvctr.formats import NUM_DENSE
from hvctr.kernels.unique import unique_in_order
from hvctr.metrics import EvalAccumulator
from hvctr.models import DNN, MLP



class Split(NamedTuple):
    """One split in RAM: labels [N] float32, dense [N, 13] float32, keys [N, F] uint64."""
    labels: np.ndarray
    dense: np.ndarray
    keys: np.ndarray


def _batches(n: int, batch_size: int, drop_last: bool) -> Iterator[slice]:
    stop = n - n % batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        yield slice(start, min(start + batch_size, n))


def _evaluate(model, valid: Split, valid_idx: np.ndarray, lookup, batch_size: int, num_fields: int) -> EvalAccumulator:
    """The validation split through ``model``, ``lookup(idx)`` giving each batch's embeddings."""
    acc = EvalAccumulator()
    with torch.no_grad():
        for s in _batches(len(valid.labels), batch_size, drop_last=False):
            w1 = torch.zeros(s.stop - s.start, num_fields)
            logits = model(torch.from_numpy(valid.dense[s]), lookup(valid_idx[s]), w1)
            acc.add_logits(logits, torch.from_numpy(valid.labels[s]))
    return acc


def map_keys(train_keys: np.ndarray, *others: np.ndarray) -> tuple[int, np.ndarray, list[np.ndarray]]:
    """Keys -> rows of one table, done once: (rows, train index, [index of each other set]).

    Training keys get rows 0 .. n-1 (sorted key order); a key of another set that training
    never saw gets row n, one shared row left at its initial value. The distinct keys come from
    hvctr's hash kernel and only they are sorted (np.unique's sort of every key took 163-171 s
    on 203M multi-hot keys); the rows are np.unique's.
    """
    first_seen, _, inverse = unique_in_order(train_keys)
    order = np.argsort(first_seen)
    uniq = first_seen[order]
    n = uniq.size
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    train_idx = rank[inverse]
    mapped = []
    for keys in others:
        pos = np.searchsorted(uniq, keys)
        pos_c = np.minimum(pos, n - 1)
        mapped.append(np.where(uniq[pos_c] == keys, pos_c, n).astype(np.int64))
    return n + 1, train_idx.reshape(train_keys.shape).astype(np.int64), mapped


def run_plain(train: Split, valid: Split, *, dim: int = 16, hidden: Sequence[int] = (512, 256),
              batch_size: int = 4096, epochs: int = 1, lr: float = 1e-3, max_steps: int = 0,
              init_scale: float = 0.01, seed: int = 1234) -> dict:
    """Trains plain PyTorch on ``train`` and evaluates on ``valid``; torch threads as set by the caller."""
    t0 = time.perf_counter()
    table_rows, train_idx, (valid_idx,) = map_keys(train.keys, valid.keys)
    prep_s = time.perf_counter() - t0
    num_fields = train.keys.shape[1]
    torch.manual_seed(seed)
    emb = torch.nn.Embedding(table_rows, dim, sparse=True)
    torch.nn.init.uniform_(emb.weight, -init_scale, init_scale)
    model = DNN(num_fields=num_fields, dim=dim, num_dense=NUM_DENSE, hidden=hidden)
    opt_sparse = torch.optim.SparseAdam(emb.parameters(), lr=lr)
    opt_dense = torch.optim.Adam(model.parameters(), lr=lr)
    no_w1 = torch.zeros(batch_size, num_fields)  # the DNN does not read first-order weights

    steps, t0 = 0, time.perf_counter()
    for _ in range(epochs):
        for s in _batches(len(train.labels), batch_size, drop_last=True):
            logits = model(torch.from_numpy(train.dense[s]), emb(torch.from_numpy(train_idx[s])), no_w1)
            loss = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(train.labels[s]))
            opt_sparse.zero_grad()
            opt_dense.zero_grad()
            loss.backward()
            opt_sparse.step()
            opt_dense.step()
            steps += 1
            if steps == max_steps:
                break
        if steps == max_steps:
            break
    train_s = time.perf_counter() - t0

    acc = _evaluate(model, valid, valid_idx, lambda idx: emb(torch.from_numpy(idx)), batch_size, num_fields)
    return {
        "system": "plain_pytorch", "threads": torch.get_num_threads(), "batch_size": batch_size,
        "dim": dim, "hidden": list(hidden), "table_rows": table_rows, "steps": steps,
        "train_samples": steps * batch_size, "train_s": train_s,
        "samples_per_s": steps * batch_size / train_s if train_s > 0 else float("nan"),
        "key_mapping_s": prep_s, "last_loss": loss.item() if steps else float("nan"),
        **{f"valid_{k}": v for k, v in acc.result().items()},
    }


TORCHREC_OPTIMIZERS = ("rowwise_adagrad", "adagrad", "sgd")  # what fbgemm fuses on the CPU (no Adam there)


def torchrec_missing() -> str | None:
    """Why the TorchRec peer cannot run here, or None where it can."""
    try:
        import fbgemm_gpu  # noqa: F401
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection  # noqa: F401
    except Exception as e:  # ImportError, or fbgemm's OSError for a torch it was not built for
        return (f"torchrec / fbgemm-gpu-cpu not importable ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                "install the bench extra (setup.cfg: pip install --no-deps torchrec fbgemm-gpu-cpu and their deps)")
    return None


def _torchrec_optimizer(name: str):
    import torchrec.optim as trec_optim
    return {"rowwise_adagrad": trec_optim.RowWiseAdagrad, "adagrad": torch.optim.Adagrad,
            "sgd": torch.optim.SGD}[name]


def feature_major(idx: np.ndarray | Bags, b: slice, row_offsets: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``b`` of [N, F] table rows (or their Bags, ``row_offsets`` its row_offsets()) as a
    KeyedJaggedTensor's (values, lengths): feature-major, field 0's bags of every row first.
    Vectorised: each feature-major bag's start in the row-major values, spread over its values
    with one repeat."""
    if not isinstance(idx, Bags):
        rows = idx[b]
        return np.ascontiguousarray(rows.T).reshape(-1), np.ones(rows.size, dtype=np.int64)
    part = idx.rows_slice(b.start, b.stop, row_offsets)
    lengths = part.lengths.astype(np.int64)
    starts = part.bag_offsets()[:-1].reshape(lengths.shape).T.reshape(-1)
    fm_lengths = lengths.T.reshape(-1)
    out_starts = np.concatenate([[0], np.cumsum(fm_lengths)[:-1]])
    take = np.repeat(starts - out_starts, fm_lengths) + np.arange(int(fm_lengths.sum()))
    return part.values[take], fm_lengths


def _map_bag_keys(train: Split, valid: Split) -> tuple[int, np.ndarray | Bags, np.ndarray | Bags]:
    """map_keys for one-valued keys or Bags (their values mapped, the bags kept)."""
    if not isinstance(train.keys, Bags):
        table_rows, train_idx, (valid_idx,) = map_keys(train.keys, valid.keys)
        return table_rows, train_idx, valid_idx
    table_rows, train_v, (valid_v,) = map_keys(train.keys.values, valid.keys.values)
    return table_rows, train.keys.with_values(train_v), valid.keys.with_values(valid_v)


TORCHREC_ARCHS = ("dnn", "dlrm", "dlrm-dcnv2")  # hvctr's DNN over the pooled rows; TorchRec's DLRM, DLRM_DCN


def run_torchrec(train: Split, valid: Split, *, dim: int = 16, hidden: Sequence[int] = (512, 256),
                 batch_size: int = 4096, epochs: int = 1, lr: float = 1e-3, sparse_lr: float = 0.002,
                 optimizer: str = "rowwise_adagrad", max_steps: int = 0, init_scale: float = 0.01,
                 seed: int = 1234, arch: str = "dnn", bottom: Sequence[int] = (512, 256, 16), cross_layers: int = 3,
                 cross_rank: int = 64) -> dict:
    """TorchRec on ``train``, evaluated on ``valid``: the table a FusedEmbeddingBagCollection
    (one table, its 26 features sharing it as hvctr's fields share one key space; sum pooling:
    one-valued data's bag of one key is the row itself, a multi-valued field's bag sums its
    rows as hvctr's model.pooling = sum), its optimiser fused into the backward; the dense part
    with Adam: hvctr's DNN over the pooled rows (``arch`` dnn) or TorchRec's own DLRM / DLRM_DCN
    modules (dlrm, dlrm-dcnv2: bottom MLP ``bottom``, top MLP ``hidden`` + 1, DCN's low-rank
    cross layers). The keys are mapped to rows once, up front, as ``run_plain`` does, and each
    batch's KeyedJaggedTensor inputs are built before the clock starts (a data loader's work)."""
    import torchrec
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    if optimizer not in TORCHREC_OPTIMIZERS:
        raise ValueError(f"--torchrec-optimizer {optimizer!r}: valid: {', '.join(TORCHREC_OPTIMIZERS)}")
    if arch not in TORCHREC_ARCHS:
        raise ValueError(f"--arch {arch!r}: valid: {', '.join(TORCHREC_ARCHS)}")
    t0 = time.perf_counter()
    table_rows, train_idx, valid_idx = _map_bag_keys(train, valid)
    offsets = {id(x): x.row_offsets() for x in (train_idx, valid_idx) if isinstance(x, Bags)}
    prep_s = time.perf_counter() - t0
    num_fields = train.keys.fields if isinstance(train.keys, Bags) else train.keys.shape[1]
    fields = [f"f{i}" for i in range(num_fields)]
    kjt_s = [0.0]  # building the batches' KeyedJaggedTensors (in the timed loop, as a plain loop does)

    def kjt_of(idx, s: slice) -> KeyedJaggedTensor:
        t = time.perf_counter()
        values, lengths = feature_major(idx, s, offsets.get(id(idx)))
        kjt = KeyedJaggedTensor(keys=fields, values=torch.from_numpy(values), lengths=torch.from_numpy(lengths))
        kjt_s[0] += time.perf_counter() - t
        return kjt
    torch.manual_seed(seed)
    ebc = FusedEmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="table", embedding_dim=dim, num_embeddings=table_rows, feature_names=fields,
                                   weight_init_min=-init_scale, weight_init_max=init_scale, pooling=PoolingType.SUM)],
        optimizer_type=_torchrec_optimizer(optimizer), optimizer_kwargs={"lr": sparse_lr}, device=torch.device("cpu"))
    if arch == "dnn":
        dnn = DNN(num_fields=num_fields, dim=dim, num_dense=NUM_DENSE, hidden=hidden)

        def forward(dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
            b = dense.shape[0]
            return dnn(dense, ebc(kjt).values().view(b, num_fields, dim), torch.zeros(b, num_fields))
        dense_params = list(dnn.parameters())
    else:
        from torchrec.models.dlrm import DLRM, DLRM_DCN

        top = [*hidden, 1]
        net = (DLRM(ebc, NUM_DENSE, list(bottom), top) if arch == "dlrm" else
               DLRM_DCN(ebc, NUM_DENSE, list(bottom), top, dcn_num_layers=cross_layers, dcn_low_rank_dim=cross_rank))

        def forward(dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
            return net(dense, kjt).squeeze(1)
        dense_params = [p for n, p in net.named_parameters() if "embedding_bag_collection" not in n]
    opt_dense = torch.optim.Adam(dense_params, lr=lr)

    steps, t0 = 0, time.perf_counter()
    for _ in range(epochs):
        for s in _batches(len(train.labels), batch_size, drop_last=True):
            logits = forward(torch.from_numpy(train.dense[s]), kjt_of(train_idx, s))
            loss = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(train.labels[s]))
            opt_dense.zero_grad()
            loss.backward()  # the table's rows are updated here, by the fused optimiser
            opt_dense.step()
            steps += 1
            if steps == max_steps:
                break
        if steps == max_steps:
            break
    train_s = time.perf_counter() - t0
    train_kjt_s = kjt_s[0]

    acc = EvalAccumulator()
    with torch.no_grad():
        for s in _batches(len(valid.labels), batch_size, drop_last=False):
            acc.add_logits(forward(torch.from_numpy(valid.dense[s]), kjt_of(valid_idx, s)),
                           torch.from_numpy(valid.labels[s]))
    import fbgemm_gpu
    return {
        "system": "torchrec", "arch": arch, "threads": torch.get_num_threads(), "batch_size": batch_size, "dim": dim,
        "hidden": list(hidden), "table_rows": table_rows, "steps": steps, "train_samples": steps * batch_size,
        "train_s": train_s, "samples_per_s": steps * batch_size / train_s if train_s > 0 else float("nan"),
        "key_mapping_s": prep_s, "kjt_build_s": train_kjt_s, "last_loss": loss.item() if steps else float("nan"),
        "sparse_optimizer": f"fused {optimizer}", "sparse_lr": sparse_lr, "dense_optimizer": "Adam", "dense_lr": lr,
        "versions": {"torchrec": getattr(torchrec, "__version__", _dist_version("torchrec")),
                     "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "?"), "torch": torch.__version__},
        **{f"valid_{k}": v for k, v in acc.result().items()},
    }


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return "?"


def mlp_steps(in_features: int, hidden: Sequence[int], batch_size: int, steps: int, warmup: int = 3,
              before_timing: Callable[[], None] | None = None, seed: int = 0, input_grad: bool = False) -> dict:
    """The ceiling's work in this process: ``steps`` timed MLP steps on random inputs.

    ``input_grad``: the floor's work instead: the input in blocks as hvctr's DNN takes it
    ([embeddings | dense], linear_over_blocks), the gradient of the embedding block computed.
    ``before_timing`` runs after the warm-up: the workers wait there for the word go.
    """
    torch.manual_seed(seed)
    mlp = MLP(in_features, hidden)
    opt = torch.optim.Adam(mlp.parameters(), lr=1e-3)
    x = torch.randn(batch_size, in_features)
    y = (torch.rand(batch_size) < 0.25).float()
    emb = x[:, : in_features - NUM_DENSE].clone().requires_grad_()
    dense = x[:, in_features - NUM_DENSE:].clone()

    def forward() -> torch.Tensor:
        if input_grad:
            emb.grad = None
            return mlp.forward_blocks([emb, dense])
        return mlp(x)

    def step() -> None:
        opt.zero_grad()
        F.binary_cross_entropy_with_logits(forward().squeeze(1), y).backward()
        opt.step()

    for _ in range(warmup):
        step()
    if before_timing:
        before_timing()
    t0 = time.time()
    for _ in range(steps):
        step()
    t1 = time.time()
    return {"samples": steps * batch_size, "t0": t0, "t1": t1, "threads": torch.get_num_threads()}


def _worker_wait() -> None:
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise RuntimeError("ceiling worker: the parent went away before saying go")


def run_ceiling(procs: int, *, in_features: int, hidden: Sequence[int], batch_size: int, steps: int,
                input_grad: bool = False) -> dict:
    """``procs`` processes of 1 thread run the MLP at once; samples/s over their common span.

    Each worker imports torch and warms up, says ready, and starts timing when all are ready.
    ``input_grad``: the floor (mlp_steps) instead of the ceiling.
    """
    cmd = [sys.executable, "-m", "bench.baseline", "--ceiling-worker", f"--in-features={in_features}",
           f"--hidden={','.join(map(str, hidden))}", f"--batch-size={batch_size}", f"--ceiling-steps={steps}",
           "--threads=1", *(["--input-grad"] if input_grad else [])]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    workers = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env) for _ in range(procs)]
    try:
        for w in workers:
            if w.stdout.readline().strip() != "ready":
                raise RuntimeError(f"ceiling worker failed before timing: {w.communicate()[1].strip()[-2000:]}")
        for w in workers:
            w.stdin.write("go\n")
            w.stdin.flush()
        outs = []
        for w in workers:
            out, err = w.communicate()
            if w.returncode != 0:
                raise RuntimeError(f"ceiling worker failed ({w.returncode}): {err.strip()[-2000:]}")
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    span = max(o["t1"] for o in outs) - min(o["t0"] for o in outs)
    return {
        "system": "mlp_floor" if input_grad else "mlp_ceiling", "processes": procs, "threads_per_process": 1, "batch_size": batch_size,
        "in_features": in_features, "hidden": list(hidden), "steps_per_process": steps,
        # every process's samples over the span from the first start to the last end: a lower bound
        "samples_per_s": sum(o["samples"] for o in outs) / span,
        "per_process_samples_per_s": [o["samples"] / (o["t1"] - o["t0"]) for o in outs],
        "start_skew_s": max(o["t0"] for o in outs) - min(o["t0"] for o in outs),
    }


def run_ceiling_one_process(*, in_features: int, hidden: Sequence[int], batch_size: int, steps: int,
                            input_grad: bool = False) -> dict:
    r = mlp_steps(in_features, hidden, batch_size, steps, input_grad=input_grad)
    return {"system": "mlp_floor" if input_grad else "mlp_ceiling", "processes": 1, "threads_per_process": r["threads"], "batch_size": batch_size,
            "in_features": in_features, "hidden": list(hidden), "steps_per_process": steps,
            "samples_per_s": r["samples"] / (r["t1"] - r["t0"])}


def load_split(data_dir: str, split: str) -> Split:
    """Every row of one split of a data_prep output directory, in RAM (as one rank would read all shards)."""
    with ShardReader(data_dir, split, rank=0, world_size=1, batch_size=1) as reader:
        return Split(*reader.read_rows(0, reader.rows))


# Command line ------------------------------------------------------------------------------

RUNS = ("plain", "torchrec", "ceiling", "ceiling1", "floor", "floor1")


def _hidden(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.replace(" ", "").split(",") if x)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", help="data_prep output directory (train split, and valid unless --valid-data)")
    p.add_argument("--valid-data", help="directory of the validation split; default: --data")
    p.add_argument("--runs", default="plain,ceiling",
                   help=f"comma list of: {', '.join(RUNS)} (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--hidden", type=_hidden, default=(512, 256), help="MLP hidden layers, e.g. 512,256")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the single-process runs")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--torchrec-optimizer", default="rowwise_adagrad", choices=TORCHREC_OPTIMIZERS,
                   help="the table's fused optimiser in the torchrec run (fbgemm has no CPU Adam)")
    p.add_argument("--torchrec-lr", type=float, default=0.002,
                   help="its learning rate (0.002: the best of 0.001-0.2 on the 2M-row set, BENCHMARKS.md)")
    p.add_argument("--arch", default="dnn", choices=TORCHREC_ARCHS,
                   help="the torchrec run's model: hvctr's DNN, or TorchRec's DLRM or DLRM_DCN modules")
    p.add_argument("--bottom", type=_hidden, default=(512, 256, 16), help="dlrm, dlrm-dcnv2: the bottom MLP")
    p.add_argument("--cross-layers", type=int, default=3, help="dlrm-dcnv2: cross layers")
    p.add_argument("--cross-rank", type=int, default=64, help="dlrm-dcnv2: the cross layers' low rank")
    p.add_argument("--max-steps", type=int, default=0, help="stop plain training after this many steps; 0: epochs")
    p.add_argument("--seed", type=int, default=1234, help="plain, torchrec: torch's seed for the model's initial weights")
    p.add_argument("--ceiling-procs", type=int, default=2)
    p.add_argument("--ceiling-steps", type=int, default=30)
    p.add_argument("--in-features", type=int, default=0, help="MLP input width; 0: 26 * dim + 13")
    p.add_argument("--out", help="also write the JSON lines to this file")
    p.add_argument("--ceiling-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--input-grad", action="store_true", help=argparse.SUPPRESS)  # a floor worker


def run(args: argparse.Namespace) -> list[dict]:
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = sorted(set(runs) - set(RUNS))
    if unknown:
        raise ValueError(f"--runs: unknown {unknown}; valid: {', '.join(RUNS)}")
    if {"plain", "torchrec"} & set(runs) and not args.data:
        raise ValueError("--runs plain and torchrec need --data DIR (a data_prep output directory)")
    in_features = args.in_features or 26 * args.dim + NUM_DENSE
    mlp = dict(in_features=in_features, hidden=args.hidden, batch_size=args.batch_size, steps=args.ceiling_steps)
    results = []
    splits: tuple[Split, Split] | None = None
    for name in runs:
        if name in ("plain", "torchrec"):
            missing = torchrec_missing() if name == "torchrec" else None
            if missing:
                print(f"bench.baseline: torchrec skipped: {missing}", file=sys.stderr, flush=True)
                results.append({"system": "torchrec", "skipped": missing})
                continue
            if splits is None:
                splits = load_split(args.data, "train"), load_split(args.valid_data or args.data, "valid")
            common = dict(dim=args.dim, hidden=args.hidden, batch_size=args.batch_size, epochs=args.epochs,
                          lr=args.lr, max_steps=args.max_steps, seed=args.seed)
            results.append(run_plain(*splits, **common) if name == "plain" else
                           run_torchrec(*splits, **common, sparse_lr=args.torchrec_lr,
                                        optimizer=args.torchrec_optimizer, arch=args.arch, bottom=args.bottom,
                                        cross_layers=args.cross_layers, cross_rank=args.cross_rank))
        elif name in ("ceiling", "floor"):
            results.append(run_ceiling(args.ceiling_procs, **mlp, input_grad=name == "floor"))
        else:
            results.append(run_ceiling_one_process(**mlp, input_grad=name == "floor1"))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.baseline", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        if args.ceiling_worker:
            r = mlp_steps(args.in_features, args.hidden, args.batch_size, args.ceiling_steps,
                          before_timing=_worker_wait, input_grad=args.input_grad)
            print(json.dumps(r), flush=True)
            return 0
        try:
            results = run(args)
        except ValueError as e:
            print(f"bench.baseline: error: {e}", file=sys.stderr)
            return 2
    finally:
        torch.set_num_threads(threads)
    lines = [json.dumps(r, sort_keys=True) for r in results]
    print("\n".join(lines), flush=True)
    if args.out:
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
