"""Zero-shot evaluation of a GPT checkpoint under any tensor / pipeline / data-parallel layout.

``--task WIKITEXT103`` sums the per-token losses the model computes (softmax over the padded
vocabulary, as in training) over the rolling windows of :class:`LMWindowDataset` and reports, as
Megatron-LM does, ``avg loss`` = the sum / (tokens - 1), ``ppl`` = exp(avg loss), ``adjusted
ppl`` = exp(avg loss x token ratio) with ``token ratio`` = (tokens - 1) / (original words - 1),
which makes perplexities of different tokenizers comparable per word; both exponents are capped
at 20 as Megatron-LM caps them.

``--task LAMBADA`` counts passages whose every target token is the model's greedy choice (argmax
over the tokenizer's vocabulary; the padding rows added for tensor parallelism never win).

Micro-batches of ``--micro-batch-size`` samples go through the forward-only pipeline schedule,
``--global-batch-size / (--micro-batch-size x DP)`` of them per schedule call; data-parallel ranks
take interleaved blocks of samples and their sums are added up at the end.
"""

import functools
import math
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.training import global_vars
from megatron.training.arguments import build_configs
from megatron.core import device
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.data.dataset_utils import get_ltor_masks_and_position_ids
from megatron.inference import load_model_for_inference
from megatron.model import GPTModel
from megatron.training.training import pipeline_tensor_shape
from megatron.training.utils import print_rank_0
from tasks.zeroshot_gpt.datasets import build_lambada_dataset, build_perplexity_dataset

METRICS = {"WIKITEXT103": "loss", "LAMBADA": "accuracy"}
# exp() of a larger average loss is reported as exp(20), as Megatron-LM reports it.
MAX_EXPONENT = 20.0


def get_model_provider(metric: str):
    """A model provider for ``metric``: per-token losses on the split vocabulary for "loss",
    logits gathered over the whole vocabulary for "accuracy"."""
    if metric not in ("loss", "accuracy"):
        raise ValueError(f"unknown evaluation metric {metric!r}; expected 'loss' or 'accuracy'")

    def model_provider(pre_process: bool = True, post_process: bool = True) -> GPTModel:
        args = global_vars.get_args()
        print_rank_0("building GPT model ...")
        return GPTModel(build_configs(args).model, global_vars.get_parallel_state(),
                        pre_process=pre_process, post_process=post_process,
                        parallel_output=metric == "loss", init_seed=args.seed)

    return model_provider


def dp_micro_batches(num_samples: int, micro_batch_size: int, dp_rank: int,
                     dp_size: int) -> List[List[Optional[int]]]:
    """Sample indices of this DP rank's micro-batches; None fills the last ones.

    Samples are dealt in blocks of ``micro_batch_size x dp_size``, DP rank ``r`` taking the
    ``r``-th slice of each block, so every rank runs the same number of full micro-batches
    (their shape is fixed for the pipeline) and no sample is counted twice.
    """
    block = micro_batch_size * dp_size
    batches = []
    for start in range(0, num_samples, block):
        first = start + dp_rank * micro_batch_size
        batches.append([i if i < num_samples else None
                        for i in range(first, first + micro_batch_size)])
    return batches


def collate(dataset, indices: List[Optional[int]], args, eod: int) -> Dict[str, torch.Tensor]:
    """Model inputs of one micro-batch; a None index becomes a padding sample scored nowhere."""
    texts, masks = [], []
    for i in indices:
        if i is None:
            texts.append(np.full(args.seq_length + 1, eod, dtype=np.int64))
            masks.append(np.zeros(args.seq_length, dtype=np.float32))
        else:
            text, mask = dataset[i]
            texts.append(text)
            masks.append(mask)
    dev = device.current_device()
    text = torch.from_numpy(np.stack(texts)).to(dev)                  # [b, s + 1]
    tokens = text[:, :-1].contiguous()                                # [b, s]
    labels = text[:, 1:].contiguous()                                 # [b, s]
    attention_mask, _, position_ids = get_ltor_masks_and_position_ids(
        tokens, eod, args.reset_position_ids, args.reset_attention_mask, args.eod_mask_loss)
    return {"tokens": tokens, "labels": labels, "attention_mask": attention_mask,
            "position_ids": position_ids,
            "loss_mask": torch.from_numpy(np.stack(masks)).to(dev)}   # [b, s]


