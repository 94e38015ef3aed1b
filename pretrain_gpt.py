"""Pretrain a GPT model: ``torchrun --nproc_per_node N pretrain_gpt.py <Megatron flags>``."""

from functools import partial

import torch
import torch.distributed as dist

from megatron.training import global_vars
from megatron.core import device, tensor_parallel
from megatron.core.config import TransformerConfig
from megatron.core.context_parallel import get_batch_on_this_cp_rank
from megatron.data.dataset_utils import (get_ltor_masks_and_position_ids, mask_pad_tokens,
                                         pad_token_id)
from megatron.data.document_masks import inter_document_masks
from megatron.data.gpt_dataset import GPTDatasetConfig, build_train_valid_test_datasets
from megatron.data.sft_dataset import sft_attention_mask
from megatron.model import GPTModel
from megatron.training import distillation
from megatron.training.training import model_stage, pretrain, print_rank_0


def model_provider(pre_process: bool = True, post_process: bool = True,
                   vp_stage=None) -> GPTModel:
    """This pipeline stage's GPT model (virtual stage ``vp_stage`` with interleaving), from the
    run's flags."""
    from megatron.training.arguments import build_configs

    args = global_vars.get_args()
    configs = build_configs(args)
    config: TransformerConfig = configs.model
    print_rank_0("building GPT model ...")
    pstate = global_vars.get_parallel_state()
    if vp_stage is not None:
        pstate = pstate.for_virtual_stage(vp_stage)
    # Sequence and context parallelism come with the parallel state (the layout).
    model = GPTModel(config, pstate, pre_process=pre_process,
                     post_process=post_process, parallel_output=True, init_seed=args.seed,
                     moe_config=configs.moe, mtp_num_layers=args.mtp_num_layers,
                     mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
                     mtp_use_repeated_layer=args.mtp_use_repeated_layer,
                     mtp_detach_heads=args.mtp_detach_heads, mtp_hsm=args.mtp_hsm,
                     mtp_standalone=getattr(args, "mtp_standalone", False),
                     mtp_stage=_is_mtp_stage(args, pstate))
    kd = distillation.setup(args, global_vars.get_parallel_state())
    if kd is not None:
        kd.attach(model)
    return model


def _is_mtp_stage(args, pstate) -> bool:
    """The (virtual) stage ``pstate`` answers for is the layout's standalone MTP stage
    (--mtp-standalone)."""
    from megatron.core.pipeline_parallel.layer_layout import is_mtp_standalone_stage

    return getattr(args, "mtp_standalone", False) and is_mtp_standalone_stage(
        args.pipeline_model_parallel_layout, pstate.pp_size, pstate.pp_rank,
        pstate.virtual_pp_rank if pstate.virtual_pp_size is not None else None)


def _chunk_is_mtp_stage(model) -> bool:
    """A (wrapped) model chunk holds the standalone MTP stage."""
    while not hasattr(model, "mtp_standalone") and hasattr(model, "module"):
        model = model.module
    return bool(getattr(model, "mtp_standalone", False)) and model.mtp is not None


