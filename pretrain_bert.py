"""Pretrain BERT: ``torchrun --nproc_per_node N pretrain_bert.py <Megatron flags>``.

Masked-LM plus, unless ``--bert-no-binary-head``, sentence-order prediction, on sentence data made
by ``tools/preprocess_data.py --split-sentences`` with a WordPiece vocabulary. The training loop,
checkpoints and logging are the shared :func:`megatron.training.training.pretrain`.
"""

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.training import global_vars
from megatron.training.arguments import ArgumentsError, validate_bert_args
from megatron.core import device, tensor_parallel
from megatron.training.training import model_stage, pretrain, print_rank_0

# What each pipeline stage reads from a batch. Every stage needs the padding mask: each encoder
# layer's attention masks the padded keys.
_FIRST_STAGE_KEYS = ("text", "types")
_LAST_STAGE_KEYS = ("labels", "loss_mask", "is_random")


def extra_args_provider(parser):
    """BERT's default tokenizer, and its checks (:func:`validate_bert_args`) at parse time.

    Checking as the flags are parsed, before any process group or tokenizer exists, lets a
    wrong ``--tokenizer-type`` end the run with one line naming the flag rather than with an
    error of the tokenizer it selected.
    """
    # checkpoint_model_type: the --model-type that tools/checkpoint/convert.py needs for this
    # run's checkpoints, named in the load error of a layout mismatch.
    parser.set_defaults(tokenizer_type="BertWordPieceLowerCase", checkpoint_model_type="BERT")
    parse = parser.parse_args

    def parse_and_check(args=None, namespace=None):
        parsed = parse(args, namespace)
        try:
            validate_bert_args(parsed)
        except ArgumentsError as err:
            parser.error(str(err))
        return parsed

    parser.parse_args = parse_and_check
    return parser


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage=None):
    """This pipeline stage's BERT model (virtual stage ``vp_stage`` with interleaving), from
    the run's flags."""
    from megatron.training.arguments import build_configs
    from megatron.model.bert_model import BertModel

    args = global_vars.get_args()
    # Again here: --use-checkpoint-args may have replaced flags after they were parsed.
    validate_bert_args(args)
    config = build_configs(args).model
    print_rank_0("building BERT model ...")
    pstate = global_vars.get_parallel_state()
    if vp_stage is not None:
        pstate = pstate.for_virtual_stage(vp_stage)
    return BertModel(config, pstate,
                     num_tokentypes=2 if args.bert_binary_head else 0,
                     add_binary_head=args.bert_binary_head, parallel_output=True,
                     pre_process=pre_process, post_process=post_process, init_seed=args.seed)


def get_batch(data_iterator, stage=None):
    """One micro-batch, as the tensors this pipeline stage uses (None for the others).

    TP rank 0 reads the batch and broadcasts it to the other tensor-parallel ranks. Every stage
    reads it (each needs the padding mask); the first stage also takes the tokens and token
    types, the last the labels, the loss mask and the sentence-order targets. ``stage`` is
    ``(first, last)`` of the model chunk (``megatron.training.training.model_stage``); None asks the parallel
    state (right without virtual stages).

    Returns:
        ``(tokens, types, sentence_order, loss_mask, lm_labels, padding_mask)``: ``[b, s]``
        int64 each, except ``sentence_order`` ``[b]``.
    """
    pstate = global_vars.get_parallel_state()
    first, last = stage if stage is not None else (pstate.is_first_stage(),
                                                   pstate.is_last_stage())
    keys = (_FIRST_STAGE_KEYS if first else ()) + (_LAST_STAGE_KEYS if last else ())
    keys += ("padding_mask",)
    data = next(data_iterator) if data_iterator is not None else None
    batch = tensor_parallel.broadcast_data(list(keys), data, torch.int64, pstate.tp_group,
                                           pstate.tp_ranks[0])
    return (batch.get("text"), batch.get("types"), batch.get("is_random"),
            batch.get("loss_mask"), batch.get("labels"), batch["padding_mask"])


