"""The planner's GPU step against the GPU's own (issue 32, item 3), on a machine with CUDA.

    python -m bench.gpu_step [--reps 30] [--out result.json]

For each model (dnn, dcnv2, dlrm-dcnv2) and batch (4096, 16384 a rank), one rank's local step as
the trainer runs it on the device (bench.calibrate's: gather of the batch's rows, forward,
backward, the per-row gradient sum, lazy Adam on the rows, dense Adam, the loss read back),
timed to a synchronize: the median of ``--reps`` after warm-ups. Beside it, what
``hvctr.plan.model.gpu_step_s`` predicts for that step twice: from the datasheet of the GPU
named by CUDA (hvctr.plan.gpus, "assumed"), and from the rates ``bench.calibrate.gpu_rates``
measures here (what ``hvctr bench --calibrate`` writes into a node's rates file). Also the
host-to-device copy of pinned memory (``device_bytes_per_s``), which the planner charges for a
window's working set.

Prints a markdown table and, with ``--out``, writes the figures as JSON. Without CUDA it says
so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

DIM = 16
ARCHS = ("dnn", "dcnv2", "dlrm-dcnv2")
BATCHES = (1024, 4096, 16384, 65536)


def step_seconds(arch: str, batch: int, reps: int) -> tuple[dict[str, float], int]:
    """Median seconds of one local step on cuda and of its parts (``fb``: gather, forward,
    backward, the loss read back; ``sparse``: the gather, the per-row gradient sum and lazy Adam;
    ``adam``: the dense Adam step), and the batch's distinct rows."""
    import torch

    from bench.calibrate import LocalStep
    from hvctr.config import ModelArch, ModelConfig

    ls = LocalStep(ModelConfig(arch=ModelArch(arch)), batch, torch.device("cuda"))

    def synced(fn):
        def run() -> None:
            fn()
            torch.cuda.synchronize()
        return run

    local_step = synced(ls.step)
    parts = {"step": local_step, "fb": synced(ls.forward_backward), "sparse": synced(ls.sparse),
             "adam": synced(ls.opt.step)}
    for _ in range(5):
        for fn in parts.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in parts}
    for _ in range(reps):
        for name, fn in parts.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    out = {name: statistics.median(v) for name, v in times.items()}
    out["kernels"] = kernels_launched(local_step)
    return out, int(torch.unique(ls.pos).numel())


def kernels_launched(fn) -> float:
    """CUDA kernels (and memcpy/memset) one call of ``fn`` runs, by torch.profiler (-1: it could not tell)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
        return float(sum(1 for e in prof.events() if e.device_type.name == "CUDA"))
    except Exception:  # noqa: BLE001 - a profiler that does not run here is not the measurement
        return -1.0


def host_link_bytes_per_s(reps: int) -> float:
    """Pinned host memory to the device, 256 MiB a copy: bytes/s (the fastest of ``reps``)."""
    import torch

    src = torch.empty(64 << 20, dtype=torch.float32).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    best = float("inf")
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return src.numel() * 4 / best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", help="write the figures here as JSON")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"bench.gpu_step: no CUDA GPU (torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'})",
              file=sys.stderr)
        return 2
    from bench.calibrate import gpu_rates as measure_gpu_rates
    from hvctr.config import ModelArch, ModelConfig
    from hvctr.plan.gpus import gpu_rates
    from hvctr.plan.model import Job, gpu_step_s

    name = torch.cuda.get_device_name(0)
    measured = measure_gpu_rates(max(args.reps // 3, 3))
    assumed = gpu_rates(name)
    here = gpu_rates(name, measured["gpu_flops_per_s"], measured["gpu_bytes_per_s"], measured["gpu_kernel_s"],
                     measured["gpu_sparse_keys_per_s"])
    out = {"gpu": name, "torch": torch.__version__, "cuda": torch.version.cuda, "measured_rates": measured,
           "host_link_bytes_per_s": host_link_bytes_per_s(5), "reps": args.reps,
           "assumed_rates": None if assumed is None else {"flops_per_s": assumed.flops_per_s,
                                                          "bytes_per_s": assumed.bytes_per_s,
                                                          "kernel_s": assumed.kernel_s,
                                                          "sparse_keys_per_s": assumed.sparse_keys_per_s,
                                                          "source": assumed.source},
           "steps": []}
    print(f"bench.gpu_step: {name}, torch {torch.__version__} (CUDA {torch.version.cuda}); "
          f"measured {measured['gpu_flops_per_s'] / 1e12:.2f} TFLOP/s (the DNN's forward + backward, marginal), "
          f"{measured['gpu_bytes_per_s'] / 1e12:.2f} TB/s (a device copy), {measured['gpu_kernel_s'] * 1e6:.1f} us a "
          f"kernel of a step, {measured['gpu_sparse_keys_per_s'] / 1e6:.0f}M sparse keys/s; pinned host -> device "
          f"{out['host_link_bytes_per_s'] / 1e9:.1f} GB/s")
    if assumed:
        print(f"  the datasheet, as the planner assumes it: {assumed.flops_per_s / 1e12:.2f} TFLOP/s, "
              f"{assumed.bytes_per_s / 1e12:.2f} TB/s, {assumed.kernel_s * 1e6:.1f} us a kernel, "
              f"{assumed.sparse_keys_per_s / 1e6:.0f}M sparse keys/s")
    print("\n| model | batch | distinct rows | step, measured | forward + backward / sparse / dense Adam, alone "
          "| planned from the datasheet | planned from the rates measured |")
    print("|---|---|---|---|---|---|---|")
    for arch in ARCHS:
        for batch in BATCHES:
            t, batch_rows = step_seconds(arch, batch, args.reps)
            s = t["step"]
            job = Job(nodes=1, ranks_per_node=1, keys=10**8, dim=DIM, batch_size_per_rank=batch, every_k_steps=8,
                      model=ModelConfig(arch=ModelArch(arch)))
            p_assumed = gpu_step_s(job, assumed, batch_rows) if assumed else float("nan")
            p_here = gpu_step_s(job, here, batch_rows)
            out["steps"].append({"arch": arch, "batch": batch, "distinct_rows": batch_rows, "measured_s": s,
                                 "parts_s": t,
                                 "planned_datasheet_s": p_assumed, "planned_measured_rates_s": p_here})
            print(f"| {arch} | {batch} | {batch_rows:,} | {s * 1e3:.2f} ms | {t['fb'] * 1e3:.2f} / "
                  f"{t['sparse'] * 1e3:.2f} / {t['adam'] * 1e3:.2f} ms ({t['kernels']:.0f} kernels) | {p_assumed * 1e3:.2f} ms "
                  f"({p_assumed / s - 1:+.0%}) | {p_here * 1e3:.2f} ms ({p_here / s - 1:+.0%}) |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
