"""What every tensor source shares: the error type and the float32 view of raw()."""
from __future__ import annotations

import os

import numpy as np

from ..checkpoint import CheckpointError, to_float32
from ..config import LaneformerConfig


class FormatError(CheckpointError):
    """A model that cannot be served as it is; the message is one line. A CheckpointError (and so a
    ValueError), so callers that catch those keep working."""


class ModelSource:
    """A model opened for reading: its config and its tensors in Laneformer names.

    Subclasses fill `_shapes` (Laneformer name -> served shape) and `_dtypes` (-> "F32" | "F16" |
    "BF16") and implement raw()."""

    kind = ""

    def __init__(self, path: str, cfg: LaneformerConfig, name: str | None = None,
                 model_dir: str | None = None):
        self.path = os.path.abspath(path)
        self.cfg = cfg
        self.name = name or os.path.basename(self.path.rstrip(os.sep)) or self.path
        self.model_dir = model_dir or (self.path if os.path.isdir(self.path) else os.path.dirname(self.path))
        self.gguf_fields: dict = {}
        self.progress: bool | None = None
        self.nbytes_read = 0
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}

    def has(self, name: str) -> bool:
        return name in self._shapes

    def names(self) -> list[str]:
        return sorted(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def dtype(self, name: str) -> str:
        return self._dtypes[name]

    def quant_type(self, name: str) -> str | None:
        if name not in self._shapes:
            raise KeyError(name)
        return None

    def raw(self, name: str, lanes: range | None = None, rows: np.ndarray | None = None):
        raise NotImplementedError

    def tensor(self, name: str, lanes: range | None = None, rows: np.ndarray | None = None) -> np.ndarray:
        return to_float32(*self.raw(name, lanes, rows))

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.kind} {self.path}>"


def select(arr: np.ndarray, lane_first: bool, lanes: range | None, rows) -> np.ndarray:
    """Add the leading lane axis of a one-lane model to a lane-first tensor, then slice as
    CheckpointReader.raw does."""
    if lane_first:
        arr = arr[None]
        if lanes is not None:
            arr = arr[lanes.start:lanes.stop]
    if rows is not None:
        arr = arr[rows]
    return arr