def _loss_sum(loss_mask: torch.Tensor, losses: torch.Tensor):
    """Sum of the scored per-token losses ``[b, s]`` and the number of scored tokens."""
    mask = loss_mask.double()
    total = torch.sum(losses.double() * mask)
    return total, {"sum": total, "scored": mask.sum()}


def _correct_count(labels: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int,
                   logits: torch.Tensor):
    """Samples whose scored targets are all the argmax of ``logits`` ``[b, s, V]`` over the
    first ``vocab_size`` ids, and the number of samples scored at all."""
    predictions = logits[..., :vocab_size].argmax(dim=-1)             # [b, s]
    scored = loss_mask > 0                                            # [b, s]
    has_target = scored.any(dim=-1)                                   # [b]
    correct = ((predictions == labels) | ~scored).all(dim=-1) & has_target
    count = correct.sum().double()
    return count, {"sum": count, "scored": has_target.sum().double()}


def forward_step(metric: str, vocab_size: int, data_iterator, model):
    """The schedule's forward step: the model on one micro-batch, and how to reduce its output
    on the last stage (earlier stages only pass their hidden states on)."""
    batch = next(data_iterator)
    if metric == "loss":
        losses = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                       labels=batch["labels"])                        # [b, s] on the last stage
        return losses, functools.partial(_loss_sum, batch["loss_mask"])
    logits = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
    return logits, functools.partial(_correct_count, batch["labels"], batch["loss_mask"],
                                     vocab_size)


def schedule_kwargs(args, pstate) -> dict:
    """Pipeline keywords of the forward-only schedule (none without pipelining)."""
    if pstate.pp_size == 1:
        return {}
    dtype = torch.float32 if args.fp32_residual_connection else args.params_dtype
    kwargs = {"communicator": P2PCommunicator.from_parallel_state(pstate, dtype,
                                                                  device.current_device()),
              "tensor_shape": pipeline_tensor_shape(args, pstate)}
    return kwargs


def _schedule_groups(micro_batches: list, per_call: int, pstate, micro_batch_size: int):
    """Micro-batches in groups of ``per_call`` per schedule call; the interleaved schedule needs
    a multiple of the pipeline size, so its groups are topped up with padding micro-batches."""
    for start in range(0, len(micro_batches), per_call):
        group = micro_batches[start:start + per_call]
        if pstate.virtual_pp_size is not None:
            group += [[None] * micro_batch_size] * (-len(group) % pstate.pp_size)
        yield group


def evaluate(dataset, chunks, metric: str, args, pstate, tokenizer):
    """``(sum, scored)`` over the whole dataset, the same on every rank: the summed token
    losses and the scored tokens ("loss"), or the correct and the scored samples ("accuracy")."""
    schedule = get_forward_backward_func(pstate.pp_size, pstate.virtual_pp_size)
    kwargs = schedule_kwargs(args, pstate)
    step = functools.partial(forward_step, metric, tokenizer.vocab_size)
    micro_batches = dp_micro_batches(len(dataset), args.micro_batch_size, pstate.dp_rank,
                                     pstate.dp_size)
    totals = torch.zeros(2, dtype=torch.float64, device=device.current_device())
    groups = _schedule_groups(micro_batches, max(1, args.num_micro_batches), pstate,
                              args.micro_batch_size)
    with torch.no_grad():
        for call, group in enumerate(groups):
            if call % args.log_interval == 0:
                print_rank_0(f"> working on iteration: {call}")
            # Every model chunk walks the same micro-batches (only the first and last use them).
            iterators = [(collate(dataset, g, args, tokenizer.eod) for g in group)
                         for _ in chunks]
            logged = schedule(forward_step_func=step, data_iterator=iterators, model=chunks,
                              num_microbatches=len(group), forward_only=True, **kwargs)
            for values in logged:
                totals += torch.stack([values["sum"], values["scored"]])
    dist.all_reduce(totals, group=pstate.dp_group)
    if pstate.pp_size > 1:
        # Only the last stage computed anything; every rank gets its totals.
        dist.all_reduce(totals, group=pstate.pp_group)
    return float(totals[0]), float(totals[1])


