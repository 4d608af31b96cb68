"""Small objects as the bytes a broadcast or an allgather carries, for both engines: JSON, not
pickle (nothing received runs code)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch


def encode_object(obj: Any) -> torch.Tensor:
    """A JSON-serialisable object as uint8 [n]."""
    data = json.dumps(obj, sort_keys=True).encode()
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())


def decode_object(t: torch.Tensor) -> Any:
    """encode_object's inverse; an empty tensor is None."""
    return json.loads(bytes(t.numpy().tobytes()).decode()) if t.numel() else None