def _average_over_dp(values: torch.Tensor) -> torch.Tensor:
    """The mean of ``values`` over the data-parallel ranks (detached): what the log shows."""
    averaged = values.detach().clone()
    pstate = global_vars.get_parallel_state()
    if pstate.dp_size > 1:
        dist.all_reduce(averaged, group=pstate.dp_group)
        averaged /= pstate.dp_size
    return averaged


def loss_func(loss_mask: torch.Tensor, sentence_order: torch.Tensor, output_tensor):
    """Masked-LM mean over the masked positions, plus the sentence-order cross entropy.

    Args:
        loss_mask: ``[b, s]``, 1 at the masked positions.
        sentence_order: ``[b]``, 1 where the two segments were swapped.
        output_tensor: the last stage's ``(lm loss per token [b, s], binary logits [b, 2] or
            None)``.

    Returns:
        The loss to backpropagate, and ``lm loss`` (and ``sop loss``) averaged over DP ranks
        for the log.
    """
    lm_losses, binary_logits = output_tensor
    mask = loss_mask.view(-1).float()
    lm_loss = torch.sum(lm_losses.float().view(-1) * mask) / mask.sum().clamp(min=1.0)
    if binary_logits is None:
        return lm_loss, {"lm loss": _average_over_dp(lm_loss.view(1))[0]}
    sop_loss = F.cross_entropy(binary_logits.view(-1, 2).float(), sentence_order.view(-1),
                               ignore_index=-1)
    averaged = _average_over_dp(torch.stack([lm_loss, sop_loss]))
    return lm_loss + sop_loss, {"lm loss": averaged[0], "sop loss": averaged[1]}


def forward_step(data_iterator, model):
    """One micro-batch forward; returns the model's output and how to reduce it to a loss."""
    args = global_vars.get_args()
    timers = global_vars.get_timers()
    timers("batch-generator", log_level=2).start()
    stage = (model_stage(model),) if global_vars.get_parallel_state().virtual_pp_size else ()
    tokens, types, sentence_order, loss_mask, lm_labels, padding_mask = get_batch(
        data_iterator, *stage)
    timers("batch-generator", log_level=2).stop()
    if not args.bert_binary_head:
        types = None  # no token-type embeddings without the sentence-order task
    dev = device.current_device()

    def to_device(tensor):
        return None if tensor is None else tensor.to(dev)

    output_tensor = model(to_device(tokens), to_device(padding_mask),
                          tokentype_ids=to_device(types), lm_labels=to_device(lm_labels))
    return output_tensor, partial(loss_func, to_device(loss_mask), to_device(sentence_order))


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """BERT sentence-pair datasets from --data-path (or the explicit per-split paths)."""
    from megatron.training.arguments import build_data_config
    from megatron.data.bert_dataset import BertDatasetConfig, build_train_valid_test_datasets

    args = global_vars.get_args()
    data = build_data_config(args)
    config = BertDatasetConfig(
        seed=data.seed, seq_length=data.seq_length, split=data.split,
        data_cache_path=data.data_cache_path, masked_lm_prob=data.mask_prob,
        short_seq_prob=data.short_seq_prob, binary_head=args.bert_binary_head,
        # Megatron's BERT masks whole words, in runs of up to 3 (probability ~ 1/n).
        whole_word_masking=True, max_ngrams=3, mmap_bin_files=data.mmap_bin_files,
        mid_level_dataset_surplus=data.mid_level_dataset_surplus,
        object_storage_cache_path=data.object_storage_cache_path, enable_msc=data.enable_msc)
    print_rank_0("> building train, validation, and test datasets for BERT ...")
    return build_train_valid_test_datasets(
        config, data.data_path, train_val_test_num_samples, global_vars.get_tokenizer(),
        train_data_path=data.train_data_path, valid_data_path=data.valid_data_path,
        test_data_path=data.test_data_path)


def main(argv=None):
    """Train with the command line's flags (or ``argv``); a user's mistake exits with one line."""
    from megatron.errors import exit_on_user_error

    with exit_on_user_error():
        pretrain(train_valid_test_datasets_provider, model_provider, None, forward_step,
                 extra_args_provider=extra_args_provider, argv=argv)
    # Leave the process group cleanly: gloo ranks that exit with it open can abort at exit.
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
