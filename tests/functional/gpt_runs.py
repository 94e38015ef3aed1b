"""Tiny end-to-end GPT runs for the functional tests: learnable data and a flag builder."""

import os

import numpy as np

# NullTokenizer ids 0..128, the last (128) the end of document; padded to 256 at TP 1 and 2 alike,
# so every layout builds the same model.
VOCAB_SIZE = 129


def write_counting_corpus(prefix: str, num_docs: int = 200, seed: int = 0) -> str:
    """Documents that count upwards (mod 120) from a random start, each ending in EOD.

    The next token is predictable from the current one, so a working model's loss falls fast.
    """
    from megatron.data.indexed_dataset import IndexedDatasetBuilder, get_idx_path
    from megatron.tokenizer.tokenizer import NullTokenizer

    eod = NullTokenizer(VOCAB_SIZE).eod
    rng = np.random.RandomState(seed)
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(num_docs):
        length = rng.randint(8, 60)
        start = rng.randint(0, 120)
        doc = (start + np.arange(length)) % 120
        builder.add_item(np.append(doc, eod).astype(np.int64))
        builder.end_document()
    builder.finalize(get_idx_path(prefix))
    return prefix


def gpt_flags(data_prefix: str, train_iters: int, *, tp: int = 1, micro_batch: int = 2,
              global_batch: int = 4, dropout: float = 0.1, lr: float = 5e-3,
              extra=()) -> list:
    flags = f"""
    --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16
    --max-position-embeddings 16 --micro-batch-size {micro_batch}
    --global-batch-size {global_batch} --lr {lr} --min-lr 1e-4 --lr-decay-style cosine
    --lr-warmup-iters 1 --train-iters {train_iters} --weight-decay 0.1 --clip-grad 1.0
    --hidden-dropout {dropout} --attention-dropout {dropout} --log-interval 1
    --eval-interval 1000 --eval-iters 2 --tokenizer-type NullTokenizer
    --vocab-size {VOCAB_SIZE} --split 90,8,2 --num-workers 0 --device cpu --seed 1234
    --tensor-model-parallel-size {tp}
    """.split()
    return flags + ["--data-path", data_prefix] + list(extra)


def run_pretrain(argv):
    """Run pretrain_gpt's pretrain() in this (already initialised) process; return losses."""
    import pretrain_gpt
    from megatron.training import global_vars
    from megatron.training.training import pretrain

    try:
        state = pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                         pretrain_gpt.model_provider, None, pretrain_gpt.forward_step, argv=argv)
        return {"losses": state.train_loss_history, "iteration": state.iteration,
                "valid": state.final_valid_losses}
    finally:
        global_vars.unset_global_variables()
