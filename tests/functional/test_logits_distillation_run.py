"""Offline distillation end to end: a GPT run with --logits-save-dir writes each train sample's
top-K teacher log-probabilities, a run with --logits-load-dir trains on them.

References: a naive log_softmax + torch.topk over the logits the model computes for the same
batch (a second, dropout-free forward of the same weights), an fp64 loop over the formula,
the plain run (alpha 0), the one-process run (DP 2), the run that never stopped (resume)."""

import math
import os

import pytest
import torch

from megatron.training.distillation import logits_files
from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.slow  # spawned training runs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, iters, extra=(), lr=5e-3):
    return gpt_flags(corpus, iters, dropout=0.0, lr=lr, extra=list(extra))


def run_recording(argv):
    """pretrain_gpt's run, recording each training micro-batch's sample indices, loss mask,
    logits (a no-grad forward of the same weights before the step) and logged values."""
    import pretrain_gpt
    from megatron.training import global_vars

    records, plain = [], pretrain_gpt.forward_step

    def forward_step(data_iterator, model):
        output, loss_func = plain(data_iterator, model)
        if not model.training:
            return output, loss_func
        index = loss_func.args[2] if len(loss_func.args) == 3 else None
        mask = loss_func.args[1] if len(loss_func.args) == 3 else loss_func.args[0]
        record = {"index": None if index is None else index.tolist(), "mask": mask.clone()}
        batch = records_batch[-1]
        with torch.no_grad():
            record["logits"] = model(*batch).float().clone()                  # [b, s, V]

        def recorded(output_tensor):
            result = loss_func(output_tensor)
            record["logged"] = {k: float(v) for k, v in result[-1].items()}
            record["loss"] = float(result[0])
            records.append(record)
            return result
        return output, recorded

    records_batch, get_batch = [], pretrain_gpt.get_batch

    def keep_batch(*args, **kwargs):
        out = get_batch(*args, **kwargs)
        records_batch.append((out[0], out[4], out[3]))
        return out

    pretrain_gpt.forward_step, pretrain_gpt.get_batch = forward_step, keep_batch
    try:
        result = run_pretrain(argv)
    finally:
        pretrain_gpt.forward_step, pretrain_gpt.get_batch = plain, get_batch
        global_vars.unset_global_variables()
    result["records"] = records
    return result


def _teacher(corpus, folder, extra=(), ranks=1):
    flags = _flags(corpus, 4, ["--logits-save-dir", folder, "--logits-save-top-k", "5",
                               "--freeze-all-layers"] + list(extra))
    if ranks == 1:
        return run_on_ranks(run_recording, 1, flags)[0]
    return run_on_ranks(run_pretrain, ranks, flags)


def _saved(folder):
    out = {}
    for sub in sorted(os.listdir(folder)):
        if sub.isdigit():
            for name in sorted(os.listdir(os.path.join(folder, sub))):
                out[int(name[:-3])] = torch.load(os.path.join(folder, sub, name),
                                                 weights_only=True)
    return out


def test_saved_top_k_is_the_naive_top_k_of_the_models_logits(corpus, tmp_path):
    folder = str(tmp_path / "teacher")
    got = _teacher(corpus, folder)
    saved = _saved(folder)
    assert len(saved) == 4 * 4  # 4 iterations of global batch 4, one file per sample
    for record in got["records"]:
        for row, index in enumerate(record["index"]):
            ref = torch.log_softmax(record["logits"][row].double(), dim=-1)     # [s, V]
            values, ids = torch.topk(ref, 5, dim=-1)
            assert torch.equal(saved[index]["token_ids"].long(), ids)
            assert saved[index]["logprobs"].dtype == torch.float16           # the default
            torch.testing.assert_close(saved[index]["logprobs"].double(), values,
                                       rtol=1e-3, atol=1e-3)  # fp16 rounding


