"""Pushing a LoRA adapter (not the base weights) to the engines: `POST /load_lora_adapter_from_tensors`.

The adapter's tensors carry PEFT's names for the model's modules (`<module>.lora_A.weight`, r × in, and
`<module>.lora_B.weight`, out × r, optionally under PEFT's `base_model.model.` prefix) and travel as one flattened
bucket (`serialize_bucket(flatten_bucket(named))`, the same-host handle format of `/update_weights_from_tensor`),
with PEFT's adapter_config fields (`r`, `lora_alpha`, `target_modules`) beside them. Loading an adapter under a name
the engine already holds replaces it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from slime.utils.lora_adapter import ADAPTER_NAME
from slime.weight_sync.push import _start
from slime.weight_sync.tensor_payload import flatten_bucket, serialize_bucket

logger = logging.getLogger(__name__)

def push_adapter(named: list[tuple[str, torch.Tensor]], engines: Sequence[Any], config: dict,
                 weight_version: str, lora_name: str = ADAPTER_NAME) -> int:
    """Hand every engine the adapter and wait until all have loaded it; returns the bytes sent per engine. Engines
    are Ray actor handles or in-process objects with `load_lora_adapter_from_tensors`."""
    flat = flatten_bucket([(n, t.detach().contiguous().cpu()) for n, t in named])
    payload = serialize_bucket(flat)
    _start([(e, "load_lora_adapter_from_tensors", (lora_name, config, payload, weight_version), {})
            for e in engines])()
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    logger.info("load_lora_adapter_from_tensors v%s: %d tensors, %.2f MiB to %d engine(s)", weight_version,
                len(named), nbytes / 2**20, len(engines))
    del flat, payload
    return nbytes
