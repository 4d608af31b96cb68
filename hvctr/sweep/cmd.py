"""``hvctr sweep run | report | best``: hyperparameter search over hvctr train (hvctr.sweep).

    hvctr sweep run --space S.toml --study DIR --trials 24 [--config base.toml] [--section.key=value ...]
    hvctr sweep report --study DIR            # table (stdout, DIR/report/trials.md, .csv) and PNG plots
    hvctr sweep best --study DIR --out C.toml # the best trial's config, for the full training run

Optuna is an optional extra: without it, every ``hvctr sweep`` says how to install it.
"""

from __future__ import annotations

import argparse

OPTUNA_PIN = "optuna==5.0.0"  # setup.cfg's [sweep] extra pins the same


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="sweep_command", metavar="ACTION", required=True)
    r = sub.add_parser("run", help="be one worker of a study: run trials until it holds --trials",
                       description="Be one worker of a study (start any number, on any nodes sharing --study). "
                                   "Config overrides (--section.key=value) apply to every trial.")
    r.add_argument("--study", required=True, help="the study directory (created by the first worker)")
    r.add_argument("--space", help="search space TOML (hvctr/sweep/space.py; needed to create the study; "
                                   "a worker that leaves it out joins the study as recorded)")
    r.add_argument("--config", help="base config TOML of every trial")
    r.add_argument("--trials", type=int, required=True,
                   help="stop when the study holds this many trials (complete, pruned or running)")
    r.add_argument("--max-trials", type=int, default=0, help="this worker runs at most this many (0: no limit)")
    r.add_argument("--sampler", default="tpe", choices=("tpe", "random"),
                   help="how the next trial's values are chosen: tpe (Optuna's TPE, the default) or random")
    r.add_argument("--pruner", default="sha", choices=("sha", "hyperband", "median", "none"),
                   help="sha: successive halving (asynchronous), keeping the top third at each evaluation")
    r.add_argument("--seed", type=int, default=0, help="sampler seed, mixed with --worker-id")
    r.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="do not make the new study's first trial the base config's own values of the searched keys "
                        "(a setting of the study, as --sampler is)")
    r.add_argument("--worker-id", type=int, help="this worker's index (default: $SLURM_ARRAY_TASK_ID, else the pid)")
    r.add_argument("--launcher", default="mpirun -np {ranks} --bind-to none",
                   help="command that starts a trial's ranks before `python -m mpi4py -m hvctr train`; "
                        "{ranks} is the space's trial.ranks (slurm/sweep.sbatch: srun)")
    r.add_argument("--max-failures", type=int, default=5,
                   help="stop this worker (exit 2) after this many failed trials in a row")
    r.add_argument("--stale-after", type=float, default=120.0,
                   help="seconds without a heartbeat after which a running trial's worker counts as lost")
    rep = sub.add_parser("report", help="table of trials and PNG plots")
    rep.add_argument("--study", required=True, help="the study directory (hvctr sweep run's --study)")
    rep.add_argument("--out", help="directory for trials.md, trials.csv and the PNGs (default DIR/report)")
    b = sub.add_parser("best", help="write the best trial's config (TOML) for the full training stage")
    b.add_argument("--study", required=True, help="the study directory (hvctr sweep run's --study)")
    b.add_argument("--out", required=True, help="config file to write")


def _need_optuna() -> None:
    try:
        import optuna
    except ImportError:
        raise ValueError(f"hvctr sweep needs Optuna, an optional extra: pip install 'hvctr[sweep]' "
                         f"(or pip install '{OPTUNA_PIN}' matplotlib) into this environment") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    _need_optuna()
    if args.sweep_command == "run":
        from hvctr.sweep import worker

        return worker.run(args, overrides)
    if overrides:
        raise ValueError(f"hvctr sweep {args.sweep_command} takes no config overrides, got {overrides}")
    from hvctr.sweep import report

    if args.sweep_command == "report":
        return report.run_report(args)
    return report.run_best(args)
