"""Multi-token prediction's options, against references written here:

* ``--mtp-use-repeated-layer``: K applications of the one layer (``mtp.layers.0``) equal a
  plain loop over it, the loss and gradients equal that loop's, and the model holds one MTP
  layer's parameters under Megatron-Core's keys.
* ``--mtp-detach-heads`` (fp64): the main model's gradients are those of the main loss alone,
  the MTP layers' gradients those of a model without the option; the MTP layers' parameters
  are clipped by their own norm, which the logged norm leaves out.
* ``--mtp-hsm`` needs two depths; ``--mtp-standalone`` without a layout that gives the MTP
  layers a stage of their own is refused in one line.
"""

import types

import pytest
import torch

from megatron.core.config import TransformerConfig
from megatron.model import GPTModel
from megatron.model.module import flatten_state_dict
from megatron.model.multi_token_prediction import roll_left
from megatron.optimizer.config import OptimizerConfig
from megatron.optimizer.optimizer import FP32Optimizer
from megatron.training.arguments import ArgumentsError, parse_args, validate_args

SEQ, BATCH, VOCAB = 8, 2, 64


def _model(depths, untie=True, repeated=False, detach=False, dtype=torch.float32):
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2,
                               padded_vocab_size=VOCAB, max_position_embeddings=SEQ,
                               seq_length=SEQ, ffn_hidden_size=32, hidden_dropout=0.0,
                               attention_dropout=0.0,
                               normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                               position_embedding_type="rope",
                               untie_embeddings_and_output_weights=untie)
    pstate = types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0,
                                   virtual_pp_size=None, virtual_pp_rank=None)
    model = GPTModel(config, pstate, mtp_num_layers=depths, mtp_loss_scaling_factor=0.1,
                     mtp_use_repeated_layer=repeated, mtp_detach_heads=detach)
    return model.to(dtype).train()


def _batch():
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    mask = (torch.rand(BATCH, SEQ, generator=gen) > 0.2).double()
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    return tokens, labels, mask, positions


def _masked_ce(model, hidden, labels, mask):
    logits = model._head(hidden)                                            # [s, b, V]
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), labels.t().reshape(-1), reduction="none")
    ce = ce.view(hidden.size(0), BATCH).t()                                 # [b, s]
    return (ce * mask).sum() / mask.sum()


def _loop_reference(model, depths, tokens, labels, mask, positions):
    """Main masked mean + 0.1 x the mean over depths, the one MTP layer applied ``depths``
    times by hand (ids, labels and mask shifted one place per depth, vacated places masked)."""
    lm = model.language_model
    hidden = lm(tokens, positions, None)                                    # [s, b, h]
    total = _masked_ce(model, hidden, labels, mask)
    layer, rotary = model.mtp.layers[0], lm.rotary_pos_emb(SEQ)
    mtp_losses = []
    for _ in range(depths):
        tokens, labels, mask = roll_left(tokens), roll_left(labels), roll_left(mask)
        hidden = layer(hidden, lm.embedding(tokens, positions), None, rotary)
        mtp_losses.append(_masked_ce(model, hidden, labels, mask))
    return total + 0.1 * sum(mtp_losses) / depths, mtp_losses


def _train_loss(model, tokens, labels, mask, positions):
    loss = model(tokens, positions, None, labels=labels, loss_mask=mask)    # [b, s]
    return (loss * mask).sum() / mask.sum()


def _grads(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def test_repeated_layer_is_one_layer_applied_k_times():
    torch.manual_seed(0)
    model = _model(3, repeated=True, dtype=torch.float64)
    tokens, labels, mask, positions = _batch()
    _train_loss(model, tokens, labels, mask, positions).backward()
    logged = model.mtp_tracker.report()
    got = _grads(model)
    reference, mtp_losses = _loop_reference(model, 3, tokens, labels, mask, positions)
    reference.backward()
    want = _grads(model)
    # Tolerances: the model takes each depth's loss in fp32 (as for fp16/bf16 training).
    assert logged == {f"mtp_{k + 1} loss": pytest.approx(float(v.detach()), rel=1e-6)
                      for k, v in enumerate(mtp_losses)}
    # three different depths
    assert len(set(round(float(v.detach()), 6) for v in mtp_losses)) == 3
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-9, msg=name)


def test_repeated_layer_keys_and_parameter_count_are_one_depths():
    repeated, single, plain = _model(3, repeated=True), _model(1), _model(None)
    assert len(repeated.mtp.layers) == 1
    keys = set(flatten_state_dict(repeated.state_dict_for_save_checkpoint()))
    assert keys == set(flatten_state_dict(single.state_dict_for_save_checkpoint()))
    assert {k.split(".")[2] for k in keys if k.startswith("mtp.")} == {"0"}

    def count(m):
        return sum(p.numel() for p in m.parameters())
    one_layer = sum(p.numel() for p in single.mtp.parameters())
    assert count(repeated) == count(single) == count(plain) + one_layer