def test_top_p_and_dtype_are_honoured(corpus, tmp_path):
    folder = str(tmp_path / "teacher")
    got = _teacher(corpus, folder, ["--logits-save-top-p", "0.3", "--logits-save-top-p-min-k",
                                    "2", "--logits-save-dtype", "bf16"])
    saved = _saved(folder)
    for record in got["records"]:
        for row, index in enumerate(record["index"]):
            probs = torch.softmax(record["logits"][row].double(), dim=-1)
            order = torch.argsort(probs, dim=-1, descending=True)[:, :5]
            file = saved[index]
            assert file["logprobs"].dtype == torch.bfloat16
            for pos in range(probs.shape[0]):
                kept, mass = [], 0.0
                for j, tok in enumerate(order[pos].tolist()):
                    if mass < 0.3 or j < 2:
                        kept.append(tok)
                    mass += probs[pos, tok].item()
                ids = file["token_ids"][pos].tolist()
                assert ids[:len(kept)] == kept
                assert all(i == -1 for i in ids[len(kept):])


def _kd_reference(logits, mask, teacher, ids):
    """Masked mean over tokens of the forward KL with the rest-mass token, in fp64 loops."""
    total, count = 0.0, 0.0
    for b in range(logits.shape[0]):
        for s in range(logits.shape[1]):
            if mask[b, s] == 0:
                continue
            logp = torch.log_softmax(logits[b, s].double(), dim=-1)
            kl, pt, ps = 0.0, 0.0, 0.0
            for t, v in zip(teacher[b][s].tolist(), ids[b][s].tolist()):
                if v < 0:
                    continue
                kl += math.exp(t) * (t - logp[v].item())
                pt += math.exp(t)
                ps += math.exp(logp[v].item())
            rt, rs = math.log(max(1 - pt, 1e-8)), math.log(max(1 - ps, 1e-8))
            total += kl + math.exp(rt) * (rt - rs)
            count += 1
    return total / count


def test_kd_loss_is_the_fp64_formula_and_alpha_zero_is_plain_training(corpus, tmp_path):
    folder = str(tmp_path / "teacher")
    _teacher(corpus, folder, ["--init-method-std", "0.1"])  # a teacher unlike the student
    saved = _saved(folder)
    student = run_on_ranks(run_recording, 1, _flags(corpus, 2, [
        "--logits-load-dir", folder, "--logits-load-kd-loss-alpha", "0.7"]))[0]
    for record in student["records"]:
        teacher = [saved[i]["logprobs"].double() for i in record["index"]]
        ids = [saved[i]["token_ids"].long() for i in record["index"]]
        ref = _kd_reference(record["logits"], record["mask"], teacher, ids)
        assert record["logged"]["logits distillation loss"] == pytest.approx(ref, rel=1e-5)
        lm = record["logged"]["lm loss"]
        assert record["loss"] == pytest.approx(0.3 * lm + 0.7 * ref, rel=1e-5)
        assert ref > 0.01  # the teacher differs: the test can fail
    plain = run_on_ranks(run_pretrain, 1, _flags(corpus, 3))[0]["losses"]
    zero = run_on_ranks(run_pretrain, 1, _flags(corpus, 3, [
        "--logits-load-dir", folder, "--logits-load-kd-loss-alpha", "0"]))
    # alpha 1 trains on the teacher alone: its losses leave the plain run's.
    one = run_on_ranks(run_pretrain, 1, _flags(corpus, 3, ["--logits-load-dir", folder]))
    assert zero[0]["losses"] == plain
    assert one[0]["losses"][1:] != plain[1:]


@pytest.fixture(scope="module")
def teacher_dir(corpus, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("teacher") / "logits")
    _teacher(corpus, folder, ["--init-method-std", "0.1"])
    return folder


def test_two_data_parallel_ranks_match_one_process(corpus, teacher_dir, tmp_path):
    """The teacher files two DP ranks write equal the one-process files bit for bit (same
    micro-batches, same sample keys), and a DP 2 student follows the one-process losses."""
    folder = str(tmp_path / "teacher_dp2")
    _teacher(corpus, folder, ["--init-method-std", "0.1"], ranks=2)
    one, two = _saved(teacher_dir), _saved(folder)
    assert one.keys() == two.keys() and len(one) == 16
    for index in one:
        assert torch.equal(one[index]["logprobs"], two[index]["logprobs"])
        assert torch.equal(one[index]["token_ids"], two[index]["token_ids"])
    flags = _flags(corpus, 4, ["--logits-load-dir", teacher_dir, "--logits-load-kd-loss-alpha",
                               "0.5"])
    single = run_on_ranks(run_pretrain, 1, flags)[0]["losses"]
    double = run_on_ranks(run_pretrain, 2, flags)[0]["losses"]
    assert [i for i, _ in double] == [1, 2, 3, 4]
    for (_, a), (_, b) in zip(single, double):
        assert a == pytest.approx(b, rel=1e-5)  # DP reduces gradients in another order


