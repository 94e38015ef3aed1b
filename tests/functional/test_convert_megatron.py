"""Resharding real checkpoints of tiny trained GPTs (``tools/checkpoint/convert.py``).

References, each independent of the converter:

- the raw files, joined by a naive rule table written here (concatenate the TP shards; SwiGLU's
  ``dense_h_to_4h`` as ``[gate_0; gate_1; value_0; value_1]`` from ranks holding
  ``[gate_r; value_r]``);
- the model itself: each checkpoint is loaded by the inference start-up at its own layout
  (strict key and shape checks) and run on the same tokens. Tensor parallelism only changes the
  order of the sums inside ``dense`` / ``dense_4h_to_h`` (partial products all-reduced), so
  logits agree to a few fp32 ulps; 1e-6 absolute on logits of size ~1 leaves a ~10x margin and
  still catches any misplaced row, which moves logits by ~1e-2;
- a training run that never stopped (resume), within the parity suite's 1e-5 relative;
- for interleaved and uneven pipelines (slow): a TP=1 run of the same seed with ``--lr 0``,
  whose weights are the initial ones, which are the same under any split (bit-exact).
"""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from megatron.training import checkpointing
from megatron.convert.megatron_io import load_megatron, save_megatron
from megatron.convert.schema import ConversionError, Piece
from megatron.model.module import flatten_state_dict
from tests.functional.gpt_runs import VOCAB_SIZE, gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRUE_VOCAB = VOCAB_SIZE               # NullTokenizer: --vocab-size ids, eod the last
ATOL = 1e-6
RTOL_RESUME = 1e-5
MODERN = ["--swiglu", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
          "--group-query-attention", "--num-query-groups", "2",
          "--untie-embeddings-and-output-weights", "--disable-bias-linear"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _train_flags(corpus, save, tp, pp, iters=2, extra=()):
    """Training flags of a torch-format source checkpoint (what these conversions read)."""
    return gpt_flags(corpus, iters, tp=tp, dropout=0.0,
                     extra=["--pipeline-model-parallel-size", str(pp), "--save", save,
                            "--ckpt-format", "torch"] + list(extra))


def _train(corpus, save, tp, pp, iters=2, extra=()):
    return run_on_ranks(run_pretrain, tp * pp, _train_flags(corpus, save, tp, pp, iters,
                                                             extra))[-1]


@pytest.fixture(scope="module")
def tp2pp2_session(corpus, tmp_path_factory):
    """A TP=2 x PP=2 checkpoint (2 layers, 4 heads) after 2 iterations, converted to TP=1 and
    from there to TP=4; each of the three run at its own layout on the same tokens."""
    root = tmp_path_factory.mktemp("tp2pp2")
    src, tp1, tp4 = str(root / "ckpt"), str(root / "tp1"), str(root / "tp4")
    steps = [("train", _train_flags(corpus, src, 2, 2)),
             ("convert", src, tp1, 1, 1), ("convert", tp1, tp4, 4, 1),
             ("eval", [_eval_flags(corpus, src, 2, 2), _eval_flags(corpus, tp1, 1, 1),
                       _eval_flags(corpus, tp4, 4, 1)])]
    return (src, tp1, tp4), _session_results(4, steps)[-1]


@pytest.fixture(scope="module")
def tp2pp2(tp2pp2_session):
    return tp2pp2_session[0][0]


def _convert(src, dst, tp, pp, **kw):
    save_megatron(load_megatron(src, **kw.pop("load", {})), dst, tp, pp, **kw)
    return dst


def _states(root, iteration=None):
    """{(tp, pp): state} of every rank file of the checkpoint in ``root``."""
    tracked_iteration, release = checkpointing.read_tracker(root)
    iteration = tracked_iteration if iteration is None else iteration
    iter_dir = os.path.join(root, checkpointing.checkpoint_dir_name(iteration, release))
    tp, pp = checkpointing.saved_layout(iter_dir)
    return {(t, p): checkpointing.load_state_file(
        checkpointing.checkpoint_file(root, iteration, t, p, pp, release))
        for t in range(tp) for p in range(pp)}


# --- model forward at a checkpoint's own layout ---------------------------------------------

def _stage_forward(model, pstate, args, tokens, labels):
    """This stage's forward; activations go to the next stage by plain send / recv."""
    import torch.distributed as dist

    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    if pstate.pp_rank > 0:
        hidden = torch.empty(s, b, args.hidden_size)                        # [s, b, h]
        dist.recv(hidden, src=pstate.pp_ranks[pstate.pp_rank - 1])
        model.set_input_tensor(hidden)
    out = model(tokens, positions, None, labels=labels if pstate.is_last_stage() else None)
    if not pstate.is_last_stage():
        dist.send(out.contiguous(), dst=pstate.pp_ranks[pstate.pp_rank + 1])
        return None
    return out


def _eval_layouts(runs, tokens, labels):
    """For every ``argv`` (training flags + --load) in ``runs``: the full logits ``[b, s, V]``
    and the per-token losses ``[b, s]``, on the last stage's first TP / DP rank (None
    elsewhere)."""
    import torch.distributed as dist

    import pretrain_gpt
    from megatron.training import global_vars
    from megatron.core import parallel_state
    from megatron.inference import initialize_for_inference, load_model_for_inference

    results = []
    for argv in runs:
        args, pstate, _ = initialize_for_inference(argv=argv)
        try:
            chunks, _ = load_model_for_inference(pretrain_gpt.model_provider, args, pstate)
            with torch.no_grad():
                logits = _stage_forward(chunks[0], pstate, args, tokens, None)  # [b, s, V/tp]
                losses = _stage_forward(chunks[0], pstate, args, tokens, labels)
            if logits is not None:
                parts = [torch.empty_like(logits) for _ in range(pstate.tp_size)]
                dist.all_gather(parts, logits, group=pstate.tp_group)
                logits = torch.cat(parts, dim=-1)                             # [b, s, V]
            keep = logits is not None and pstate.tp_rank == 0 and pstate.dp_rank == 0
            results.append((logits, losses) if keep else None)
        finally:
            global_vars.unset_global_variables()
            parallel_state.destroy_model_parallel()
    return results


def _session(steps, tokens, labels):
    """Run ``steps`` in order on every rank of one process group (one spawn for a whole test):
    ``("train", argv)`` trains (and saves) with pretrain_gpt; ``("convert", src, dst, tp, pp[,
    ckpt_step])`` converts on rank 0 while the others wait; ``("eval", runs)`` is
    :func:`_eval_layouts`. Returns each step's result."""
    import torch.distributed as dist

    from megatron.core import parallel_state

    results = []
    for kind, *params in steps:
        if kind == "train":
            results.append(run_pretrain(*params))
            parallel_state.destroy_model_parallel()
        elif kind == "convert":
            if dist.get_rank() == 0:
                src, dst, tp, pp, *step = params
                _convert(src, dst, tp, pp, load={"ckpt_step": step[0]} if step else {})
            dist.barrier()
            results.append(None)
        else:
            results.append(_eval_layouts(params[0], tokens, labels))
    return results


def _session_results(world, steps):
    """Every step's result as rank 0 saw it, except ``eval`` steps: per layout, the one
    (logits, losses) pair a rank returned, and ``train`` steps: the last rank's."""
    generator = torch.Generator().manual_seed(7)
    text = torch.randint(0, TRUE_VOCAB, (2, 17), generator=generator)
    per_rank = run_on_ranks(_session, world, steps, text[:, :-1], text[:, 1:])
    out = []
    for i, (kind, *params) in enumerate(steps):
        if kind == "eval":
            layouts = []
            for j in range(len(params[0])):
                found = [r[i][j] for r in per_rank if r[i][j] is not None]
                assert len(found) == 1
                layouts.append(found[0])
            out.append(layouts)
        else:
            out.append(per_rank[-1][i])
    return out


def _eval_flags(corpus, load, tp, pp, extra=()):
    return gpt_flags(corpus, 2, tp=tp, micro_batch=1, global_batch=4, dropout=0.0,
                     extra=["--pipeline-model-parallel-size", str(pp), "--load", load]
                     + list(extra))


# --- naive join of raw files ----------------------------------------------------------------

def _naive_join(key, shards, swiglu=False):
    """The whole tensor from per-TP-rank shards, by name alone."""
    if key.endswith(("query_key_value.weight", "query_key_value.bias", "word_embeddings.weight",
                     "output_layer.weight")):
        return torch.cat(shards, 0)
    if key.endswith(("self_attention.dense.weight", "dense_4h_to_h.weight")):
        return torch.cat(shards, 1)
    if "dense_h_to_4h" in key:
        if not swiglu:
            return torch.cat(shards, 0)
        halves = [s.chunk(2, 0) for s in shards]                  # rank r: (gate_r, value_r)
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    return shards[0]


def _naive_whole(states, layers_per_stage, swiglu=False):
    """{flat key at TP=1 x PP=1: tensor} from a TP x PP checkpoint without virtual stages."""
    tp = 1 + max(t for t, _ in states)
    pp = 1 + max(p for _, p in states)
    whole = {}
    for p in range(pp):
        flats = [flatten_state_dict(states[(t, p)]["model"]) for t in range(tp)]
        for key in flats[0]:
            if key.startswith("word_embeddings_for_head"):
                continue
            name = key
            if ".layers." in key:
                head, rest = key.split(".layers.")
                local, tail = rest.split(".", 1)
                name = f"{head}.layers.{p * layers_per_stage + int(local)}.{tail}"
            whole[name] = _naive_join(key, [f[key] for f in flats], swiglu)
    return whole


def _assert_same_tensors(got: dict, want: dict):
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key], want[key]), key


