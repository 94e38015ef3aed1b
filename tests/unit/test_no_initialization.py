"""--no-initialization: the model's weights are not drawn (no random number is used, every
weight starts at zero), and loading a model's weights gives exactly the initialised model."""

import torch

from megatron.model import GPTModel
from megatron.training.arguments import parse_args, validate_args
from tests.unit.test_gpt_model import make_batch, make_config, single_process_state


def test_no_weight_is_drawn_and_a_load_restores_the_model():
    torch.manual_seed(7)
    reference = GPTModel(make_config(), single_process_state())
    before = torch.get_rng_state()
    empty = GPTModel(make_config(perform_initialization=False), single_process_state())
    assert torch.equal(torch.get_rng_state(), before)  # nothing drawn
    drawn = {n: p for n, p in reference.named_parameters()
             if not torch.all(p == p.flatten()[0])}  # not constant: came from the generator
    assert len(drawn) >= 8  # every linear layer and the embedding
    for name, param in empty.named_parameters():
        if name in drawn:
            assert torch.count_nonzero(param) == 0, name
    empty.load_state_dict(reference.state_dict())
    ids, pos, _ = make_batch()
    torch.testing.assert_close(empty(ids, pos, None), reference(ids, pos, None), rtol=0, atol=0)


def test_learnable_softmax_offset_is_not_drawn_either():
    before = torch.get_rng_state()
    model = GPTModel(make_config(perform_initialization=False, softmax_type="learnable"),
                     single_process_state())
    assert torch.equal(torch.get_rng_state(), before)
    offsets = [p for n, p in model.named_parameters() if n.endswith("softmax_offset")]
    assert offsets and all(torch.count_nonzero(p) == 0 for p in offsets)


def test_flag_reaches_the_model_config(capsys):
    from megatron.training.arguments import build_configs

    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
             "--no-initialization"]
    args = validate_args(parse_args(argv=flags))
    assert "--no-initialization without --load" in capsys.readouterr().out
    args.padded_vocab_size = 128
    assert build_configs(args).model.perform_initialization is False
    args = validate_args(parse_args(argv=flags + ["--load", "somewhere"]))
    assert "--no-initialization" not in capsys.readouterr().out
