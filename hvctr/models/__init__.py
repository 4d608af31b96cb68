"""CTR models over a batch's gathered rows: pure torch, nothing about storage, ranks or caches.

Every model takes ``dense [B, num_dense]`` (log1p-transformed counts), ``emb [B, F, D]`` (the
rows' ``w`` columns) and ``w1 [B, F]`` (the rows' first-order weight) and returns logits
``[B]``. Where those tensors come from (SSD shard, CPU cache, working set) is the trainer's
business; a unit test parses this package's imports to keep it that way.

    model = build_model(cfg.model, dim=cfg.storage.dim, seed=cfg.train.seed)
    logits = model(dense, emb, w1)
"""

from __future__ import annotations

import torch
from torch import nn

from hvctr.config import BOTTOM_MLP_ARCHS, CROSS_ARCHS, ModelArch, ModelConfig
from hvctr.models.ctr import (DLRM, DNN, MLP, CrossNet, DCNv2, DeepFM, DLRMDCNv2, WideDeep, dot_interaction,
                              fm_interaction)

_ARCHS: dict[ModelArch, type[nn.Module]] = {ModelArch.DNN: DNN, ModelArch.DEEPFM: DeepFM, ModelArch.WDL: WideDeep,
                                            ModelArch.DLRM: DLRM, ModelArch.DCNV2: DCNv2,
                                            ModelArch.DLRM_DCNV2: DLRMDCNv2}


def build_model(model_cfg: ModelConfig, dim: int, seed: int | None = None) -> nn.Module:
    """The model ``model_cfg.arch`` names, for embeddings of ``dim`` columns.

    With a seed the dense parameters come from a private RNG stream (torch's global RNG is left
    as it was), so every rank that passes the same seed builds the same initial model.
    """
    cls = _ARCHS[model_cfg.arch]
    args = dict(num_fields=model_cfg.num_fields, dim=dim, num_dense=model_cfg.num_dense, hidden=model_cfg.hidden)
    if model_cfg.arch in BOTTOM_MLP_ARCHS:
        args["bottom"] = model_cfg.bottom_mlp
    if model_cfg.arch in CROSS_ARCHS:
        args.update(cross_layers=model_cfg.cross_layers, cross_rank=model_cfg.cross_rank)
    if seed is None:
        return cls(**args)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls(**args)


__all__ = ["DLRM", "DNN", "MLP", "CrossNet", "DCNv2", "DeepFM", "DLRMDCNv2", "WideDeep", "build_model",
           "dot_interaction", "fm_interaction"]
