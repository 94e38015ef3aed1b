"""Offline distillation's pieces against naive references: the saved top-K / top-p selection
(torch.topk, a sort and running sum), the KD term (an fp64 loop over the formula) and the
flags' checks. The tars' layout: tests/unit/test_logits_shards.py."""

import math

import pytest
import torch

from megatron.training.arguments import (ArgumentsError, parse_args, validate_args,
                                         validate_bert_args)
from megatron.training.distillation import logits_files
from megatron.training.distillation.kd_loss import topk_forward_kl


def test_top_k_matches_a_naive_log_softmax_and_topk():
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(0)) * 3
    values, ids = logits_files.top_logprobs(logits, 6)
    ref_values, ref_ids = torch.topk(torch.log_softmax(logits.double(), -1), 6, dim=-1)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(values.double(), ref_values, rtol=0, atol=1e-5)


@pytest.mark.parametrize("top_p,min_k", [(0.5, 1), (0.9, 3), (1.0, 1), (0.01, 2)])
def test_top_p_with_min_k_matches_a_naive_sort_and_cumsum(top_p, min_k):
    logits = torch.randn(9, 40, generator=torch.Generator().manual_seed(1)) * 2
    values, ids = logits_files.top_logprobs(logits, 8, top_p, min_k)
    probs = torch.softmax(logits.double(), -1)
    widths = []
    for pos in range(logits.shape[0]):
        order = sorted(range(40), key=lambda v: -probs[pos, v].item())[:8]
        kept, mass = [], 0.0
        for j, tok in enumerate(order):
            if mass < top_p or j < min_k:
                kept.append(tok)
            mass += probs[pos, tok].item()
        widths.append(len(kept))
        row = ids[pos].tolist()
        assert row[:len(kept)] == kept
        assert all(v == logits_files.DROPPED_ID for v in row[len(kept):])
        assert all(v == logits_files.DROPPED_LOGPROB for v in values[pos, len(kept):].tolist())
        for j, tok in enumerate(kept):
            assert values[pos, j].item() == pytest.approx(math.log(probs[pos, tok].item()),
                                                          abs=1e-5)
    assert ids.shape[-1] == max(widths)


def _kl_reference(student, teacher, ids):
    out = torch.zeros(student.shape[:-1], dtype=torch.float64)
    for pos in range(student.shape[0]):
        logp = torch.log_softmax(student[pos].double(), -1)
        kl, pt, ps = 0.0, 0.0, 0.0
        for t, v in zip(teacher[pos].tolist(), ids[pos].tolist()):
            if v < 0:
                continue
            kl += math.exp(t) * (t - logp[v].item())
            pt, ps = pt + math.exp(t), ps + math.exp(logp[v].item())
        rt, rs = math.log(max(1 - pt, 1e-8)), math.log(max(1 - ps, 1e-8))
        out[pos] = kl + math.exp(rt) * (rt - rs)
    return out


def test_kd_term_matches_an_fp64_loop_with_dropped_entries():
    gen = torch.Generator().manual_seed(2)
    student = torch.randn(6, 30, generator=gen)
    teacher, ids = logits_files.top_logprobs(torch.randn(6, 30, generator=gen) * 2, 5, 0.6, 2)
    assert (ids == -1).any()  # some entries dropped: the mask is exercised
    got = topk_forward_kl(student, teacher, ids)
    torch.testing.assert_close(got.double(), _kl_reference(student, teacher, ids),
                               rtol=1e-5, atol=1e-6)
    # The teacher's own distribution on its full support: KL 0.
    full, full_ids = logits_files.top_logprobs(student, 30)
    assert topk_forward_kl(student, full, full_ids).abs().max() < 1e-5


