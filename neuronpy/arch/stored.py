"""A checkpoint directory's safetensors tensors read as they are stored, one at a time.

Loading a model through transformers holds all of its weights in memory at once, in the dtype
it computes in. For a checkpoint whose experts ship packed that is several times the files:
gpt-oss-20b's MXFP4 experts are 10.2 GB in its files and 38.2 GB in bfloat16. Read as stored,
each expert is dequantized on its own as its layer is built (arch/mxfp4.py) and becomes what
`--quantize` says before the next is read, so the load never holds more than the model being
built and one layer's packed experts.

A tensor is read from its file when it is asked for (the files are memory-mapped by
safetensors); MXFP4's stacked `*_blocks` and `*_scales` are answered as views that read one
expert at a time."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

INDEX = "model.safetensors.index.json"
# stacked tensors read one expert (their first index) at a time
PACKED_SUFFIXES = ("_blocks", "_scales")


class StackedTensor:
    """A stored [E, ...] tensor whose rows are read one at a time: `t[e]` is row e alone."""

    def __init__(self, handle: Any, name: str) -> None:
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def __getitem__(self, index: int) -> torch.Tensor:
        return self._slice[index]


class StoredCheckpoint:
    """The tensors of a checkpoint directory's safetensors files under their stored names (a
    Checkpoint of arch/weights.py). `config` and `generation_config` are transformers'; `dtype`
    the model's; `fingerprint` changes whenever a file could have."""

    def __init__(
        self, directory: Path, *, config: Any, generation_config: Any, dtype: torch.dtype
    ) -> None:
        self.path = Path(directory)
        self.config = config
        self.generation_config = generation_config
        self.dtype = dtype
        index = self.path / INDEX
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._where = {name: self.path / file for name, file in weight_map.items()}
        else:
            self._where = {}
            for file in sorted(self.path.glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as f:
                    self._where.update((name, file) for name in f.keys())  # noqa: SIM118
        if not self._where:
            raise FileNotFoundError(f"{self.path}: no safetensors weights")
        self._handles: dict[Path, Any] = {}
        digest = hashlib.sha256()
        for file in sorted(set(self._where.values())):
            stat = file.stat()
            digest.update(f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
        self.fingerprint = digest.hexdigest()

    def _handle(self, name: str) -> Any:
        file = self._where[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt")
        return self._handles[file]

    def get(self, name: str) -> torch.Tensor | StackedTensor | None:
        if name not in self._where:
            return None
        if name.endswith(PACKED_SUFFIXES):
            return StackedTensor(self._handle(name), name)
        return self._handle(name).get_tensor(name)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def facts(self) -> tuple[int, str]:
        """(parameter count, how the experts are stored): MXFP4 packs two values a byte."""
        count, packed = 0, False
        for name in self._where:
            n = math.prod(self._handle(name).get_slice(name).get_shape())
            if name.endswith("_blocks"):
                n, packed = 2 * n, True
            elif name.endswith("_scales"):
                n = 0
            count += n
        return count, "MXFP4" if packed else ""