def get_batch(data_iterator, stage=None, with_sample_index: bool = False):
    """Tokens, labels, loss mask, attention mask and position ids of one micro-batch.

    TP rank 0 reads the batch and broadcasts it to the other tensor-parallel ranks. With pipeline
    parallelism a stage gets only what it uses, as in Megatron: the first (virtual) stage tokens,
    position ids and the attention mask, the last labels, the loss mask and the attention mask
    (and, with ``--mtp-num-layers``, the tokens and position ids too: multi-token prediction
    runs there), a standalone MTP stage the tokens, position ids and attention mask; the
    others are None. The attention mask is None (causal) unless
    ``--reset-attention-mask`` or ``--dataloader-inter-document-masking`` makes it depend on the
    data; a middle stage then reads the batch for the mask alone, and otherwise reads nothing.
    With ``--dataloader-inter-document-masking`` the samples' ``cu_seqlens`` give each token the
    positions of its own document and keep its attention inside it
    (:mod:`megatron.data.document_masks`). ``stage`` is ``(first, last)`` of the chunk
    the batch is for (:func:`megatron.training.training.model_stage`), or ``(first, last,
    mtp)`` where the chunk may be a standalone MTP stage; None asks the parallel state (right
    without virtual stages).

    With context parallelism every rank of a cp group reads the same samples and keeps its own
    ``s / cp`` tokens of each (chunks ``r`` and ``2 cp - 1 - r``): tokens, labels, loss mask and
    position ids alike, and the attention mask's rows of those tokens.

    ``with_sample_index`` (offline distillation): a sixth value, the samples' dataset indices
    ``[b]`` on the last stage (None elsewhere).
    """
    args = global_vars.get_args()
    tokenizer = global_vars.get_tokenizer()
    pstate = global_vars.get_parallel_state()
    first, last, *mtp = stage if stage is not None else (pstate.is_first_stage(),
                                                         pstate.is_last_stage())
    mtp_here = mtp[0] if mtp else _is_mtp_stage(args, pstate)
    if args.sft:
        return get_sft_batch(data_iterator, pstate, first, last, args.mtp_num_layers, mtp_here)
    documents = args.dataloader_inter_document_masking
    if not (first or last or mtp_here or args.reset_attention_mask or documents):
        return (None,) * (6 if with_sample_index else 5)
    data = next(data_iterator) if data_iterator is not None else None
    keys = ["text", "cu_seqlens"] if documents else ["text"]
    keys += ["sample_index"] if with_sample_index else []
    batch = tensor_parallel.broadcast_data(keys, data, torch.int64, pstate.tp_group,
                                           pstate.tp_ranks[0])
    text = batch["text"].long()
    tokens = text[:, :-1].contiguous()    # [b, s]
    labels = text[:, 1:].contiguous()     # [b, s]
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, tokenizer.eod, args.reset_position_ids, args.reset_attention_mask,
        args.eod_mask_loss)
    if documents:
        attention_mask, position_ids = inter_document_masks(batch["cu_seqlens"], tokens.shape[1])
    mask_pad_tokens(tokens, labels, loss_mask,
                    pad_token_id(tokenizer, args.allow_ambiguous_pad_tokens))
    if not (args.reset_attention_mask or documents):
        # The mask is exactly causal: None says so, and attention then uses its causal kernels
        # (upper-triangular softmax, SDPA's is_causal), which skip the masked half.
        attention_mask = None
    if pstate.cp_size > 1:
        local = get_batch_on_this_cp_rank(
            {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
             "attention_mask": attention_mask, "position_ids": position_ids},
            pstate.cp_size, pstate.cp_rank)
        tokens, labels, loss_mask = local["tokens"], local["labels"], local["loss_mask"]
        attention_mask, position_ids = local["attention_mask"], local["position_ids"]
    if not (first or mtp_here or (last and args.mtp_num_layers)):
        tokens = position_ids = None
    if not last:
        labels = loss_mask = None
    if with_sample_index:
        index = batch["sample_index"] if last else None
        return tokens, labels, loss_mask, attention_mask, position_ids, index
    return tokens, labels, loss_mask, attention_mask, position_ids


