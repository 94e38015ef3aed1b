"""pretrain_gpt.py end to end on CPU: learning, layouts agreeing, exact resume, checkpoint files."""

import os
import subprocess
import sys

import pytest
import torch

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _losses(result):
    return [loss for _, loss in result["losses"]]


def test_single_rank_loss_decreases(corpus, tmp_path):
    out = run_on_ranks(run_pretrain, 1, gpt_flags(corpus, 60, dropout=0.0, lr=2e-2))[0]
    losses = _losses(out)
    assert len(losses) == 60 and out["iteration"] == 60
    # A fresh model starts near log(padded vocab) = log(256) = 5.55; counting is learnt quickly.
    assert losses[0] > 5.0
    assert sum(losses[-5:]) / 5 < 0.6 * losses[0], losses
    assert out["valid"] is not None and out["valid"]["lm loss"] < losses[0]


def test_layouts_and_accumulation_agree(corpus):
    """TP=2, DP=2 and 2 accumulated micro-batches all equal the single-rank run (dropout off).

    fp32 sums in a different order differ by ~1e-6 relative per step; after 6 steps of Adam the
    losses agree to well within 1e-4.
    """
    base = _losses(run_on_ranks(run_pretrain, 1, gpt_flags(corpus, 6, dropout=0.0,
                                                           micro_batch=4, global_batch=4))[0])
    accum = _losses(run_on_ranks(run_pretrain, 1, gpt_flags(corpus, 6, dropout=0.0,
                                                            micro_batch=2, global_batch=4))[0])
    tp2 = _losses(run_on_ranks(run_pretrain, 2, gpt_flags(corpus, 6, dropout=0.0, tp=2,
                                                          micro_batch=4, global_batch=4))[-1])
    dp2 = _losses(run_on_ranks(run_pretrain, 2, gpt_flags(corpus, 6, dropout=0.0,
                                                          micro_batch=2, global_batch=4))[-1])
    for name, other in (("accumulation", accum), ("tp=2", tp2), ("dp=2", dp2)):
        assert len(other) == len(base)
        for a, b in zip(base, other):
            assert abs(a - b) < 1e-4 * abs(a), (name, base, other)


def test_auto_attention_backend_at_long_sequences_keeps_the_losses(corpus):
    """From AUTO_FLASH_MIN_SEQ tokens in float32 on CPU ``--attention-backend auto`` (the
    default) runs the explicit body in blocks of query rows (megatron/model/block_causal.py)
    instead of over the whole score matrix; its losses agree with scaled_dot_product_attention's
    (``--attention-backend flash``) within float32 rounding (1e-5 relative), as README
    states."""
    from megatron.model.attention_backend import AUTO_FLASH_MIN_SEQ
    from megatron.training.arguments import parse_args, validate_args

    seq = [f"--seq-length={AUTO_FLASH_MIN_SEQ}", f"--max-position-embeddings={AUTO_FLASH_MIN_SEQ}",
           "--device", "cpu"]
    auto = gpt_flags(corpus, 3, dropout=0.0, micro_batch=1, global_batch=1, extra=seq)
    assert not validate_args(parse_args(argv=auto)).use_flash_attn
    flash = auto + ["--attention-backend", "flash"]
    assert validate_args(parse_args(argv=flash)).use_flash_attn
    by_blocks = _losses(run_on_ranks(run_pretrain, 1, auto)[0])
    by_flash = _losses(run_on_ranks(run_pretrain, 1, flash)[0])
    assert len(by_flash) == len(by_blocks) == 3
    for a, b in zip(by_blocks, by_flash):
        assert abs(a - b) < 1e-5 * abs(b), (by_blocks, by_flash)


@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_resume_is_bit_exact(corpus, tmp_path, tp):
    """2N iterations straight == N, save, new processes load and run N more (dropout on)."""
    n = 4
    straight = run_on_ranks(run_pretrain, tp, gpt_flags(corpus, 2 * n, tp=tp))[-1]
    save = str(tmp_path / "ckpt")
    first = run_on_ranks(run_pretrain, tp, gpt_flags(
        corpus, 2 * n, tp=tp, extra=["--save", save, "--exit-interval", str(n)]))[-1]
    assert first["iteration"] == n
    second = run_on_ranks(run_pretrain, tp, gpt_flags(
        corpus, 2 * n, tp=tp, extra=["--save", save, "--load", save]))[-1]
    assert [i for i, _ in second["losses"]] == list(range(n + 1, 2 * n + 1))
    assert _losses(first) == _losses(straight)[:n]
    assert _losses(second) == _losses(straight)[n:], (straight, second)


EXPECTED_MODEL_KEYS = {
    "language_model.embedding.word_embeddings.weight",
    "language_model.embedding.position_embeddings.weight",
    "language_model.encoder.final_layernorm.weight",
    "language_model.encoder.final_layernorm.bias",
} | {f"language_model.encoder.layers.{i}.{name}"
     for i in range(2)
     for name in ("input_layernorm.weight", "input_layernorm.bias",
                  "self_attention.query_key_value.weight", "self_attention.query_key_value.bias",
                  "self_attention.dense.weight", "self_attention.dense.bias",
                  "post_attention_layernorm.weight", "post_attention_layernorm.bias",
                  "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias",
                  "mlp.dense_4h_to_h.weight", "mlp.dense_4h_to_h.bias")}


