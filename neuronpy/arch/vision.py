"""Vision-language checkpoints: the language model inside one, read as neuronpy's layers read
any `*ForCausalLM`, and its vision tower, which turns an image into the rows that take its
placeholder tokens' place in the prompt.

The tower is transformers' own module (its `get_image_features`: the family's encoder and
projector, exactly as the family computes them), run once per image at prefill, never in a
decode step: the lockstep batch only ever sees the language model.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from neuronpy.arch.weights import LANGUAGE_MODELS

# families whose processor cuts an image into tiles that the tower encodes one by one (the
# tile dimension is the second of each array): a prefill chunk encodes the tiles whose rows
# it holds, so an image's encoding is spread over its prompt's chunks, between decode steps
TILED = ("idefics3", "smolvlm")
# families whose image tokens see their whole image at prefill, not only those before them
BIDIRECTIONAL = ("gemma3",)


def _tiles_of(value: np.ndarray, tiles: range | None) -> np.ndarray:
    if tiles is None or value.ndim < 2:
        return value
    return np.ascontiguousarray(value[:, tiles.start : tiles.stop])


class VisionTower:
    """A vision-language model's image encoder: `encode(inputs)` -> the rows [tokens, hidden]
    of one image, in the language model's dtype, on its device. It holds the model's vision
    modules alone (a shallow copy of its inner model without the language model, whose weights
    the native layers hold)."""

    def __init__(self, hf_model: Any) -> None:
        inner = copy.copy(hf_model.model)
        inner._modules = {k: v for k, v in inner._modules.items() if k not in LANGUAGE_MODELS}
        self._inner = inner.eval()
        self._takes = set(inspect.signature(inner.get_image_features).parameters) - {"kwargs"}
        config = hf_model.config
        self.hidden_size = int(config.text_config.hidden_size)
        self.model_type = str(config.model_type)
        self.bidirectional = self.model_type in BIDIRECTIONAL
        param = next(inner.parameters())
        self.device, self.dtype = param.device, param.dtype

    def tiles(self, inputs: Mapping[str, Any]) -> int:
        """How many tiles an image's inputs hold, each encoded on its own into its own run of
        the image's rows (SmolVLM's: pixel_values [1, tiles, 3, H, W]); 1 for a family whose
        image is encoded whole."""
        if self.model_type in TILED:
            return int(np.asarray(inputs["pixel_values"]).shape[1])
        return 1

    @torch.inference_mode()
    def encode(self, inputs: Mapping[str, Any], tiles: range | None = None) -> torch.Tensor:
        """One image's rows: [tokens, hidden] (`tiles`: those of these tiles alone, in order).
        `inputs`: its processor's arrays."""
        kwargs = {
            name: torch.from_numpy(_tiles_of(np.asarray(value), tiles)).to(self.device)
            for name, value in inputs.items()
            if name in self._takes
        }
        out = self._inner.get_image_features(**kwargs, return_dict=True)
        features = out.pooler_output if hasattr(out, "pooler_output") else out
        if isinstance(features, list | tuple):
            features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
        return features.reshape(-1, self.hidden_size).to(self.dtype)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._inner.parameters())
