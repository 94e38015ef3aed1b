"""Process-group settings Megatron applies around start-up: the NCCL flight recorder's
environment (``--flight-recorder-*``), set before the process group exists, and a second
timeout for every group once the first iteration has run
(``--distributed-timeout-seconds-after-init``)."""

import datetime
import os
import warnings
from typing import Dict, MutableMapping, Optional

import torch
import torch.distributed as dist

from megatron.core import device

FR_PATH_VARIABLES = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def flight_recorder_environment(args, environ: MutableMapping[str, str]) -> Dict[str, str]:
    """The flight recorder variables the flags ask for; empty when no dump path is known.

    The dump path is --flight-recorder-dump-path, else a path already in the environment
    (``TORCH_FR_DUMP_TEMP_FILE`` / ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``); an existing folder
    gets the per-rank prefix ``_dump_`` inside it. torch reads the variables when the process
    group is created, so they must be set before then.
    """
    path = (args.flight_recorder_dump_path or environ.get(FR_PATH_VARIABLES[0])
            or environ.get(FR_PATH_VARIABLES[1]))
    if path is None:
        return {}
    prefix = os.path.join(path, "_dump_") if os.path.isdir(path) else path
    if prefix != path:
        warnings.warn(f"flight recorder: '{path}' is a folder; the per-rank dumps are named "
                      f"'{prefix}<rank>'", stacklevel=2)
    return {
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(args.flight_recorder_trace_buffer_size),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": str(int(args.flight_recorder_dump_on_timeout)),
        "TORCH_INCLUDE_STACK_TRACE": str(int(args.flight_recorder_include_stack_trace)),
        "TORCH_INCLUDE_ONLY_ACTIVE": str(int(args.flight_recorder_include_only_active)),
        "TORCH_NCCL_EXTRA_DUMP_ON_EXEC": str(int(args.flight_recorder_extra_dump_on_exec)),
    }


def apply_flight_recorder_environment(args, environ: Optional[MutableMapping[str, str]] = None
                                      ) -> Dict[str, str]:
    """Set the flight recorder variables (:func:`flight_recorder_environment`) in ``environ``
    (default ``os.environ``). A variable the user already set keeps its value, with a warning
    naming both; returns the variables as they now stand."""
    environ = os.environ if environ is None else environ
    wanted = flight_recorder_environment(args, environ)
    for name, value in wanted.items():
        if name in environ:
            if environ[name] != value:
                warnings.warn(f"flight recorder: {name} is already set to '{environ[name]}'; "
                              f"keeping it rather than '{value}'", stacklevel=2)
        else:
            environ[name] = value
    current = {name: environ[name] for name in wanted}
    if current and args.rank == 0:
        print("> flight recorder: " + " ".join(f"{k}={v}" for k, v in current.items()),
              flush=True)
    return current


def process_groups() -> list:
    """Every process group this rank belongs to, the default one first."""
    world = dist.group.WORLD
    others = [g for g in dist.distributed_c10d._world.pg_map if g is not world]
    return [world] + others


def update_pg_timeout(timeout: datetime.timedelta) -> None:
    """Give every process group of this rank ``timeout``, after all ranks have met (a rank
    that changed it early could time out on a collective the others still wait for)."""
    dist.barrier()
    device.synchronize()
    for group in process_groups():
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def timeout_after_init(args, iteration: int, start_iteration: int) -> None:
    """--distributed-timeout-seconds-after-init: after the first iteration of this run (which
    takes longest) every group's timeout becomes that many seconds, as Megatron does."""
    seconds = args.distributed_timeout_seconds_after_init
    if seconds is None or iteration != start_iteration + 1:
        return
    update_pg_timeout(datetime.timedelta(seconds=seconds))


def group_timeout(group) -> datetime.timedelta:
    """The timeout ``group`` currently applies (read from its backend, gloo or NCCL)."""
    backend = group._get_backend(torch.device(device.current_device().type))
    return backend.options._timeout