def get_sft_batch(data_iterator, pstate, first: bool, last: bool, mtp_num_layers,
                  mtp_here: bool = False):
    """get_batch with --sft: the packed sample's own tokens, labels, loss mask and position ids
    (megatron/data/sft_dataset.py). Each conversation of a pack attends only to itself; a batch
    whose samples each hold one conversation gets None (plain causal attention). Every stage
    reads the batch, since the attention mask depends on it, and keeps the position ids: the
    rotary angles of every layer follow them, restarting at 0 for each conversation as
    Megatron's packed sequences (``cu_seqlens``) rotate them. With context parallelism each
    rank keeps its ``s / cp`` tokens of the pack (chunks ``r`` and ``2 cp - 1 - r``) and the
    mask's rows of them; attention across the ranks computes the whole pack's attention, so
    the result is the one-process one (Megatron cuts each conversation into ``2 cp`` chunks
    instead: another share of the work between the ranks, the same numbers)."""
    data = next(data_iterator) if data_iterator is not None else None
    src = pstate.tp_ranks[0]
    ints = tensor_parallel.broadcast_data(["tokens", "labels", "position_ids", "segment_ids"],
                                          data, torch.int64, pstate.tp_group, src)
    loss_mask = tensor_parallel.broadcast_data(["loss_mask"], data, torch.float32,
                                               pstate.tp_group, src)["loss_mask"]
    attention_mask = sft_attention_mask(ints["segment_ids"])
    tokens, position_ids = ints["tokens"], ints["position_ids"]
    labels = ints["labels"]
    if pstate.cp_size > 1:
        local = get_batch_on_this_cp_rank(
            {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
             "attention_mask": attention_mask, "position_ids": position_ids},
            pstate.cp_size, pstate.cp_rank)
        tokens, labels, loss_mask = local["tokens"], local["labels"], local["loss_mask"]
        attention_mask, position_ids = local["attention_mask"], local["position_ids"]
    if not (first or mtp_here or (last and mtp_num_layers)):
        tokens = None
    if not last:
        labels = loss_mask = None
    return tokens, labels, loss_mask, attention_mask, position_ids


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Masked mean of the per-token losses; the logged value is averaged over DP ranks.

    With context parallelism each rank holds part of every sequence: the masked sum of its own
    tokens is divided by the token count of the whole cp group, so the logged loss (summed over
    the group) is the one-rank loss; the loss returned for backward is multiplied by cp, since
    gradients are averaged over data x context ranks.
    """
    pstate = global_vars.get_parallel_state()
    losses = output_tensor.float().view(-1)          # [b * s]
    mask = loss_mask.view(-1).float()
    if global_vars.get_args().calculate_per_token_loss:
        return per_token_loss(losses, mask)
    if pstate.cp_size > 1:
        local_sum = torch.sum(losses * mask)
        totals = torch.stack([local_sum.detach(), mask.sum()])
        dist.all_reduce(totals, group=pstate.cp_group)
        count = totals[1].clamp(min=1.0)
        loss = local_sum * pstate.cp_size / count
        averaged = totals[0] / count
    else:
        loss = torch.sum(losses * mask) / mask.sum().clamp(min=1.0)
        averaged = loss.detach().clone()
    if pstate.dp_size > 1:
        dist.all_reduce(averaged, group=pstate.dp_group)
        averaged /= pstate.dp_size
    return loss, {"lm loss": averaged}


def per_token_loss(losses: torch.Tensor, mask: torch.Tensor):
    """--calculate-per-token-loss: the masked sum of this rank's per-token losses and the number
    of tokens it counts, as Megatron returns them; the schedule and the gradient reduction divide
    by the count over the whole global batch, and the log shows sum / count over it too."""
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), mask.sum().detach()])}


def forward_step(data_iterator, model):
    """One micro-batch forward; returns the per-token losses and how to reduce them."""
    timers = global_vars.get_timers()
    timers("batch-generator", log_level=2).start()
    # With virtual stages the chunk tells which stage it is; otherwise the parallel state does
    # (and get_batch keeps Megatron's one-argument call; only distillation asks it for the
    # samples' dataset indices too).
    stage = ((*model_stage(model), _chunk_is_mtp_stage(model)),
             ) if global_vars.get_parallel_state().virtual_pp_size else ()
    kd = distillation.setup(global_vars.get_args(), global_vars.get_parallel_state())
    indices = {"with_sample_index": True} if kd is not None else {}
    batch = get_batch(data_iterator, *stage, **indices)
    tokens, labels, loss_mask, attention_mask, position_ids = batch[:5]
    timers("batch-generator", log_level=2).stop()
    dev = device.current_device()

    def to_device(tensor):
        return None if tensor is None else tensor.to(dev)

    # The loss mask also reaches the model, for multi-token prediction's loss.
    extra = {"loss_mask": to_device(loss_mask)} if global_vars.get_args().mtp_num_layers else {}
    output_tensor = model(to_device(tokens), to_device(position_ids), to_device(attention_mask),
                          labels=to_device(labels), **extra)
    lm_loss = partial(loss_func, to_device(loss_mask))
    if kd is not None:  # teacher logits saved, or the distillation term mixed in
        return output_tensor, partial(kd.loss_func, lm_loss, to_device(loss_mask), batch[5])
    return output_tensor, lm_loss


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """GPT datasets from --data-path (or the explicit per-split paths, or --mock-data)."""
    from megatron.data.fim_dataset import resolve_fim_config
    from megatron.training.arguments import build_data_config

    args = global_vars.get_args()
    data = build_data_config(args)
    tokenizer = global_vars.get_tokenizer()
    if args.sft:
        from megatron.data.sft_dataset import build_sft_datasets

        print_rank_0("> building train, validation, and test SFT datasets for GPT ...")
        return build_sft_datasets(
            data.data_path, train_val_test_num_samples, data.seq_length, data.split, tokenizer,
            (data.train_data_path, data.valid_data_path, data.test_data_path),
            args.context_parallel_size)
    config = GPTDatasetConfig(
        seed=data.seed, seq_length=data.seq_length, split=data.split,
        data_cache_path=data.data_cache_path, reset_position_ids=data.reset_position_ids,
        reset_attention_mask=data.reset_attention_mask, eod_mask_loss=data.eod_mask_loss,
        mock=data.mock_data, vocab_size=tokenizer.vocab_size,
        mmap_bin_files=data.mmap_bin_files, fim=resolve_fim_config(data.fim, tokenizer),
        mid_level_dataset_surplus=data.mid_level_dataset_surplus,
        per_dataset_sequences_path=data.per_dataset_sequences_path,
        inter_document_masking=data.dataloader_inter_document_masking,
        object_storage_cache_path=data.object_storage_cache_path, enable_msc=data.enable_msc)
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = build_train_valid_test_datasets(
        config, data.data_path, train_val_test_num_samples,
        train_data_path=data.train_data_path, valid_data_path=data.valid_data_path,
        test_data_path=data.test_data_path,
        multiple_validation_sets=data.multiple_validation_sets)
    if args.logits_save_dir is not None or args.logits_load_dir is not None:
        datasets = distillation.with_sample_index(datasets)  # finds the teacher rows
    return datasets


if __name__ == "__main__":
    from megatron.errors import exit_on_user_error

    with exit_on_user_error():
        pretrain(train_valid_test_datasets_provider, model_provider, None, forward_step)
    # Leave the process group cleanly: gloo ranks that exit with it open can abort at exit.
    if dist.is_initialized():
        dist.destroy_process_group()
