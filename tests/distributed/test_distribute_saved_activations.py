"""--distribute-saved-activations: full recomputation with each checkpointed chunk's input split
over the tensor-parallel ranks.

On TP = 2 (gloo, float64, dropout on so the recompute must replay the same masks), each recompute
method gives bit-identical losses and gradients with and without the flag: the all-gathered
input is the same bits as the kept one, so nothing may differ. Without dropout, the distributed
run also matches the single-process model (1e-10, see test_gpt_model_tp for that tolerance).
The size of what each checkpoint keeps is read from the autograd graph itself (the saved tensors
of every ``CheckpointFunctionBackward`` node): 1/tp of the ``[s, b, h]`` input with the flag, all
of it without.

The refusals Megatron-LM (and Megatron-Core, for sequence parallelism) make are reproduced as
one-line errors naming the flag.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.model import GPTModel
from megatron.training.arguments import ArgumentsError, parse_args, validate_args
from tests.distributed.test_gpt_model_tp import DROPOUT, full_tensor, reference
from tests.multiprocess import run_on_ranks
from tests.unit.test_gpt_model import BATCH, SEQ, make_batch, make_config

TP = 2
HIDDEN = 32  # make_config's hidden size


def checkpoint_saves(loss):
    """(saved numel, input shape) of every checkpointed chunk in ``loss``'s graph."""
    seen, stack, found = set(), [loss.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CheckpointFunctionBackward":
            shape = getattr(node, "input_0_shape", None)
            found.append((node.saved_tensors[0].numel(), tuple(shape) if shape else None))
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return found


def _run(state, batch, method, distribute, dropout):
    overrides = dict(recompute_granularity="full", recompute_method=method,
                     recompute_num_layers=1, distribute_saved_activations=distribute)
    if dropout:
        overrides.update(DROPOUT)
    model = GPTModel(make_config(**overrides), state)
    model_parallel_cuda_manual_seed(99, state.tp_rank)
    ids, pos, labels = batch
    loss = model(ids, pos, None, labels=labels).mean()
    saves = checkpoint_saves(loss)
    loss.backward()
    grads = {name: full_tensor(p.grad, p, state.tp_group, state.tp_size, True)
             for name, p in model.named_parameters()}
    return loss.detach(), grads, saves


def _body(batch):
    state = parallel_state.initialize_model_parallel(TP)
    out = {}
    for method in ("uniform", "block"):
        for distribute in (False, True):
            for dropout in (False, True):
                out[(method, distribute, dropout)] = _run(state, batch, method, distribute,
                                                          dropout)
    return out if dist.get_rank() == 0 else None


@pytest.mark.slow
def test_distributed_inputs_give_the_same_gradients_and_keep_one_tp_th():
    out = run_on_ranks(_body, TP, make_batch())[0]
    ref_loss, ref_grads, _, _ = reference({})
    full = SEQ * BATCH * HIDDEN
    for method in ("uniform", "block"):
        for dropout in (False, True):
            kept_loss, kept_grads, kept_saves = out[(method, False, dropout)]
            loss, grads, saves = out[(method, True, dropout)]
            assert torch.equal(loss, kept_loss), (method, dropout)
            assert grads.keys() == kept_grads.keys()
            for name in grads:
                assert torch.equal(grads[name], kept_grads[name]), (method, dropout, name)
            # make_config has 2 layers, --recompute-num-layers 1: uniform checkpoints both,
            # block only the first.
            chunks = 2 if method == "uniform" else 1
            assert [n for n, _ in kept_saves] == [full] * chunks, (method, kept_saves)
            assert saves == [(full // TP, (SEQ, BATCH, HIDDEN))] * chunks, (method, saves)
            if not dropout:
                torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-10)
                for name in grads:
                    torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=1e-10,
                                               msg=name)
            else:
                assert abs(loss - ref_loss) > 1e-3, "dropout had no effect"


MINIMAL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
           "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
           "--vocab-size", "64", "--tokenizer-type", "NullTokenizer", "--train-iters", "1"]
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1"]


def _validate(argv, world_size=2):
    args = parse_args(argv=MINIMAL + argv)
    args.world_size = world_size
    return validate_args(args)


@pytest.mark.parametrize("argv, world, message", [
    (FULL, 1, "--distribute-saved-activations splits the saved inputs over the "
              "tensor-parallel ranks: it needs --tensor-model-parallel-size > 1, got 1"),
    (["--tensor-model-parallel-size", "2", "--recompute-granularity", "selective"], 2,
     "--distribute-saved-activations applies only to --recompute-granularity full, got "
     "selective"),
    (["--tensor-model-parallel-size", "2"], 2,
     "--distribute-saved-activations applies only to --recompute-granularity full, got None"),
    (["--tensor-model-parallel-size", "2", "--recompute-granularity", "full"], 2,
     "--distribute-saved-activations needs --recompute-method uniform or block"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"] + FULL, 2,
     "--distribute-saved-activations cannot be combined with --sequence-parallel"),
])
def test_megatron_refusals_in_one_line(argv, world, message):
    with pytest.raises(ArgumentsError) as err:
        _validate(argv + ["--distribute-saved-activations"], world)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_accepted_with_tensor_parallelism_and_full_recompute():
    args = _validate(["--tensor-model-parallel-size", "2", "--distribute-saved-activations"]
                     + FULL)
    assert args.distribute_saved_activations
    assert _validate(["--tensor-model-parallel-size", "2"] + FULL).distribute_saved_activations \
        is False


@pytest.mark.slow
def test_training_run_losses_are_bit_identical(tmp_path):
    """pretrain_gpt at TP 2 x PP 2 with dropout and uniform full recompute: the same losses,
    bit for bit, with and without the flag."""
    from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus

    corpus = write_counting_corpus(str(tmp_path / "corpus" / "count_document"))
    flags = gpt_flags(corpus, 3, tp=2, dropout=0.1, extra=FULL + [
        "--pipeline-model-parallel-size", "2", "--num-layers", "4"])
    runs = [run_on_ranks(run_pretrain, 4, flags + extra)[-1]["losses"]
            for extra in ([], ["--distribute-saved-activations"])]
    assert len(runs[0]) == 3 and runs[0] == runs[1]


def test_memory_estimate_keeps_one_tp_th_of_each_checkpoint_input():
    """The startup estimate, written out by hand as in test_memory_accounting (pp 4, rank 1,
    8 layers, uniform recompute of 1 layer, 3 micro-batches in flight): each in-flight
    micro-batch keeps its 2 chunk inputs of 2sbh bytes, 1/tp of them with the flag, plus one
    layer's recompute workspace."""
    from megatron.training import memory_accounting as ma
    from tests.unit.test_memory_accounting import B, SBH, config

    for distribute, share in ((False, 1), (True, 1 / TP)):
        full = config(num_layers=8, recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1, distribute_saved_activations=distribute)
        layer = ma.layer_activation_bytes(full, B, TP)
        got = ma.activation_bytes_on_rank(full, micro_batch_size=B, num_microbatches=8,
                                          tp_size=TP, pp_size=4, pp_rank=1)
        assert got == pytest.approx(3 * 2 * 2 * SBH * share + layer), distribute
