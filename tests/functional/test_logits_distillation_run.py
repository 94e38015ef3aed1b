"""Offline distillation end to end: a GPT run with --logits-save-dir writes each train sample's
top-K teacher log-probabilities (Megatron-LM's tars), a run with --logits-load-dir trains on them.

References: a naive log_softmax + torch.topk over the logits the model computes for the same
batch (a second, dropout-free forward of the same weights), read back from the tars by an
independent reader (tarfile, zstandard, numpy.unpackbits and Megatron-LM's row order), an fp64
loop over the formula, the plain run (alpha 0), the one-process run (DP 2), the run that never
stopped (resume, of the student and of the teacher)."""

import io
import json
import math
import os
import tarfile

import numpy as np

import pytest
import torch

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.slow  # spawned training runs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, iters, extra=(), lr=5e-3):
    return gpt_flags(corpus, iters, dropout=0.0, lr=lr, extra=list(extra))


def _student(corpus, stop, extra=(), **kwargs):
    """A run of the teacher's --train-iters 4 (the dataset hash counts the train samples)
    that stops after ``stop`` iterations."""
    stop_flags = ["--exit-interval", str(stop)] if stop < 4 else []
    return _flags(corpus, 4, list(extra) + stop_flags, **kwargs)


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
    """{train stream position: {"logprobs", "token_ids"}} of every tar in ``folder``, read with
    Megatron-LM's layout: member ``{s}-{e}.pt.zst`` of ``dp{D}__*.tar``, row ``r`` is position
    ``s + ((r // M) * dp + D) * M + r % M``; dropped entries (-1e3) get id -1."""
    import zstandard

    out = {}
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".tar"):
            continue
        rank = int(name[2:name.index("__")])
        with tarfile.open(os.path.join(folder, name)) as tar:
            names = tar.getnames()
            saver = json.loads(tar.extractfile(names[0]).read())["saver"]
            assert names[0] == "_meta.json"
            mbs, dp = saver["mbs_save"], saver["dp_size_save"]
            for member in names[1:]:
                start = int(member.split("-")[0])
                raw = zstandard.ZstdDecompressor().decompress(tar.extractfile(member).read())
                payload = torch.load(io.BytesIO(raw), weights_only=True)
                low = payload["indices_low"].long()
                high = np.unpackbits(payload["bit_17"].numpy(), count=low.numel())
                ids = (torch.from_numpy(high.astype(np.int64)).view(low.shape) << 16) | low
                values = payload["values"]
                ids[values.float() <= -1e3] = -1
                for r in range(values.shape[1]):
                    pos = start + ((r // mbs) * dp + rank) * mbs + r % mbs
                    out[pos] = {"logprobs": values[:, r], "token_ids": ids[:, r]}
    return out


def test_saved_top_k_is_the_naive_top_k_of_the_models_logits(corpus, tmp_path):
    folder = str(tmp_path / "teacher")
    got = _teacher(corpus, folder)
    saved = _saved(folder)
    assert len(saved) == 4 * 4  # 4 iterations of global batch 4
    assert sorted(os.listdir(folder)) == ["dp0__0-4.tar", "dp0__12-16.tar", "dp0__4-8.tar",
                                          "dp0__8-12.tar"]
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
    student = run_on_ranks(run_recording, 1, _student(corpus, 2, [
        "--logits-load-dir", folder, "--logits-load-kd-loss-alpha", "0.7"]))[0]
    for record in student["records"]:
        teacher = [saved[i]["logprobs"].double() for i in record["index"]]
        ids = [saved[i]["token_ids"].long() for i in record["index"]]
        ref = _kd_reference(record["logits"], record["mask"], teacher, ids)
        assert record["logged"]["logits distillation loss"] == pytest.approx(ref, rel=1e-5)
        lm = record["logged"]["lm loss"]
        assert record["loss"] == pytest.approx(0.3 * lm + 0.7 * ref, rel=1e-5)
        assert ref > 0.01  # the teacher differs: the test can fail
    plain = run_on_ranks(run_pretrain, 1, _student(corpus, 3))[0]["losses"]
    zero = run_on_ranks(run_pretrain, 1, _student(corpus, 3, [
        "--logits-load-dir", folder, "--logits-load-kd-loss-alpha", "0"]))
    # alpha 1 trains on the teacher alone: its losses leave the plain run's.
    one = run_on_ranks(run_pretrain, 1, _student(corpus, 3, ["--logits-load-dir", folder]))
    assert zero[0]["losses"] == plain
    assert one[0]["losses"][1:] != plain[1:]


@pytest.fixture(scope="module")
def teacher_dir(corpus, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("teacher") / "logits")
    _teacher(corpus, folder, ["--init-method-std", "0.1"])
    return folder


def test_two_data_parallel_ranks_match_one_process(corpus, teacher_dir, tmp_path):
    """The tars two DP ranks write (one per rank and iteration) hold the one-process rows bit
    for bit at the same stream positions, and a DP 2 student follows the one-process losses."""
    folder = str(tmp_path / "teacher_dp2")
    _teacher(corpus, folder, ["--init-method-std", "0.1"], ranks=2)
    assert sorted(os.listdir(folder)) == [f"dp{d}__{s}-{s + 4}.tar" for d in (0, 1)
                                          for s in (0, 12, 4, 8)]  # sorted as strings
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


def test_a_resumed_teacher_saves_what_an_unstopped_one_does(corpus, teacher_dir, tmp_path):
    folder, save = str(tmp_path / "teacher"), str(tmp_path / "ckpt")
    stop = ["--init-method-std", "0.1", "--save", save, "--save-interval", "2"]
    run_on_ranks(run_pretrain, 1, _flags(corpus, 4, [
        "--logits-save-dir", folder, "--logits-save-top-k", "5", "--freeze-all-layers",
        "--exit-interval", "3"] + stop))
    os.remove(os.path.join(folder, "dp0__8-12.tar"))    # as if iteration 3's never got out
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")   # resume from iteration 2: iteration 3 is written again
    kept = {n: os.stat(os.path.join(folder, n)).st_ino for n in ("dp0__0-4.tar", "dp0__4-8.tar")}
    run_on_ranks(run_pretrain, 1, _flags(corpus, 4, [
        "--logits-save-dir", folder, "--logits-save-top-k", "5", "--freeze-all-layers",
        "--load", save, "--init-method-std", "0.1"]))
    assert kept == {n: os.stat(os.path.join(folder, n)).st_ino for n in kept}  # not rewritten
    assert sorted(os.listdir(folder)) == sorted(os.listdir(teacher_dir))
    again, once = _saved(folder), _saved(teacher_dir)
    assert again.keys() == once.keys()
    for index in once:
        assert torch.equal(again[index]["logprobs"], once[index]["logprobs"])
        assert torch.equal(again[index]["token_ids"], once[index]["token_ids"])


def test_a_student_of_another_batch_layout_reads_its_own_samples(corpus, teacher_dir):
    """Micro-batch 1, global batch 2 (8 iterations: the teacher's 16 samples): each sample's
    KD term is the fp64 formula on that sample's teacher rows."""
    saved = _saved(teacher_dir)
    got = run_on_ranks(run_recording, 1, _flags(corpus, 8, [
        "--logits-load-dir", teacher_dir, "--micro-batch-size", "1", "--global-batch-size",
        "2", "--exit-interval", "3"]))[0]["records"]
    assert [r["index"] for r in got] == [[i] for i in range(6)]
    for record in got:
        i = record["index"][0]
        ref = _kd_reference(record["logits"], record["mask"], [saved[i]["logprobs"].double()],
                            [saved[i]["token_ids"].long()])
        assert record["logged"]["logits distillation loss"] == pytest.approx(ref, rel=1e-5)


def _remove_one_iteration(teacher_dir, tmp_path):
    """A copy of the teacher folder without iteration 2's tar (samples 4 to 7); (folder, its
    path)."""
    import shutil
    folder = str(tmp_path / "holes")
    shutil.copytree(teacher_dir, folder)
    path = os.path.join(folder, "dp0__4-8.tar")
    os.remove(path)
    return folder, path


def test_missing_or_corrupt_tar_is_refused_with_its_name(corpus, teacher_dir, tmp_path):
    folder, path = _remove_one_iteration(teacher_dir, tmp_path)
    flags = _student(corpus, 2, ["--logits-load-dir", folder])
    with pytest.raises(AssertionError, match=r"LogitsFileError: teacher logits of train samples "
                                             r"\[4, 8\) .* missing from --logits-load-dir "
                                             + folder):
        run_on_ranks(run_pretrain, 1, flags)
    with open(path, "wb") as f:
        f.write(b"not a tar")
    with pytest.raises(AssertionError, match=path + " is not a readable teacher-logits tar"):
        run_on_ranks(run_pretrain, 1, flags)


def test_another_data_stream_is_refused_by_its_hash(corpus, teacher_dir):
    flags = _flags(corpus, 4, ["--logits-load-dir", teacher_dir, "--seed", "99"])
    with pytest.raises(AssertionError, match=r"dp0__0-4\.tar was saved with dataset hash "
                                             r"\w+ \(\{'seed': 1234"):
        run_on_ranks(run_pretrain, 1, flags)


def test_ignore_errors_trains_that_micro_batch_on_the_lm_loss(corpus, teacher_dir, tmp_path):
    folder, _ = _remove_one_iteration(teacher_dir, tmp_path)
    got = run_on_ranks(run_recording, 1, _student(corpus, 2, [
        "--logits-load-dir", folder, "--logits-load-ignore-errors"]))[0]["records"]
    hit = [r for r in got if set(r["index"]) & {4, 5, 6, 7}]
    rest = [r for r in got if not set(r["index"]) & {4, 5, 6, 7}]
    assert len(hit) == 2 and len(rest) == 2
    assert all(r["loss"] == pytest.approx(r["logged"]["lm loss"], rel=1e-6) for r in hit)
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
    flags = _student(corpus, 3, ["--logits-load-dir", teacher_dir, "--logits-load-kd-loss-alpha",
                               "0.5"])
    single = run_on_ranks(run_pretrain, 1, flags)[0]["losses"]
    split = run_on_ranks(run_pretrain, 2, flags + layout)[-1]["losses"]
    assert len(split) == 3
    for (_, a), (_, b) in zip(single, split):
        assert a == pytest.approx(b, rel=1e-5)
