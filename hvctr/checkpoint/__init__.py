"""Checkpoints: the on-disk format (``format``: paths, manifests, row files, checksums) and a
rank's manager of them during training (``manager``)."""