# --- tests ----------------------------------------------------------------------------------

def test_tp2pp2_to_tp1_to_tp4_same_logits(tp2pp2_session):
    (tp2pp2, tp1, tp4), ((l22, loss22), (l11, loss11), (l41, _)) = tp2pp2_session
    source, one, four = _states(tp2pp2), _states(tp1), _states(tp4)
    whole = flatten_state_dict(one[(0, 0)]["model"])
    _assert_same_tensors(whole, _naive_whole(source, layers_per_stage=1))
    assert whole["language_model.embedding.word_embeddings.weight"].shape[0] == 256
    for state in list(one.values()) + list(four.values()):
        assert state["conversion"]["optimizer"] == "dropped" == state["conversion"]["rng"]
        assert "optimizer" not in state and "rng_state" not in state
        assert state["iteration"] == 2 and state["args"].consumed_train_samples == 8
        assert state["opt_param_scheduler"] == source[(0, 0)]["opt_param_scheduler"]
    assert four[(3, 0)]["conversion"]["from_layout"] == [1, 1]
    assert one[(0, 0)]["conversion"]["from_layout"] == [2, 2]
    args = four[(0, 0)]["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.padded_vocab_size) == (4, 1, 512)   # 129 tokens padded to 128 x 4


    assert l22.shape == l11.shape == (2, 16, 256) and l41.shape == (2, 16, 512)
    torch.testing.assert_close(l11, l22, atol=ATOL, rtol=0)
    torch.testing.assert_close(l41[..., :256], l22, atol=ATOL, rtol=0)
    assert torch.all(l41[..., 256:] == 0)             # zero rows added by the wider padding
    assert l22.std() > 0.01
    torch.testing.assert_close(loss11, loss22, atol=ATOL, rtol=0)


def test_swiglu_rope_rmsnorm_gqa_round_trip_is_bit_identical(corpus, tmp_path):
    src, tp1, back = (str(tmp_path / name) for name in ("src", "tp1", "back"))
    *_, [(_, loss2), (_, loss1)] = _session_results(2, [
        ("train", _train_flags(corpus, src, 2, 1, extra=MODERN)),
        ("convert", src, tp1, 1, 1), ("convert", tp1, back, 2, 1),
        ("eval", [_eval_flags(corpus, src, 2, 1, MODERN), _eval_flags(corpus, tp1, 1, 1,
                                                                        MODERN)])])
    assert loss2.shape == (2, 16)
    torch.testing.assert_close(loss1, loss2, atol=ATOL, rtol=0)

    source, one, again = _states(src), _states(tp1), _states(back)
    whole = flatten_state_dict(one[(0, 0)]["model"])
    _assert_same_tensors(whole, _naive_whole(source, layers_per_stage=2, swiglu=True))
    assert "language_model.embedding.position_embeddings.weight" not in whole
    assert "language_model.output_layer.weight" in whole
    assert not any(key.endswith("bias") for key in whole)
    for rank in source:
        _assert_same_tensors(flatten_state_dict(again[rank]["model"]),
                             flatten_state_dict(source[rank]["model"]))


def test_training_resumes_from_converted_checkpoints(corpus, tmp_path):
    """Save at 4 of 8 iterations at TP=2; convert to TP=1 x PP=2 and to TP=2 (same layout);
    both continue at iteration 5 with fresh Adam moments, the kept LR schedule and the same
    data, so they agree with each other, and iteration 5 (weights not yet updated) agrees with
    the run that never stopped."""
    src, conv12, conv21 = (str(tmp_path / name) for name in ("src", "tp1pp2", "tp2pp1"))

    def resume(tp, pp, load):
        return ("train", gpt_flags(corpus, 8, tp=tp, dropout=0.0, extra=[
            "--pipeline-model-parallel-size", str(pp), "--load", load]))

    straight, _, _, on12, on21 = _session_results(2, [
        ("train", _train_flags(corpus, src, 2, 1, iters=8, extra=["--save-interval", "4"])),
        ("convert", src, conv12, 1, 2, 4), ("convert", src, conv21, 2, 1, 4),
        resume(1, 2, conv12), resume(2, 1, conv21)])
    assert [i for i, _ in on12["losses"]] == [i for i, _ in on21["losses"]] == [5, 6, 7, 8]
    a, b = [loss for _, loss in on12["losses"]], [loss for _, loss in on21["losses"]]
    for x, y in zip(a, b):
        assert abs(x - y) <= RTOL_RESUME * abs(y), (a, b)
    reference = dict(straight["losses"])[5]
    assert abs(a[0] - reference) <= RTOL_RESUME * reference, (a, reference)
    assert a[1:] != [loss for i, loss in straight["losses"] if i > 5]   # Adam restarted


def test_bad_inputs_fail_with_clear_errors(tp2pp2, tmp_path):
    with pytest.raises(ConversionError, match="no latest_checkpointed_iteration.txt; not a "
                                              "Megatron checkpoint"):
        next(load_megatron(str(tmp_path)))
    dst = str(tmp_path / "out")
    with pytest.raises(ConversionError, match=r"--target-tensor-parallel-size 3 does not divide "
                                              r"--num-attention-heads \(4\)"):
        _convert(tp2pp2, dst, 3, 1)
    with pytest.raises(ConversionError, match=r"--target-pipeline-parallel-size 3 does not "
                                              r"divide --num-layers \(2\)"):
        _convert(tp2pp2, dst, 1, 3)
    assert not os.path.exists(dst)
    os.makedirs(dst)
    open(os.path.join(dst, "notes.txt"), "w").close()
    with pytest.raises(ConversionError, match="not empty .*notes.txt"):
        _convert(tp2pp2, dst, 1, 1)
    broken = shutil.copytree(tp2pp2, str(tmp_path / "broken"))
    os.remove(os.path.join(broken, "iter_0000002", "mp_rank_01_001", "model_optim_rng.pt"))
    with pytest.raises(ConversionError, match=r"mp_rank_01_001/model_optim_rng.pt: missing"):
        next(load_megatron(broken))


def test_interrupted_stream_leaves_nothing(tp2pp2, tmp_path):
    def cut(pieces, after):
        for i, piece in enumerate(pieces):
            if i == after:
                raise KeyboardInterrupt
            yield piece

    dst = str(tmp_path / "out")
    with pytest.raises(KeyboardInterrupt):
        save_megatron(cut(load_megatron(tp2pp2), 2), dst, 1, 1)
    assert not os.path.exists(dst)
    with pytest.raises(ConversionError, match="the stream ended without final_norm"):
        save_megatron((p for p in load_megatron(tp2pp2) if p.kind != "final_norm"), dst, 1, 1)
    assert not os.path.exists(dst)
    meta = next(load_megatron(tp2pp2))
    bad = [meta, Piece("embeddings", {"word_embeddings": torch.zeros(256, 31)})]
    with pytest.raises(ConversionError, match=r"embeddings .*word_embeddings has shape "
                                              r"\(256, 31\), expected \(256, 32\)"):
        save_megatron(bad, dst, 1, 1)


def _cli(*flags):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.run([sys.executable, "tools/checkpoint/convert.py"] + list(flags),
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_cli_errors_are_one_line_exit_1(tmp_path, capsys):
    from tools.checkpoint.convert import main

    os.makedirs(tmp_path / "src")
    common = ["--load-dir", str(tmp_path / "src"), "--save-dir", str(tmp_path / "out")]
    proc = _cli("--model-type", "T5", *common)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == ("convert.py: error: --model-type T5 is not supported: only "
                                   "GPT and BERT checkpoints can be converted")
    for flags, message in (
            (["--model-type", "GPT"], re.escape(
                f"--load-dir {tmp_path / 'src'}: no latest_checkpointed_iteration.txt; not a "
                "Megatron checkpoint folder")),
            (["--model-type", "GPT", "--saver", "hf", "--target-tensor-parallel-size", "2"],
             "--target-tensor-parallel-size applies only to --saver megatron, not --saver hf"),
            (["--model-type", "GPT", "--loader", "nemo"],
             r"argument --loader: invalid choice: 'nemo' \(choose from .*\) \(see --help\)")):
        with pytest.raises(SystemExit) as exit_info:
            main(flags + common)
        assert exit_info.value.code == 1
        assert re.fullmatch(f"convert.py: error: {message}\n", capsys.readouterr().err)
    assert not os.path.exists(tmp_path / "out")


def test_cli_converts_and_summarises(tp2pp2, tmp_path, capsys):
    from tools.checkpoint.convert import main

    dst = str(tmp_path / "out")
    assert main(["--model-type", "GPT", "--loader", "megatron", "--saver", "megatron",
                 "--load-dir", tp2pp2, "--save-dir", dst, "--target-tensor-parallel-size", "1",
                 "--target-params-dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "2 layers" in out and "megatron TP=2 PP=2" in out, out
    assert "-> megatron TP=1 PP=2" in out, out
    assert "dropped: RNG state (the Adam state is resharded" in out, out
    states = _states(dst)
    assert sorted(states) == [(0, 0), (0, 1)]       # PP defaults to the source's
    last = flatten_state_dict(states[(0, 1)]["model"])
    first = flatten_state_dict(states[(0, 0)]["model"])
    assert last["word_embeddings_for_head.weight"].dtype == torch.bfloat16
    assert torch.equal(last["word_embeddings_for_head.weight"],
                       first["language_model.embedding.word_embeddings.weight"])
    assert states[(0, 0)]["args"].bf16 and states[(0, 0)]["args"].params_dtype == torch.bfloat16
    source = _states(tp2pp2)
    want = torch.cat([source[(t, 0)]["model"]["language_model"]["embedding"]["word_embeddings"]
                      ["weight"] for t in range(2)]).to(torch.bfloat16)
    assert torch.equal(first["language_model.embedding.word_embeddings.weight"], want)


FROZEN = ["--num-layers", "4", "--lr", "0", "--min-lr", "0", "--lr-warmup-iters", "0"]


@pytest.fixture(scope="module")
def frozen_reference(corpus, tmp_path_factory):
    """A TP=1 x PP=1 checkpoint whose weights are the initial ones (--lr 0)."""
    reference = str(tmp_path_factory.mktemp("frozen") / "reference")
    _train(corpus, reference, 1, 1, iters=1, extra=FROZEN)
    return flatten_state_dict(_states(reference)[(0, 0)]["model"])


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,extra", [
    pytest.param(1, 2, ["--num-layers-per-virtual-pipeline-stage", "1"], id="pp2x2virtual"),
    pytest.param(1, 3, ["--decoder-first-pipeline-num-layers", "1",
                        "--decoder-last-pipeline-num-layers", "2"], id="pp3-uneven-1-1-2"),
    pytest.param(2, 2, ["--num-layers-per-virtual-pipeline-stage", "1"], id="tp2-pp2x2virtual"),
    # Rank 0 holds [E] [t], rank 1 [t t] [t L]: the saved layout places every layer.
    pytest.param(1, 2, ["--pipeline-model-parallel-layout", "E|tt|t|tL"], id="pp2-layout-vp"),
    # Rank 0 holds [E] [] (an empty virtual stage), rank 1 [t t] [t t L].
    pytest.param(1, 2, ["--standalone-embedding-stage", "--num-virtual-stages-per-pipeline-rank",
                        "2"], id="pp2-standalone-embedding-vp"),
])
def test_interleaved_and_uneven_pipelines_convert_exactly(corpus, tmp_path, frozen_reference,
                                                          tp, pp, extra):
    src = str(tmp_path / "src")
    _train(corpus, src, tp, pp, iters=1, extra=FROZEN + extra)
    first = _states(src)[(0, 0)]
    virtual = any(flag in extra for flag in ("--num-layers-per-virtual-pipeline-stage",
                                             "--num-virtual-stages-per-pipeline-rank",
                                             "E|tt|t|tL"))
    assert ("model1" in first) == virtual
    out = _convert(src, str(tmp_path / "out"), 1, 1)
    _assert_same_tensors(flatten_state_dict(_states(out)[(0, 0)]["model"]), frozen_reference)


@pytest.mark.slow  # the Megatron-written trained files are resharded in the default suite
def test_cli_carries_adam_state_so_the_resumed_run_continues(corpus, tmp_path):
    """Saved at 4 of 8 iterations by DP = 2 with the distributed optimizer, converted by the
    CLI to TP = 2 (Adam moments resharded like the weights), resumed without the distributed
    optimizer: iterations 5 to 8 follow the run that never stopped."""
    from tools.checkpoint import convert as tool

    src, dst = str(tmp_path / "src"), str(tmp_path / "tp2")
    straight = run_on_ranks(run_pretrain, 2, gpt_flags(corpus, 8, dropout=0.0, extra=[
        "--use-distributed-optimizer", "--save", src, "--save-interval", "4",
        "--ckpt-format", "torch"]))[0]
    tool.convert(tool.build_parser().parse_args([
        "--model-type", "GPT", "--load-dir", src, "--save-dir", dst, "--ckpt-step", "4",
        "--target-tensor-parallel-size", "2"]))
    state = checkpointing.load_state_file(checkpointing.checkpoint_file(dst, 4, 1, 0, 1))
    assert state["conversion"]["optimizer"] == "resharded"
    resumed = run_on_ranks(run_pretrain, 2, gpt_flags(corpus, 8, tp=2, dropout=0.0,
                                                      extra=["--load", dst]))[0]
    assert [i for i, _ in resumed["losses"]] == [5, 6, 7, 8]
    want = dict(straight["losses"])
    for i, loss in resumed["losses"]:
        assert abs(loss - want[i]) <= RTOL_RESUME * abs(want[i]), (resumed["losses"], want)
