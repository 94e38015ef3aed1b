"""The training loop's guards against wrong numbers: inf/nan checks and loss-spike skips.

``--check-for-nan-in-loss-and-grad`` (:class:`LossWatch`, :func:`loss_findings`,
:func:`grad_findings`, :func:`stop_if_not_finite`): every rank's micro-batch losses and
gradients are checked before the optimizer step and a finding stops every rank with
:class:`NumericalFaultError` naming the rank and what was found.
``--skip-iterations-with-loss-spike`` (:func:`skip_for_loss_spike`): a step whose loss jumps
above the recent average is not applied.
"""

import math
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from megatron.core import device
from megatron.core.distributed.torch_fsdp2 import local_tensor


class NumericalFaultError(RuntimeError):
    """--check-for-nan-in-loss-and-grad found an inf or a nan; the message names the iteration,
    the rank and the tensor, and every rank raises it before the optimizer step."""


class LossWatch:
    """The forward step, keeping this rank's loss of every micro-batch of the iteration."""

    def __init__(self, forward_step_func: Callable):
        self.forward_step_func = forward_step_func
        self.losses: List[torch.Tensor] = []

    def __call__(self, data_iterator, model):
        output_tensor, loss_func = self.forward_step_func(data_iterator, model)

        def watched(output):
            result = loss_func(output)
            self.losses.append(result[0].detach())
            return result

        return output_tensor, watched


def describe_nonfinite(tensor: torch.Tensor) -> str:
    n_nan = int(torch.isnan(tensor).sum())
    n_inf = int(torch.isinf(tensor).sum())
    return f"{n_nan} nan and {n_inf} inf of {tensor.numel()} values"


def loss_findings(watch: LossWatch) -> List[str]:
    if not watch.losses or bool(torch.isfinite(torch.stack(watch.losses)).all()):
        return []
    first = next(i for i, loss in enumerate(watch.losses) if not torch.isfinite(loss).all())
    return [f"loss of micro-batch {first} is {watch.losses[first].item()}"]


def grad_findings(model) -> List[str]:
    """This rank's parameters whose gradient (``main_grad``) holds an inf or a nan."""
    named = []
    for c, chunk in enumerate(model):
        for name, param in getattr(chunk, "module", chunk).named_parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is not None:
                grad = local_tensor(grad)  # an FSDP2 shard: this rank's part
                named.append((name if len(model) == 1 else f"{name} (model chunk {c})", grad))
    if not named or bool(torch.stack([torch.isfinite(g).all() for _, g in named]).all()):
        return []
    bad = [f"gradient of {name} has {describe_nonfinite(g)}" for name, g in named
           if not torch.isfinite(g).all()]
    return bad[:3] + ([f"and {len(bad) - 3} more gradients"] if len(bad) > 3 else [])


def stop_if_not_finite(findings: List[str], iteration: Optional[int], args, pstate,
                        reduced: bool) -> None:
    """Collective: if any rank found an inf or nan, every rank raises one message naming them."""
    flag = torch.tensor([int(bool(findings))], device=device.current_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return
    where = (f"rank {args.rank} (tensor-parallel rank {pstate.tp_rank}, pipeline-parallel rank "
             f"{pstate.pp_rank}, data-parallel rank {pstate.dp_rank})")
    mine = f"{where}: " + "; ".join(findings) if findings else ""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    when = f"iteration {iteration}" if iteration is not None else "this iteration"
    note = (" (gradients checked after the data-parallel reduction, --overlap-grad-reduce)"
            if reduced else "")
    raise NumericalFaultError(
        f"{when}: inf or nan found (--check-for-nan-in-loss-and-grad){note}: "
        + " | ".join(m for m in everyone if m)
        + f". Every rank stops before the optimizer step of {when}; the checkpoints saved so "
        "far are untouched.")


def skip_for_loss_spike(losses: dict, iteration: Optional[int], args, pstate,
                         history: List[float]) -> bool:
    """--skip-iterations-with-loss-spike: whether this iteration's optimizer step is skipped.

    The iteration's loss (``losses``: the logged values as the log line shows them; its ``lm
    loss``, else its first value) is sent from the
    last pipeline stage to every rank; it is a spike when it is not finite or is more than
    ``--loss-spike-factor`` times the mean of the last ``--loss-spike-window`` losses of steps
    taken, kept in ``history`` (the train state's ``loss_spike_history``, which travels in the
    checkpoint's args, so a resumed run decides alike).
    """
    value, bad = -math.inf, 0.0
    if pstate.is_last_stage(ignore_virtual=True) and losses:
        key = "lm loss" if "lm loss" in losses else next(iter(losses))
        mean = losses[key]
        value, bad = (mean, 0.0) if math.isfinite(mean) else (-math.inf, 1.0)
    both = torch.tensor([bad, value], dtype=torch.float64, device=device.current_device())
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    bad, value = bool(both[0].item()), float(both[1].item())
    window = args.loss_spike_window
    baseline = sum(history[-window:]) / window if len(history) >= window else None
    if not bad and (baseline is None or value <= args.loss_spike_factor * baseline):
        history.append(value)
        del history[:-window]
        return False
    if args.rank == args.world_size - 1:
        why = ("is not finite" if bad else f"{value:.6E} is above {args.loss_spike_factor} x "
               f"{baseline:.6E}, the mean of the last {window} iterations")
        print(f"skipping the optimizer step of iteration {iteration}: the loss {why} "
              "(--skip-iterations-with-loss-spike)", flush=True)
    return True


# On CPU the fp64 sum of squares widens this many gradient values at a time into one reused
# buffer. Widening a whole vocabulary-sized gradient was a fresh 8-bytes-a-value allocation every
# step, whose page faults cost more than the arithmetic (25.8M values: about 110 ms against 30 ms
# in blocks, measured on the project VM; this check runs every step by default).
SUMSQ_CPU_CHUNK = 1 << 16


def local_grad_sumsq(model) -> float:
    """The sum of squares (fp64) of this rank's gradients (``main_grad``, else ``grad``): the
    gradient result --rerun-mode compares between runs and --check-for-large-grads watches."""
    total = torch.zeros((), dtype=torch.float64, device=device.current_device())
    scratch = None
    for chunk in model:
        for param in chunk.parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is None:
                continue
            values = local_tensor(grad).detach().reshape(-1)
            if values.device.type != "cpu":
                values = values.double()
                total += torch.dot(values, values)
                continue
            if scratch is None:
                scratch = torch.empty(SUMSQ_CPU_CHUNK, dtype=torch.float64)
            for part in values.split(SUMSQ_CPU_CHUNK):
                widened = scratch[:part.numel()]
                widened.copy_(part)
                total += torch.dot(widened, widened)
    return float(total.item())