def perplexity_results(loss_sum: float, scored: float, dataset) -> dict:
    targets = dataset.num_tokenized_tokens - 1
    if round(scored) != targets:
        raise RuntimeError(f"scored {scored} tokens of {targets}; the evaluation windows do not "
                           "cover the text exactly once")
    avg_loss = loss_sum / targets
    token_ratio = targets / max(1, dataset.num_original_tokens - 1)
    return {"avg loss": avg_loss, "ppl": math.exp(min(MAX_EXPONENT, avg_loss)),
            "adjusted ppl": math.exp(min(MAX_EXPONENT, avg_loss * token_ratio)),
            "token ratio": token_ratio, "num_tokenized_tokens": dataset.num_tokenized_tokens,
            "num_original_tokens": dataset.num_original_tokens}


def accuracy_results(correct: float, scored: float, dataset) -> dict:
    if round(scored) != len(dataset):
        raise RuntimeError(f"scored {scored} passages of {len(dataset)}")
    return {"number correct": correct, "total examples": len(dataset),
            "avg accuracy": correct / len(dataset)}


def format_results(label: str, metric: str, result: dict) -> str:
    """Megatron-LM's result line."""
    line = f" validation results on {label} | "
    if metric == "loss":
        return line + (f"avg loss: {result['avg loss']:.4E} | ppl: {result['ppl']:.4E} | "
                       f"adjusted ppl: {result['adjusted ppl']:.4E} | "
                       f"token ratio: {result['token ratio']} |")
    return line + (f"number correct: {result['number correct']:.4E} | "
                   f"total examples: {result['total examples']:.4E} | "
                   f"avg accuracy: {result['avg accuracy']:.4E}")


def build_dataset(task: str, path: str, args, tokenizer):
    if task == "LAMBADA":
        return build_lambada_dataset(path, tokenizer, args.seq_length, args.strict_lambada)
    return build_perplexity_dataset(path, tokenizer, args.seq_length, args.overlapping_eval,
                                    args.padded_vocab_size)


def main(args, pstate, tokenizer) -> List[dict]:
    """Evaluate ``--load`` on each ``--valid-data`` file; print Megatron-LM's result block on the
    last rank; return one result dict per file (on every rank).

    The data is read before the model is loaded, so a bad file is reported at once.
    """
    metric = METRICS[args.task]
    datasets = []
    for path in args.valid_data:
        datasets.append(build_dataset(args.task, path, args, tokenizer))
        print_rank_0(f"> {args.task}: {len(datasets[-1])} samples from {path}")
    chunks, iteration = load_model_for_inference(get_model_provider(metric), args, pstate)
    results = []
    for path, dataset in zip(args.valid_data, datasets):
        total, scored = evaluate(dataset, chunks, metric, args, pstate, tokenizer)
        result = (perplexity_results if metric == "loss" else accuracy_results)(
            total, scored, dataset)
        result.update(task=args.task, path=path, iteration=iteration)
        label = args.task if len(args.valid_data) == 1 else f"{args.task} ({path})"
        if dist.get_rank() == dist.get_world_size() - 1:
            line = format_results(label, metric, result)
            print("-" * (len(line) + 1), line, "-" * (len(line) + 1), sep="\n", flush=True)
        results.append(result)
    print_rank_0("done :-)")
    return results
