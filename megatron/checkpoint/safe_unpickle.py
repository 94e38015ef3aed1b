"""Reading pickled checkpoint data without running a stranger's code.

Three kinds of pickled data reach this project from outside: ``torch.save`` files
(``model_optim_rng.pt``), the byte entries of a ``torch_dist`` checkpoint (each one a
``torch.save``d object) and the ``.metadata`` file of a ``torch.distributed.checkpoint`` folder
(a plain pickle). None of them is unpickled with the stock unpickler, which imports and calls
whatever the file names.

* :func:`torch_load` runs ``torch.load(weights_only=True)`` with a short allow-list of plain
  types and, for the classes of Megatron's own package that its files hold (``ModelType``,
  ``AttnBackend``, ``RerunMode``, ... inside ``args``; FORMATS.md section 6a), inert stand-ins:
  a :class:`StandIn` records the class's dotted name and the values it was built from, and does
  nothing else. Nothing is imported from a package named ``megatron`` elsewhere on the machine.
  Any other global (``os.system``, a user's class) is refused, and the refusal names it.
* :func:`load_dcp_metadata` reads a ``.metadata`` file with an unpickler that knows only the
  plain record classes of ``torch.distributed.checkpoint`` (sizes, chunks, dtypes).
"""

import argparse
import io
import pickle
import re
import signal
from typing import Any, BinaryIO, Dict, List, Tuple, Union

import numpy as np
import torch


class UnsafeCheckpointError(RuntimeError):
    """A pickle names a global outside the allow-list; the message names it and the file."""


# The package whose classes Megatron-LM pickles into its checkpoints. A global of this package
# becomes a stand-in; it is never imported (a user's own ``megatron`` on sys.path is not ours).
_STAND_IN_PACKAGE = "megatron"

# Values of Megatron's enums that this project reads by name (others keep their value only).
_KNOWN_MEMBERS: Dict[str, Dict[Any, str]] = {
    "megatron.core.enums.ModelType": {1: "encoder_or_decoder", 2: "encoder_and_decoder",
                                      3: "retro_encoder", 4: "retro_decoder"},
}


class StandIn:
    """An inert record of an object of one of Megatron's classes found in a checkpoint.

    ``qualname`` is the dotted class name (``megatron.core.enums.ModelType``); ``args`` the
    values the pickle built it from (an enum member's value is ``args[0]``, also ``value``);
    ``state`` what the pickle set on it afterwards, if anything. ``name`` is the enum member's
    name where this project knows it (else None). It compares equal to another stand-in of the
    same class and values, and its ``repr`` says what it stands for.
    """

    qualname = "megatron"

    def __init__(self, *args, **kwargs):
        self.args = args
        self.kwargs = kwargs
        self.state = None

    def __setstate__(self, state):
        self.state = state

    @property
    def value(self):
        return self.args[0] if len(self.args) == 1 else self.args

    @property
    def name(self):
        try:
            return _KNOWN_MEMBERS.get(self.qualname, {}).get(self.value)
        except TypeError:  # an unhashable value
            return None

    def __eq__(self, other):
        return (isinstance(other, StandIn) and other.qualname == self.qualname
                and other.args == self.args and other.state == self.state)

    def __hash__(self):
        try:
            return hash((self.qualname, self.args))
        except TypeError:
            return hash(self.qualname)

    def __repr__(self):
        shown = self.name if self.name is not None else ", ".join(map(repr, self.args))
        return f"<stand-in {self.qualname}({shown})>"


_stand_in_classes: Dict[str, type] = {}
# How many globals built on the pickle's stack :func:`torch_load` resolves one by one.
_MAX_RETRIES = 64


def stand_in_class(qualname: str) -> type:
    """The :class:`StandIn` subclass for ``qualname`` (one per name, made on first use)."""
    if qualname not in _stand_in_classes:
        module, _, name = qualname.rpartition(".")
        cls = type(name, (StandIn,), {"qualname": qualname, "__module__": module})
        _stand_in_classes[qualname] = cls
    return _stand_in_classes[qualname]


def is_stand_in_name(qualname: str) -> bool:
    return qualname == _STAND_IN_PACKAGE or qualname.startswith(_STAND_IN_PACKAGE + ".")


def _numpy_reconstruct():
    try:
        from numpy.core.multiarray import _reconstruct  # noqa: PLC0415
    except ImportError:  # numpy >= 2 moved it
        from numpy._core.multiarray import _reconstruct  # noqa: PLC0415
    return _reconstruct


def plain_globals() -> List[Any]:
    """Types a checkpoint may hold besides tensors and builtin containers: the run's args, numpy
    RNG states as arrays, and the standard library's signal numbers (Megatron's exit signal)."""
    return [argparse.Namespace, _numpy_reconstruct(), np.ndarray, np.dtype,
            type(np.dtype(np.uint32)), signal.Signals]


def _dtype_classes() -> List[Any]:
    """numpy's per-dtype classes (``numpy.dtypes.Float64DType``...), which numpy >= 1.25 pickles."""
    found = []
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        for name in dir(dtypes):
            obj = getattr(dtypes, name)
            if isinstance(obj, type) and issubclass(obj, np.dtype):
                found.append(obj)
    return found