def test_resume_is_bit_for_bit(corpus, teacher_dir, tmp_path):
    save = str(tmp_path / "ckpt")
    extra = ["--logits-load-dir", teacher_dir, "--logits-load-kd-loss-alpha", "0.5"]
    full = run_on_ranks(run_pretrain, 1, _flags(corpus, 4, extra))[0]["losses"]
    run_on_ranks(run_pretrain, 1, _flags(corpus, 4, extra + ["--save", save,
                                                             "--exit-interval", "2"]))
    resumed = run_on_ranks(run_pretrain, 1, _flags(corpus, 4, extra + ["--load", save]))
    assert resumed[0]["losses"] == full[2:]


def _remove_one_sample(teacher_dir, tmp_path):
    """A copy of the teacher folder without sample 5's file; (folder, that file's path)."""
    import shutil
    folder = str(tmp_path / "holes")
    shutil.copytree(teacher_dir, folder)
    path = logits_files.sample_path(folder, 5)
    os.remove(path)
    return folder, path


def test_missing_or_corrupt_file_is_refused_with_its_name(corpus, teacher_dir, tmp_path):
    folder, path = _remove_one_sample(teacher_dir, tmp_path)
    flags = _flags(corpus, 2, ["--logits-load-dir", folder])
    with pytest.raises(AssertionError, match=r"LogitsFileError.*" + path):
        run_on_ranks(run_pretrain, 1, flags)
    with open(path, "wb") as f:
        f.write(b"not a torch file")
    with pytest.raises(AssertionError, match=path + " is corrupt"):
        run_on_ranks(run_pretrain, 1, flags)


def test_ignore_errors_trains_that_micro_batch_on_the_lm_loss(corpus, teacher_dir, tmp_path):
    folder, _ = _remove_one_sample(teacher_dir, tmp_path)
    got = run_on_ranks(run_recording, 1, _flags(corpus, 2, [
        "--logits-load-dir", folder, "--logits-load-ignore-errors"]))[0]["records"]
    hit = [r for r in got if 5 in r["index"]]
    rest = [r for r in got if 5 not in r["index"]]
    assert len(hit) == 1 and len(rest) == 3
    assert hit[0]["loss"] == pytest.approx(hit[0]["logged"]["lm loss"], rel=1e-6)
    assert all(abs(r["loss"] - r["logged"]["lm loss"]) > 1e-3 for r in rest)


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2"],
                                    ["--pipeline-model-parallel-size", "2"]])
def test_model_parallel_layouts_match_one_process(corpus, teacher_dir, tmp_path, layout):
    """A teacher split over two ranks saves the one-process top-K (the vocabulary gathered
    from the tensor-parallel halves), and a student split the same way follows the one-process
    losses (float tolerance: the split sums in another order)."""
    folder = str(tmp_path / "teacher_split")
    _teacher(corpus, folder, ["--init-method-std", "0.1"] + layout, ranks=2)
    one, two = _saved(teacher_dir), _saved(folder)
    assert one.keys() == two.keys()
    for index in one:
        torch.testing.assert_close(one[index]["logprobs"].float(),
                                   two[index]["logprobs"].float(), rtol=0, atol=2e-3)
        same = (one[index]["token_ids"] == two[index]["token_ids"]).float().mean()
        assert same > 0.95  # near-ties may swap places
    flags = _flags(corpus, 3, ["--logits-load-dir", teacher_dir, "--logits-load-kd-loss-alpha",
                               "0.5"])
    single = run_on_ranks(run_pretrain, 1, flags)[0]["losses"]
    split = run_on_ranks(run_pretrain, 2, flags + layout)[-1]["losses"]
    assert len(split) == 3
    for (_, a), (_, b) in zip(single, split):
        assert a == pytest.approx(b, rel=1e-5)