def _flatten(tree, prefix=""):
    out = set()
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out.add(prefix + key)
    return out


def test_checkpoint_layout_and_safe_load(corpus, tmp_path):
    save = str(tmp_path / "ckpt")
    run_on_ranks(run_pretrain, 2, gpt_flags(corpus, 3, tp=2, extra=[
        "--save", save, "--save-interval", "2", "--ckpt-format", "torch"]))
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000003",
                                        "latest_checkpointed_iteration.txt"]
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "3"
    assert sorted(os.listdir(os.path.join(save, "iter_0000003"))) == ["mp_rank_00", "mp_rank_01"]
    path = os.path.join(save, "iter_0000003", "mp_rank_01", "model_optim_rng.pt")
    # A separate, fresh process loads it with weights_only=True and only the allow-list.
    code = ("import sys, torch\nfrom megatron.training.checkpointing import load_state_file\n"
            "s = load_state_file(sys.argv[1])\n"
            "print(sorted(s))\nprint(s['checkpoint_version'], s['iteration'])\n")
    proc = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        str(sorted(["args", "checkpoint_version", "iteration", "model", "optimizer",
                    "opt_param_scheduler", "rng_state"])), "3.0 3"]
    state = torch.load(path, weights_only=False)
    assert _flatten(state["model"]) == EXPECTED_MODEL_KEYS
    # TP rank 1 holds half of the column-parallel QKV rows (3 * hidden / 2) and all columns.
    encoder = state["model"]["language_model"]["encoder"]
    assert tuple(encoder["layers.0.self_attention.query_key_value.weight"].shape) == (48, 32)
    assert tuple(encoder["layers.0.self_attention.dense.weight"].shape) == (32, 16)
    assert state["args"].tensor_model_parallel_size == 2
    assert len(state["rng_state"]) == 1


def _train_fp16_and_read_scales(flags):
    """Run pretrain and return (losses, loss scale before each step)."""
    from megatron.optimizer.optimizer import Float16OptimizerWithFloat16Params

    scales = []
    real_step = Float16OptimizerWithFloat16Params.step

    def recording_step(self):
        scales.append(float(self.get_loss_scale()))
        return real_step(self)

    Float16OptimizerWithFloat16Params.step = recording_step
    try:
        out = run_pretrain(flags)
    finally:
        Float16OptimizerWithFloat16Params.step = real_step
    return out, scales


def test_fp16_dynamic_scaler_skips_overflow_then_trains(corpus):
    """From the default 2^32 scale the first steps overflow in fp16, are skipped, and back off."""
    out, scales = run_on_ranks(_train_fp16_and_read_scales, 1, gpt_flags(
        corpus, 30, dropout=0.0, lr=2e-2, extra=["--fp16"]))[0]
    assert scales[0] == 2.0 ** 32
    # hysteresis 2: the first overflow only uses up hysteresis, later ones halve the scale
    assert scales[1] == 2.0 ** 32 and scales[2] == 2.0 ** 31
    assert min(scales) < 2.0 ** 20 and scales[-1] == scales[-2]  # settled: steps now succeed
    losses = [loss for _, loss in out["losses"]]
    assert losses[-1] < losses[0] - 1.0


def test_bf16_trains(corpus):
    out = run_on_ranks(run_pretrain, 1, gpt_flags(corpus, 30, dropout=0.0, lr=2e-2,
                                                  extra=["--bf16"]))[0]
    losses = [loss for _, loss in out["losses"]]
    assert losses[-1] < losses[0] - 1.0


def _run_recording_masks(argv, explicit_causal_mask):
    """run_pretrain, recording the attention mask get_batch hands the model; optionally put
    the explicit causal mask back where get_batch now passes None (the reference)."""
    import pretrain_gpt

    original = pretrain_gpt.get_batch
    masks = []

    def get_batch(data_iterator, *args, **kwargs):
        tokens, labels, loss_mask, attention_mask, position_ids = original(data_iterator, *args,
                                                                           **kwargs)
        masks.append(None if attention_mask is None else tuple(attention_mask.shape))
        if explicit_causal_mask and attention_mask is None:
            s = tokens.size(1)
            attention_mask = torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s)
        return tokens, labels, loss_mask, attention_mask, position_ids

    pretrain_gpt.get_batch = get_batch
    try:
        out = run_pretrain(argv)
    finally:
        pretrain_gpt.get_batch = original
    return {"losses": _losses(out), "masks": masks}


@pytest.mark.parametrize("flash", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_causal_batches_pass_no_mask_and_train_as_with_it(corpus, flash):
    """Without --reset-attention-mask the mask is exactly causal, so get_batch passes None
    (attention then runs its causal kernels); the losses equal those of the explicit mask."""
    flags = gpt_flags(corpus, 3, dropout=0.0, extra=["--use-flash-attn"] if flash else [])
    none = run_on_ranks(_run_recording_masks, 1, flags, False)[0]
    explicit = run_on_ranks(_run_recording_masks, 1, flags, True)[0]
    assert set(none["masks"]) == {None}
    torch.testing.assert_close(torch.tensor(none["losses"]), torch.tensor(explicit["losses"]),
                               rtol=1e-5, atol=0)
    reset = run_on_ranks(_run_recording_masks, 1, flags + ["--reset-attention-mask"], False)[0]
    assert set(reset["masks"]) == {(2, 1, 16, 16)}
