"""Base class of the model pieces, checkpoint-dict helpers and the half-precision wrapper."""

from typing import Any, Dict, Optional

import torch

from megatron.core.config import TransformerConfig

_HALF_TYPES = (torch.float16, torch.bfloat16)


def param_is_not_shared(param: torch.nn.Parameter) -> bool:
    """False for a copy of a weight that lives on another pipeline stage too (the last stage's
    ``word_embeddings_for_head``), so gradient norms count it once."""
    return not getattr(param, "shared", False)


def flatten_state_dict(state_dict: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """Join nested dicts ``{"a": {"b.c": t}}`` into dotted keys ``{"a.b.c": t}``."""
    flat = {}
    for key, value in state_dict.items():
        if isinstance(value, dict):
            flat.update(flatten_state_dict(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class MegatronModule(torch.nn.Module):
    """A model piece that can save itself in Megatron's nested checkpoint layout.

    ``state_dict_for_save_checkpoint`` returns the dict stored under ``model`` in a checkpoint;
    pieces with Megatron's nesting (``language_model -> embedding / encoder``) override it.
    ``load_state_dict`` accepts that nesting as well as flat dotted keys.
    """

    def __init__(self, config: Optional[TransformerConfig] = None):
        super().__init__()
        self.config = config

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return super().load_state_dict(flatten_state_dict(state_dict), strict=strict,
                                       assign=assign)


def _convert_floats(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_convert_floats(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _convert_floats(v, fn) for k, v in value.items()}
    return value


def fp32_to_float16(value, dtype: torch.dtype):
    """Cast every float32 tensor in ``value`` (nested tuples/lists/dicts) to ``dtype``."""
    return _convert_floats(value, lambda t: t.to(dtype) if t.dtype == torch.float32 else t)


def float16_to_fp32(value):
    """Cast every float16/bfloat16 tensor in ``value`` to float32."""
    return _convert_floats(value, lambda t: t.float() if t.dtype in _HALF_TYPES else t)


class Float16Module(MegatronModule):
    """Runs ``module`` in float16 (``--fp16``) or bfloat16 (``--bf16``).

    Parameters are cast once; float32 inputs of the first stage are cast on the way in and
    half-precision outputs of the last stage (logits or losses) cast back to float32. Saving
    and loading go to the wrapped module, so checkpoint keys carry no extra prefix.
    """

    def __init__(self, module: torch.nn.Module, config: TransformerConfig):
        super().__init__(config)
        if config.fp16 == config.bf16:
            raise ValueError("Float16Module needs exactly one of --fp16 and --bf16")
        self.dtype = torch.float16 if config.fp16 else torch.bfloat16
        self.add_module("module", module.to(self.dtype))

    def set_input_tensor(self, input_tensor):
        return self.module.set_input_tensor(input_tensor)

    def forward(self, *inputs, **kwargs):
        if getattr(self.module, "pre_process", True):
            inputs = fp32_to_float16(inputs, self.dtype)
            kwargs = fp32_to_float16(kwargs, self.dtype)
        outputs = self.module(*inputs, **kwargs)
        if getattr(self.module, "post_process", True):
            outputs = float16_to_fp32(outputs)
        return outputs

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        return self.module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