def _unsafe_names(source: Union[str, BinaryIO]) -> List[str]:
    """The globals of a ``torch.save`` file (a path or a file object) outside torch's list."""
    with torch.serialization.safe_globals(plain_globals() + _dtype_classes()):
        return torch.serialization.get_unsafe_globals_in_checkpoint(source)


def torch_load(source: Union[str, bytes, BinaryIO], what: str = "", **kwargs) -> Any:
    """``torch.load`` with ``weights_only=True``, Megatron's classes read as stand-ins.

    Args:
        source: a path, the file's bytes, or a seekable binary file object.
        what: how errors name the data (defaults to the path).
        kwargs: passed to ``torch.load`` (``mmap``, ``map_location``).

    Raises:
        UnsafeCheckpointError: the data names a global that is neither plain data nor one of
            Megatron's classes; the message names it.
    """
    what = what or (source if isinstance(source, str) else "checkpoint data")
    if isinstance(source, bytes):
        source = io.BytesIO(source)
    start = 0 if isinstance(source, str) else source.tell()
    names = []
    try:
        names = _unsafe_names(source)
    except (RuntimeError, pickle.UnpicklingError, ValueError, EOFError):
        pass  # not a zip file, or unreadable: torch.load below reports it
    refused = [n for n in names if not is_stand_in_name(n)]
    if refused:
        raise UnsafeCheckpointError(
            f"{what}: refusing to load; the file holds objects other than tensors and plain "
            f"data: it names {', '.join(sorted(set(refused)))}, which is neither plain data nor "
            "one of Megatron's own classes, and unpickling it could run code")
    # The scan above misses globals a pickle builds on the stack (protocol 4+); torch's own
    # refusal names each, and a name of Megatron's gets its stand-in before the next try.
    names = set(names)
    for _ in range(_MAX_RETRIES):
        allowed = plain_globals() + _dtype_classes()
        allowed += [(stand_in_class(n), n) for n in sorted(names)]
        if not isinstance(source, str):
            source.seek(start)
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(source, weights_only=True, **{"map_location": "cpu", **kwargs})
        except pickle.UnpicklingError as err:
            found = re.search(r"GLOBAL ([\w.]+)", str(err))
            if found and is_stand_in_name(found.group(1)) and found.group(1) not in names:
                names.add(found.group(1))
                continue
            if found:
                raise UnsafeCheckpointError(
                    f"{what}: refusing to load; the file holds objects other than tensors and "
                    f"plain data: it names {found.group(1)}, which is neither plain data nor one "
                    "of Megatron's own classes, and unpickling it could run code") from None
            if "weights_only" in str(err).lower():
                first = str(err).splitlines()[0][:200]
                raise UnsafeCheckpointError(
                    f"{what}: refusing to load; the file holds objects other than tensors and "
                    f"plain data ({first})") from None
            raise
    raise UnsafeCheckpointError(f"{what}: refusing to load; it names more than {_MAX_RETRIES} "
                                "different classes")


# Plain record classes of torch.distributed.checkpoint's metadata file, and what they reference.
_DCP_METADATA_GLOBALS = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *{("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "BytesStorageMetadata", "ChunkStorageMetadata",
        "StorageMeta", "TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING")},
    *{("torch.distributed.checkpoint.planner", n) for n in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")},
    # torch's own FileSystemWriter records its folder as a path object in StorageMeta; a
    # path is rebuilt from its strings and runs nothing else.
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
}


# Megatron-Core's save planner records its plans as a subclass of torch's SavePlan that adds
# one field of plain data (``mcore_data``; before 0.14, the unflattened shapes): read as torch's.
_DCP_METADATA_SUBSTITUTES = {
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan"):
        ("torch.distributed.checkpoint.planner", "SavePlan"),
}


class _DCPMetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, what: str):
        super().__init__(file)
        self._what = what

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype,
                                                                         torch.memory_format)):
            return getattr(torch, name)
        if (module, name) in _DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        if (module, name) in _DCP_METADATA_SUBSTITUTES:
            return super().find_class(*_DCP_METADATA_SUBSTITUTES[(module, name)])
        if module == "builtins" and name in ("set", "frozenset", "slice"):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"{self._what}: refusing to load; it names {module}.{name}, "
                                    "which a torch.distributed.checkpoint metadata file does not "
                                    "hold, and unpickling it could run code")


def load_dcp_metadata(path: str):
    """The ``Metadata`` of a ``torch.distributed.checkpoint`` folder's ``.metadata``, read safely.

    Raises:
        UnsafeCheckpointError: the file names a class outside the metadata's own records.
        OSError, pickle.UnpicklingError, EOFError: unreadable or truncated.
    """
    with open(path, "rb") as f:
        metadata = _DCPMetadataUnpickler(f, path).load()
    from torch.distributed.checkpoint.metadata import Metadata  # noqa: PLC0415

    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{path}: holds a {type(metadata).__name__}, not a "
                                    "torch.distributed.checkpoint Metadata")
    return metadata


def stand_ins_in(obj: Any, path: str = "") -> List[Tuple[str, StandIn]]:
    """Every stand-in inside ``obj`` (namespaces, dicts, lists), with where it sits."""
    found = []
    if isinstance(obj, StandIn):
        found.append((path, obj))
    elif isinstance(obj, argparse.Namespace):
        for k, v in vars(obj).items():
            found += stand_ins_in(v, f"{path}.{k}" if path else k)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            found += stand_ins_in(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found += stand_ins_in(v, f"{path}[{i}]")
    return found
