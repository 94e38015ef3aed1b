"""The training harness, at Megatron-LM's module path.

Users' scripts write ``from megatron.training import pretrain, get_args, print_rank_0,
get_tokenizer`` as they do with Megatron-LM. The names resolve on first use, so importing one
light module of this package (``megatron.training.train_state``, say) does not build the whole
harness with it.

Modules: ``arguments`` (the parser), ``validation``, ``configs`` (typed configs from the flags),
``flag_registry``, ``megatron_flags`` / ``megatron_flags_table`` (every other option of
Megatron-LM's parser, classified), ``initialize``, ``global_vars``, ``training`` (``pretrain``
and the loop), ``log``, ``hooks``, ``train_state``, ``microbatches``, ``timers``,
``checkpointing`` (the save and load entry points), ``save_extras`` (progress log, checkpoint
retention), ``memory_accounting``, ``moe_logging``, ``determinism``, ``utils``.
"""

import importlib

_PUBLIC = {
    "pretrain": "megatron.training.training",
    "get_args": "megatron.training.global_vars",
    "get_tokenizer": "megatron.training.global_vars",
    "get_timers": "megatron.training.global_vars",
    "get_tensorboard_writer": "megatron.training.global_vars",
    "set_global_variables": "megatron.training.global_vars",
    "initialize_megatron": "megatron.training.initialize",
    "print_rank_0": "megatron.training.utils",
    "print_rank_last": "megatron.training.utils",
    "is_last_rank": "megatron.training.utils",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'megatron.training' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
