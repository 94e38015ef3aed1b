"""``--config-logger-dir``: what the models are built from, and what they compute, written to disk.

Megatron-LM's debugging aid, with its file names, so its tools read ours. When the model config's
``config_logger_dir`` is non-empty:

- a model constructor writes its arguments (the config as a dict of its fields, dtypes,
  functions and process groups as strings, modules as nested dicts of their children) to
  ``DIR/{Class}.rank_{ranks}.iter{N}.json``;
- GPTModel also writes its freshly initialised state dict to
  ``DIR/GPTModel_init_ckpt.rank_{ranks}.iter{N}.pth`` and, at every forward of the stage with
  the LM head, its inputs and logits to ``DIR/input_and_logits.rank_{ranks}.iter{N}.pth``.

``ranks`` is Megatron's ``tp_dp_cp_pp_ep`` string of this rank's place in each group, and ``N``
counts the writes of that path in this process (0, 1, ...): a second model of the same class
built by the same rank gets ``iter1``. An ordered dict is written with ``torch.save`` (``.pth``),
anything else as JSON.
"""

import dataclasses
import enum
import json
import os
from collections import OrderedDict
from typing import Any, Dict

import torch

from megatron.core.collectives import get_group_rank
from megatron.core.config import ConfigError

# Writes of each path (without ``.iterN``) so far in this process. A process-wide count, as
# Megatron's: two models built one after the other by the same rank share it.
_WRITES: Dict[str, int] = {}


def check_config_logger_dir(path: str) -> None:
    """Create ``path`` if missing and prove it writable, so that a bad ``--config-logger-dir``
    stops the run before anything is built rather than at the first model constructor."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_test_{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as err:
        raise ConfigError(f"--config-logger-dir {path} is not writable: "
                          f"{err.strerror or err}") from None


def rank_string(pstate) -> str:
    """Megatron's ``get_all_ranks()``: this rank's tensor-, data-, context-, pipeline- and
    expert-parallel ranks joined by ``_`` (``0_1_0_0_0`` is dp rank 1). The data-parallel rank
    is the one without context parallelism; a rank ``pstate`` does not know is 0."""
    ranks = [getattr(pstate, "tp_rank", 0), getattr(pstate, "dp_rank", 0),
             getattr(pstate, "cp_rank", 0), getattr(pstate, "pp_rank", 0),
             get_group_rank(getattr(pstate, "ep_group", None))]
    return "_".join(str(rank or 0) for rank in ranks)


def constructor_arguments(frame_locals: dict) -> dict:
    """A constructor's ``locals()`` taken before it assigns anything: its arguments, without
    ``self`` and the ``__class__`` cell that ``super()`` adds."""
    return {name: value for name, value in frame_locals.items()
            if name != "self" and not name.startswith("__")}


def log_config_to_disk(directory: str, data: dict, prefix: str, ranks: str) -> str:
    """Write ``data`` to ``directory/{prefix}.rank_{ranks}.iter{N}.json`` (``.pth`` with
    ``torch.save`` for an :class:`~collections.OrderedDict`); returns the path written."""
    os.makedirs(directory, exist_ok=True)
    stem = os.path.join(directory, f"{prefix}.rank_{ranks}")
    count = _WRITES.get(stem, 0)
    _WRITES[stem] = count + 1
    if isinstance(data, OrderedDict):
        path = f"{stem}.iter{count}.pth"
        torch.save(data, path)
    else:
        path = f"{stem}.iter{count}.json"
        with open(path, "w") as f:
            json.dump(jsonable(data), f)
    return path


def jsonable(value: Any) -> Any:
    """``value`` as JSON types: dataclasses as dicts of their fields, modules as dicts of their
    children (a module without children as its ``repr``), sequences as lists, and whatever else
    JSON has no type for (dtypes, functions, process groups, tensors) as its ``str``.

    Dataclasses are walked field by field rather than with ``dataclasses.asdict``, which deep-
    copies every value and so fails on the process groups a layout object holds."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(item) for item in value]
    if isinstance(value, torch.nn.Module):
        children = dict(value.named_children())
        return {name: jsonable(child) for name, child in children.items()} if children \
            else str(value)
    return str(value)
