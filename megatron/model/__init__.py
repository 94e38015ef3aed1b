"""Megatron's GPT and BERT models on tensor-, sequence- and pipeline-parallel layers.

The classes are loaded on first use, so importing a light submodule (``megatron.model.enums``,
which the fused-kernel references use) does not pull in the whole model.
"""

import importlib

_EXPORTS = {
    "BertModel": "megatron.model.bert_model",
    "GPTModel": "megatron.model.gpt_model",
    "MegatronModule": "megatron.model.module",
    "Float16Module": "megatron.model.module",
    "FusedLayerNorm": "megatron.fused_kernels.layer_norm",
    "MixedFusedLayerNorm": "megatron.fused_kernels.layer_norm",
    "MixedFusedRMSNorm": "megatron.fused_kernels.layer_norm",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'megatron.model' has no attribute {name!r}")
