"""Capacity and time planning: what a table needs on SSD, in host and GPU memory, and per step.

Owns ``hvctr plan`` (cmd.py), its arithmetic (model.py: sizes from the storage formats, bytes
from the exchange code, seconds from rates), the key-frequency models that size a window's
working set (keyfreq.py: Zipf, or the unique-key curve measured on a data_prep output), the
rates of a node type (rates.py: TOML, measured by calibrate.py, ``hvctr bench --calibrate``)
and the check of the model against real runs on this machine (bench/plan_check.py).

    hardware map --> node: cpus, memory, GPUs, SSDs (hvctr.topo placement plan)
    job (keys, dim, batch, k, cache) + key curve D(n) --> rows, bytes per rank and per step
    rates (calibrated or assumed) --> seconds per step --> what fits where, what it costs
"""

from hvctr.plan.keyfreq import KeyCurve, data_curve, zipf_curve
from hvctr.plan.model import Job, NodeInfo, Plan, plan
from hvctr.plan.rates import Rates, RatesFile, load_rates, write_rates

__all__ = ["Job", "KeyCurve", "NodeInfo", "Plan", "Rates", "RatesFile", "data_curve", "load_rates", "plan",
           "write_rates", "zipf_curve"]