def test_kd_gradient_matches_fp64_autograd():
    gen = torch.Generator().manual_seed(3)
    student = torch.randn(4, 20, generator=gen, requires_grad=True)
    teacher, ids = logits_files.top_logprobs(torch.randn(4, 20, generator=gen), 4)
    topk_forward_kl(student, teacher, ids).sum().backward()
    ref_in = student.detach().double().requires_grad_()
    logp = torch.log_softmax(ref_in, -1)
    picked = logp.gather(-1, ids)
    pt, t = teacher.double().exp(), teacher.double()
    rt = torch.log(1 - pt.sum(-1))
    rs = torch.log(1 - picked.exp().sum(-1))
    ((pt * (t - picked)).sum(-1) + rt.exp() * (rt - rs)).sum().backward()
    torch.testing.assert_close(student.grad.double(), ref_in.grad, rtol=1e-4, atol=1e-6)


BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 "
        "--train-iters 2 --lr 1e-3 --tokenizer-type NullTokenizer --vocab-size 129 "
        "--mock-data").split()


def _validated(extra):
    return validate_args(parse_args(argv=BASE + extra.split()))


@pytest.mark.parametrize("extra,message", [
    ("--logits-save-dir d --logits-save-top-p 1.5", r"--logits-save-top-p 1.5: must be in"),
    ("--logits-save-dir d --logits-save-top-k 0", r"--logits-save-top-k 0: must be at least 1"),
    ("--logits-save-dir d --logits-save-top-p-min-k 0", r"min-k 0: must be at least 1"),
    ("--logits-save-top-k 4", r"--logits-save-top-k 4 needs --logits-save-dir"),
    ("--logits-save-dir d --logits-load-dir e", r"cannot be used in one run"),
    ("--logits-load-dir msc://bucket/x", r"Multi-Storage Client"),
    ("--logits-load-dir e --logits-load-decode-threads 0", r"decode-threads 0"),
    ("--logits-load-dir e --mtp-num-layers 1", r"--logits-load-dir with --mtp-num-layers"),
    ("--logits-load-dir e --dataloader-type cyclic", r"--logits-load-dir with --dataloader-type "
                                                     r"cyclic"),
])
def test_bad_distillation_flags_are_refused(extra, message):
    with pytest.raises(ArgumentsError, match=message):
        _validated(extra)


def test_a_teacher_with_a_batch_size_ramp_up_is_refused():
    at = BASE.index("--train-iters")
    argv = BASE[:at] + BASE[at + 2:] + [
        "--train-samples", "64", "--logits-save-dir", "d", "--rampup-batch-size", "2", "2", "8"]
    with pytest.raises(ArgumentsError, match="--logits-save-dir with --rampup-batch-size"):
        validate_args(parse_args(argv=argv))


def test_save_top_k_defaults_to_megatrons_128_and_msc_depth_is_a_noted_no_op(capsys):
    assert _validated("--logits-save-dir d").logits_save_top_k == 128
    args = _validated("--logits-load-dir e --logits-load-msc-prefetch-depth 5")
    assert args.logits_load_msc_prefetch_depth == 5
    assert "--logits-load-msc-prefetch-depth has no effect here" in capsys.readouterr().out


def test_bert_refuses_the_distillation_flags(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]))
    args = parse_args(argv=[a for a in BASE if a != "--mock-data"] + [
        "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(vocab),
        "--data-path", "x", "--logits-load-dir", "e"])
    with pytest.raises(ArgumentsError, match="--logits-load-dir: offline distillation is "
                                             "built for GPT"):
        validate_bert_args(validate_args(args))


class Items(torch.utils.data.Dataset):
    name = "items"

    def __len__(self):
        return 3

    def __getitem__(self, idx):
        return {"text": torch.tensor([idx, idx + 1])}


def test_datasets_carry_their_sample_index_and_survive_pickling():
    import pickle

    from megatron.training.distillation import with_sample_index

    train, valid, test = with_sample_index((Items(), [Items(), Items()], None))
    assert len(train) == 3 and train.name == "items" and test is None
    assert int(train[2]["sample_index"]) == 2 and train[2]["text"].tolist() == [2, 3]
    assert len(valid) == 2 and int(valid[1][1]["sample_index"]) == 1
    assert int(pickle.loads(pickle.dumps(train))[1]["sample_index"]) == 1
