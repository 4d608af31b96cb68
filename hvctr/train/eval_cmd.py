"""``hvctr eval --run-dir R``: AUC, logloss, NE, COPC and calibration of a saved run (same world size as training)."""

from hvctr.train.cmd import add_eval_arguments as add_arguments, run_eval as run

__all__ = ["add_arguments", "run"]