@pytest.mark.parametrize("untie", [True, False])
def test_detached_heads_leave_the_main_model_to_the_main_loss(untie):
    torch.manual_seed(0)
    detached = _model(2, untie=untie, detach=True, dtype=torch.float64)
    attached = _model(2, untie=untie, dtype=torch.float64)
    attached.load_state_dict(detached.state_dict())
    tokens, labels, mask, positions = _batch()
    _train_loss(detached, tokens, labels, mask, positions).backward()
    got = _grads(detached)
    _train_loss(attached, tokens, labels, mask, positions).backward()
    with_mtp = _grads(attached)
    # Main loss alone: no MTP loss attached (the MTP heads take no part).
    attached.eval()
    _train_loss(attached, tokens, labels, mask, positions).backward()
    main_only = _grads(attached)
    for name, grad in got.items():
        if name.startswith("mtp."):
            torch.testing.assert_close(grad, with_mtp[name], rtol=1e-10, atol=1e-13, msg=name)
        else:
            torch.testing.assert_close(grad, main_only[name], rtol=1e-10, atol=1e-13, msg=name)
            assert not torch.allclose(grad, with_mtp[name]), name   # the option matters
    assert {n for n in got if n.startswith("mtp.")} == {
        n for n, _ in detached.named_parameters() if n.startswith("mtp.")}


def test_detached_heads_are_tagged_for_their_own_norm():
    model = _model(2, detach=True)
    tagged = {n for n, p in model.named_parameters() if getattr(p, "grad_norm_group", None)}
    assert tagged == {n for n, _ in model.named_parameters() if n.startswith("mtp.")}
    assert all(getattr(p, "grad_norm_group", None) is None for p in _model(2).parameters())


def test_tagged_parameters_are_clipped_by_their_own_norm():
    """fp64 reference: untagged grads scaled by clip / norm(untagged), tagged ones by
    clip / norm(tagged); the returned norm is the untagged one."""
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=gen)) for _ in range(4)]
    for p in params[2:]:
        p.grad_norm_group = "mtp"
    for p, scale in zip(params, (1.0, 2.0, 3.0, 0.1)):
        p.grad = torch.randn(p.shape, generator=gen) * scale
    before = [p.grad.double().clone() for p in params]
    optimizer = FP32Optimizer(torch.optim.SGD(params, lr=0.0),
                              OptimizerConfig(lr=0.0, clip_grad=1.0))
    norm = optimizer.clip_grad_norm(1.0)
    main = torch.cat([g.flatten() for g in before[:2]]).norm()
    mtp = torch.cat([g.flatten() for g in before[2:]]).norm()
    assert norm == pytest.approx(float(main), rel=1e-6)
    for p, g in zip(params, before):
        group_norm = mtp if getattr(p, "grad_norm_group", None) else main
        torch.testing.assert_close(p.grad.double(), g * min(1.0, 1.0 / (float(group_norm) + 1e-6)),
                                   rtol=1e-6, atol=1e-7)
    assert float(mtp) > 1.0 and float(main) > 1.0      # both groups were clipped


MINIMAL = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
           "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1",
           "--position-embedding-type", "rope", "--lr", "1e-3", "--train-iters", "1"]


def _validate(extra):
    args = parse_args(argv=MINIMAL + extra)
    args.world_size = 1
    return validate_args(args)


@pytest.mark.parametrize("flag", ["--mtp-use-repeated-layer", "--mtp-detach-heads"])
def test_options_need_mtp_layers(flag):
    with pytest.raises(ArgumentsError, match=f"{flag} needs --mtp-num-layers"):
        _validate([flag])
    args = _validate([flag, "--mtp-num-layers", "2"])
    assert getattr(args, flag[2:].replace("-", "_")) is True


def test_detached_heads_are_refused_with_fsdp():
    with pytest.raises(ArgumentsError, match="--mtp-detach-heads with fully sharded"):
        _validate(["--mtp-detach-heads", "--mtp-num-layers", "1", "--use-torch-fsdp2"])


@pytest.mark.parametrize("fsdp", [
    ["--use-torch-fsdp2"],
    ["--use-megatron-fsdp", "--use-distributed-optimizer"],
    ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"]],
    ids=["torch-fsdp2", "megatron-fsdp", "optim_grads"])
def test_mtp_layers_are_accepted_under_fsdp(fsdp):
    """Multi-token prediction trains under both FSDP flags (tests/functional/test_mtp_fsdp.py);
    only --mtp-detach-heads stays refused there, as Megatron-LM refuses it."""
    args = _validate(["--mtp-num-layers", "2", "--mtp-use-repeated-layer", *fsdp])
    assert args.mtp_num_layers == 2 and args.use_torch_fsdp2


def test_hidden_state_mixing_is_accepted_with_two_depths():
    """--mtp-hsm is built (tests/unit/test_mtp_hsm.py); it needs a depth to mix into."""
    assert _validate(["--mtp-hsm", "--mtp-num-layers", "2"]).mtp_hsm is True
    with pytest.raises(ArgumentsError, match="--mtp-hsm needs --mtp-num-layers >= 2, got 1"):
        _validate(["--mtp-hsm", "--mtp-num-layers", "1"])


def test_mtp_standalone_without_its_layout_is_refused():
    """Megatron sets --mtp-standalone from a layout whose MTP layers have a stage of their own
    (tests/functional/test_mtp_standalone_stage.py); without one the flag contradicts the run."""
    with pytest.raises(ArgumentsError, match=r"--mtp-standalone needs "
                       r"--pipeline-model-parallel-layout .*'Ettmm\|L'"):
        _validate(["--mtp-standalone", "--mtp-num-layers", "2"])
