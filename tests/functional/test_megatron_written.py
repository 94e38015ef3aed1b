"""Checkpoints written by Megatron-LM itself (``tests/data/megatron_written``) open here.

The files were saved by Megatron-LM's own code, so they hold what a user brings: Megatron's
classes inside ``args``, its field conventions (``num_query_groups`` = 1 without GQA) and apex
FusedAdam's optimizer layout. Each is loaded through every path that reads a checkpoint, and the
model's forward on the recorded tokens must give the logits Megatron's own forward gave.
"""

import json
import os
import pickle
import shutil

import pytest
import torch

from megatron.checkpoint import safe_unpickle
from tests.multiprocess import run_on_ranks

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                    "megatron_written")
LEGACY = ("legacy_tp1", "legacy_tp1_trained")
# fp32 forward of the same weights with differently ordered reductions.
LOGITS_ATOL = 1e-5


def fixture_dir(name: str) -> str:
    return os.path.join(DATA, name)


def megatron_argv(name: str) -> list:
    with open(os.path.join(fixture_dir(name), "flags.json")) as f:
        return json.load(f)["megatron_argv"]


def reference(name: str) -> dict:
    return torch.load(os.path.join(fixture_dir(name), "reference.pt"), weights_only=True)


def writable_copy(name: str, dest) -> str:
    """A copy of a fixture (the originals are read-only, and a run writes beside them)."""
    out = os.path.join(str(dest), name)
    shutil.copytree(fixture_dir(name), out)
    for root, dirs, files in os.walk(out):
        for entry in dirs + files:
            os.chmod(os.path.join(root, entry), 0o755)
    return out


def the_rank_file(load_dir: str) -> str:
    with open(os.path.join(load_dir, "latest_checkpointed_iteration.txt")) as f:
        iteration = int(f.read())
    return os.path.join(load_dir, f"iter_{iteration:07d}", "mp_rank_00", "model_optim_rng.pt")


# --------------------------------------------------------------------------------------------
# Reading the files: stand-ins, and what is still refused
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", LEGACY)
def test_megatron_classes_are_inert_stand_ins(name):
    state = safe_unpickle.torch_load(the_rank_file(fixture_dir(name)))
    model_type = state["args"].model_type
    assert isinstance(model_type, safe_unpickle.StandIn)
    assert model_type.qualname == "megatron.core.enums.ModelType"
    assert model_type.value == 1 and model_type.name == "encoder_or_decoder"
    assert state["args"].num_query_groups == 1  # Megatron's value without GQA


class _CallsProjectFunction:
    """Pickles to a call of a real function of this project's own ``megatron`` package."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        from megatron.training import checkpointing

        return (checkpointing.check_save_dir, (self.path,))


class _CallsSystem:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_megatron_name_never_runs_even_when_importable(tmp_path):
    """A global under ``megatron.`` becomes a stand-in: even this project's own function of
    that name is not called (it would create the folder)."""
    target = str(tmp_path / "created_by_the_pickle")
    path = str(tmp_path / "payload.pt")
    torch.save({"iteration": 1, "x": _CallsProjectFunction(target)}, path)
    state = safe_unpickle.torch_load(path)
    assert isinstance(state["x"], safe_unpickle.StandIn)
    assert state["x"].args == (target,)
    assert not os.path.exists(target)


def test_other_globals_are_refused_by_name(tmp_path):
    marker = str(tmp_path / "code_ran")
    path = str(tmp_path / "payload.pt")
    torch.save({"args": _CallsSystem(marker)}, path)
    with pytest.raises(safe_unpickle.UnsafeCheckpointError, match=r"names posix\.system"):
        safe_unpickle.torch_load(path)
    with open(path, "rb") as f:
        data = f.read()
    with pytest.raises(safe_unpickle.UnsafeCheckpointError, match=r"a byte entry: .*system"):
        safe_unpickle.torch_load(data, "a byte entry")
    torch.save({"args": _CallsSystem(marker)}, path, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    with pytest.raises(safe_unpickle.UnsafeCheckpointError, match="refusing to load"):
        safe_unpickle.torch_load(path)
    assert not os.path.exists(marker)


def test_saved_args_are_read_in_this_projects_conventions():
    from megatron.training import checkpointing

    saved = safe_unpickle.torch_load(the_rank_file(fixture_dir("legacy_tp1")))["args"]
    view = checkpointing.megatron_args(saved)
    assert view.num_query_groups == view.num_attention_heads == 4
    assert not hasattr(view, "model_type")
    assert saved.num_query_groups == 1  # the file's own namespace is left as it was


# --------------------------------------------------------------------------------------------
# The forward of the loaded model equals Megatron's
# --------------------------------------------------------------------------------------------

def _logits_after_load(argv):
    """Rank body: build the model as the inference tools do, load ``--load``, run the recorded
    tokens; returns (logits, iteration, args fields)."""
    import pretrain_gpt
    from megatron.training import global_vars
    from megatron.inference import initialize_for_inference, load_model_for_inference

    load = argv[argv.index("--load") + 1]
    ref = torch.load(os.path.join(load, "reference.pt"), weights_only=True)
    try:
        args, pstate, tokenizer = initialize_for_inference(argv=argv)
        chunks, iteration = load_model_for_inference(pretrain_gpt.model_provider, args, pstate)
        with torch.no_grad():
            logits = chunks[0](ref["tokens"], ref["position_ids"], None)
        if pstate.tp_size > 1:
            from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
            logits = gather_from_tensor_model_parallel_region(logits, group=pstate.tp_group)
        return logits, iteration, {"num_query_groups": args.num_query_groups,
                                   "num_layers": args.num_layers,
                                   "ids": (tokenizer.vocab_size, tokenizer.eod)}
    finally:
        global_vars.unset_global_variables()


@pytest.mark.parametrize("name", LEGACY)
def test_load_gives_megatrons_logits(name):
    """Also the ids: the 2023 writer's --vocab-size 199 meant 200 ids with end of document
    199 (flags.json), and the run that loads it keeps them, though --vocab-size 199 alone
    now means 199 ids."""
    argv = megatron_argv(name) + ["--load", fixture_dir(name), "--device", "cpu"]
    logits, iteration, fields = run_on_ranks(_logits_after_load, 1, argv)[0]
    ref = reference(name)
    assert iteration == (10 if name == "legacy_tp1" else 3)
    torch.testing.assert_close(logits.float(), ref["logits"], atol=LOGITS_ATOL, rtol=0)
    with open(os.path.join(fixture_dir(name), "flags.json")) as f:
        flags = json.load(f)
    assert fields["ids"] == (flags["tokenizer_vocab_size"], flags["eod_id"]) == (200, 199)


@pytest.mark.parametrize("name, vocab_size", [("legacy_tp1", "199"), ("mcore_dist_tp1", "200")])
def test_null_tokenizer_ids_follow_the_checkpoint_and_today_without_one(name, vocab_size):
    """With --load, the convention the checkpoint recorded; without, today's Megatron's
    (--vocab-size N: N ids, end of document N - 1)."""
    from megatron.training.training import parse_entry_flags
    from megatron.tokenizer import build_tokenizer

    argv = megatron_argv(name) + ["--device", "cpu"]
    assert argv[argv.index("--vocab-size") + 1] == vocab_size
    loaded = parse_entry_flags(argv + ["--load", fixture_dir(name)], None, None)
    fresh = parse_entry_flags(argv, None, None)
    ids = [(t.vocab_size, t.eod) for t in (build_tokenizer(loaded), build_tokenizer(fresh))]
    n = int(vocab_size)
    assert ids == [(200, 199), (n, n - 1)]


def test_use_checkpoint_args_takes_the_shape_from_the_file():
    """Only the flags a run needs beside the model's shape; the rest comes from the file."""
    argv = ["--use-checkpoint-args", "--load", fixture_dir("legacy_tp1"), "--device", "cpu",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "199", "--seq-length", "32",
            "--micro-batch-size", "2", "--hidden-dropout", "0", "--attention-dropout", "0"]
    logits, _, fields = run_on_ranks(_logits_after_load, 1, argv)[0]
    assert fields == {"num_query_groups": 4, "num_layers": 4, "ids": (200, 199)}
    torch.testing.assert_close(logits.float(), reference("legacy_tp1")["logits"],
                               atol=LOGITS_ATOL, rtol=0)


# --------------------------------------------------------------------------------------------
# Resuming training from the trained file
# --------------------------------------------------------------------------------------------

def megatron_cosine_lr(num_steps, max_lr=3e-4, min_lr=3e-5, warmup=4, decay=200):
    """Megatron's warmup + cosine schedule, in samples (FORMATS.md section 6a), in float64."""
    import math

    if num_steps <= warmup:
        return max_lr * num_steps / warmup
    ratio = (num_steps - warmup) / (decay - warmup)
    return min_lr + (max_lr - min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1.0)


def _resume_state(argv):
    """Rank body: set up as pretrain does, load; returns the optimizer's moments and steps per
    parameter name, the scheduler's count, and the learning rates of the next iteration."""
    import pretrain_gpt
    from megatron.training import checkpointing
    from megatron.training import global_vars
    from megatron.training.arguments import build_configs, parse_args, validate_args
    from megatron.training.initialize import initialize_megatron
    from megatron.tokenizer import build_tokenizer
    from megatron.training.training import setup_model_and_optimizer
    from megatron.training.train_state import TrainState

    args = validate_args(parse_args(argv=argv))
    pstate = initialize_megatron(args)
    try:
        tokenizer = build_tokenizer(args)
        build_configs(args)
        global_vars.set_global_variables(args=args, tokenizer=tokenizer, parallel_state=pstate)
        model, optimizer, scheduler = setup_model_and_optimizer(pretrain_gpt.model_provider,
                                                                args, pstate)
        train_state = TrainState()
        iteration = checkpointing.load_checkpoint(model, optimizer, scheduler, args, pstate,
                                                  train_state=train_state)
        names = {id(p): n for n, p in model[0].module.named_parameters()}
        moments = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state[p]
                moments[names[id(p)]] = {k: v.clone() for k, v in state.items()}
        steps_before = scheduler.num_steps
        scheduler.step(args.global_batch_size)
        lrs = [g["lr"] for g in optimizer.param_groups]
        return {"iteration": iteration, "moments": moments, "num_steps": steps_before,
                "next_lrs": lrs, "consumed": train_state.consumed_train_samples}
    finally:
        global_vars.unset_global_variables()


def _saved_moments(load_dir):
    """Moments of the file by parameter name: apex's state indices follow Megatron's two
    param groups (weight decay first), in the model's parameter order."""
    state = safe_unpickle.torch_load(the_rank_file(load_dir))
    names = _named_params_in_group_order()
    out = {}
    for group in state["optimizer"]["param_groups"]:
        for index in group["params"]:
            out[names[index]] = dict(state["optimizer"]["state"][index], step=group["step"])
    return out


def _named_params_in_group_order():
    """The legacy GPT's parameter names as Megatron groups them: weights (decayed) then biases
    and norms (not decayed), each in the module's order."""
    layer = ["input_layernorm.weight", "input_layernorm.bias",
             "self_attention.query_key_value.weight", "self_attention.query_key_value.bias",
             "self_attention.dense.weight", "self_attention.dense.bias",
             "post_attention_layernorm.weight", "post_attention_layernorm.bias",
             "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias",
             "mlp.dense_4h_to_h.weight", "mlp.dense_4h_to_h.bias"]
    names = ["language_model.embedding.word_embeddings.weight",
             "language_model.embedding.position_embeddings.weight"]
    names += [f"language_model.encoder.layers.{i}.{n}" for i in range(4) for n in layer]
    names += ["language_model.encoder.final_layernorm.weight",
              "language_model.encoder.final_layernorm.bias"]
    decayed = [n for n in names if n.endswith("weight") and "layernorm" not in n]
    return decayed + [n for n in names if n not in decayed]


def test_trained_file_resumes_with_megatrons_schedule_and_moments(tmp_path):
    load = writable_copy("legacy_tp1_trained", tmp_path)
    argv = megatron_argv("legacy_tp1_trained") + ["--load", load, "--device", "cpu",
                                                  "--mock-data"]
    out = run_on_ranks(_resume_state, 1, argv)[0]
    assert out["iteration"] == 3 and out["consumed"] == 6 and out["num_steps"] == 6
    # Iteration 4 runs at Megatron's learning rate for 8 samples.
    assert out["next_lrs"] == pytest.approx([megatron_cosine_lr(8)] * 2, rel=1e-12)
    saved = _saved_moments(load)
    assert set(out["moments"]) == set(saved)
    for name, want in saved.items():
        have = out["moments"][name]
        assert torch.equal(have["exp_avg"], want["exp_avg"]), name
        assert torch.equal(have["exp_avg_sq"], want["exp_avg_sq"]), name
        assert float(have["step"]) == want["step"] == 3


def test_trained_file_trains_on(tmp_path):
    """pretrain_gpt.py resumed from the file runs its next iterations (loss finite, no error)."""
    from tests.functional.gpt_runs import run_pretrain

    load = writable_copy("legacy_tp1_trained", tmp_path)
    argv = megatron_argv("legacy_tp1_trained") + [
        "--load", load, "--device", "cpu", "--mock-data", "--exit-interval", "5",
        "--eval-iters", "0", "--log-interval", "1", "--num-workers", "0"]
    out = run_on_ranks(run_pretrain, 1, argv)[0]
    assert out["iteration"] == 5
    assert len(out["losses"]) == 2 and torch.isfinite(torch.tensor(out["losses"])).all()


def test_finetune_takes_weights_only(tmp_path):
    load = writable_copy("legacy_tp1_trained", tmp_path)
    argv = megatron_argv("legacy_tp1_trained") + ["--load", load, "--device", "cpu",
                                                  "--mock-data", "--finetune"]
    out = run_on_ranks(_resume_state, 1, argv)[0]
    assert out["iteration"] == 0 and out["consumed"] == 0 and out["num_steps"] == 0
    assert all(not state for state in out["moments"].values())


# --------------------------------------------------------------------------------------------
# The converter: Megatron's files resharded (Adam state included) and exported
# --------------------------------------------------------------------------------------------

def convert(*argv):
    """tools/checkpoint/convert.py in this process (a user's mistake raises ConversionError)."""
    from tools.checkpoint import convert as tool

    tool.convert(tool.build_parser().parse_args(["--model-type", "GPT", *argv]))


@pytest.mark.slow  # the TP=2 resume below loads the same kind of converted file
def test_converted_to_tp2_gives_megatrons_logits(tmp_path):
    out = str(tmp_path / "tp2")
    convert("--load-dir", fixture_dir("legacy_tp1"), "--save-dir", out,
            "--target-tensor-parallel-size", "2")
    shutil.copy(os.path.join(fixture_dir("legacy_tp1"), "reference.pt"), out)
    argv = megatron_argv("legacy_tp1") + ["--load", out, "--device", "cpu"]
    argv[argv.index("--tensor-model-parallel-size") + 1] = "2"
    results = run_on_ranks(_logits_after_load, 2, argv)
    for logits, iteration, _ in results:
        assert iteration == 10
        torch.testing.assert_close(logits.float(), reference("legacy_tp1")["logits"],
                                   atol=LOGITS_ATOL, rtol=0)


def _tp_shard(name: str, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """Rank ``tp_rank``'s part of the whole tensor (or moment) of parameter ``name``."""
    from megatron.convert.megatron_layout import split_tensor, tp_split_rule

    if name.endswith("word_embeddings.weight"):
        return full.chunk(tp, dim=0)[tp_rank]
    if ".layers." in name:
        rule = tp_split_rule(name.split(".layers.", 1)[1].split(".", 1)[1], False)
        if rule is not None:
            return split_tensor(full, rule[0], rule[1], tp)[tp_rank]
    return full


def _global_name(local: str, pp_rank: int, pp: int, num_layers: int = 4) -> str:
    """The single-stage parameter name of a stage's local one."""
    if local == "word_embeddings_for_head.weight":
        return "language_model.embedding.word_embeddings.weight"  # the tied copy
    if ".layers." in local:
        head, rest = local.split(".layers.", 1)
        index, tail = rest.split(".", 1)
        return f"{head}.layers.{int(index) + pp_rank * num_layers // pp}.{tail}"
    return local


def _mcore_moments(name: str) -> dict:
    """Adam moments of a torch_dist fixture by legacy parameter name, read by global key."""
    from megatron.checkpoint.dist import DistCheckpointReader
    from megatron.checkpoint.dist.keys import mcore_key

    reader = DistCheckpointReader(os.path.join(fixture_dir(name), "iter_0000003"))
    step = int(float(reader.common_state()["optimizer"]["state"]["common_step"]))
    out = {}
    for param in _named_params_in_group_order():
        key, layer = mcore_key(param)
        entry = {"step": step}
        for field in ("exp_avg", "exp_avg_sq"):
            whole = reader.read(f"optimizer.state.{field}.{key}")
            entry[field] = whole if layer is None else whole[layer]
        out[param] = entry
    return out


@pytest.mark.parametrize("source,target_format,tp,pp", [
    ("legacy_tp1_trained", "torch", 2, 1),
    pytest.param("legacy_tp1_trained", "torch", 1, 2, marks=pytest.mark.slow),
    pytest.param("legacy_tp1_trained", "torch_dist", 2, 1, marks=pytest.mark.slow),
    pytest.param("mcore_dist_tp1_trained", "torch", 2, 1, marks=pytest.mark.slow)])
def test_converted_trained_file_resumes_with_its_moments(tmp_path, source, target_format, tp,
                                                         pp):
    """Resharded by the converter (either format to either), the file resumes at the new
    layout with Megatron's learning rate and every rank holding its part of the file's Adam
    moments."""
    out = str(tmp_path / f"tp{tp}pp{pp}")
    convert("--load-dir", fixture_dir(source), "--save-dir", out, "--target-ckpt-format",
            target_format, "--target-tensor-parallel-size", str(tp),
            "--target-pipeline-parallel-size", str(pp))
    argv = megatron_argv(source) + ["--load", out, "--device", "cpu", "--mock-data",
                                    "--ckpt-format", target_format]
    argv[argv.index("--tensor-model-parallel-size") + 1] = str(tp)
    argv[argv.index("--pipeline-model-parallel-size") + 1] = str(pp)
    results = run_on_ranks(_resume_state, tp * pp, argv)
    saved = (_saved_moments(fixture_dir(source)) if source.startswith("legacy")
             else _mcore_moments(source))
    seen = set()
    for rank, out_rank in enumerate(results):
        tp_rank, pp_rank = rank % tp, rank // tp
        assert out_rank["iteration"] == 3 and out_rank["num_steps"] == 6
        assert out_rank["next_lrs"] == pytest.approx(
            [megatron_cosine_lr(8)] * len(out_rank["next_lrs"]), rel=1e-12)
        for local, have in out_rank["moments"].items():
            name = _global_name(local, pp_rank, pp)
            seen.add(name)
            for field in ("exp_avg", "exp_avg_sq"):
                want = _tp_shard(name, saved[name][field], tp_rank, tp)
                assert torch.equal(have[field], want), (local, field, rank)
            assert float(have["step"]) == 3
    assert seen == set(saved)


def test_hf_export_of_a_null_tokenizer_model_gives_megatrons_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    out = str(tmp_path / "hf")
    from megatron.convert.schema import ConversionError

    with pytest.raises(ConversionError, match="--allow-no-tokenizer"):
        convert("--saver", "hf", "--load-dir", fixture_dir("legacy_tp1"), "--save-dir", out)
    convert("--saver", "hf", "--load-dir", fixture_dir("legacy_tp1"), "--save-dir", out,
            "--allow-no-tokenizer")
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ref = reference("legacy_tp1")
    with torch.no_grad():
        logits = model(ref["tokens"]).logits
    assert logits.shape[-1] == 200  # the tokenizer's size; Megatron pads to 256
    torch.testing.assert_close(logits, ref["logits"][..., :200], atol=LOGITS_ATOL, rtol=0)


# --------------------------------------------------------------------------------------------
# The tools that run a trained model: zero-shot evaluation and the generation server
# --------------------------------------------------------------------------------------------

def _evaluate(argv):
    from tasks.main import main

    return main(argv)


@pytest.mark.parametrize("name", ["legacy_tp1",
                                  pytest.param("mcore_dist_tp1", marks=pytest.mark.slow)])
def test_zero_shot_evaluation_gives_megatrons_loss(tmp_path, name):
    """WIKITEXT103 over one document made of the recorded sample (its tokens, then its last
    label): the one window's average loss is the mean of Megatron's per-token losses."""
    import numpy as np

    from megatron.data.indexed_dataset import IndexedDatasetBuilder, get_idx_path

    ref = reference(name)
    doc = torch.cat([ref["tokens"][0], ref["labels"][0, -1:]]).numpy().astype(np.int64)
    prefix = str(tmp_path / "sample_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.add_item(doc)
    builder.end_document()
    builder.finalize(get_idx_path(prefix))
    argv = megatron_argv(name) + ["--load", fixture_dir(name), "--device", "cpu",
                                  "--task", "WIKITEXT103", "--valid-data", prefix,
                                  "--overlapping-eval", "32", "--num-workers", "0"]
    result = run_on_ranks(_evaluate, 1, argv)[0][0]  # the one --valid-data file
    assert result["num_tokenized_tokens"] - 1 == 32
    assert result["avg loss"] == pytest.approx(float(ref["per_token_loss"][0].mean()),
                                               abs=LOGITS_ATOL)


def test_generation_server_serves_a_megatron_checkpoint(tmp_path):
    """tools/run_text_generation_server.py on Megatron's file answers with the greedy
    continuation that Megatron's logits give for the prompt's next token."""
    from tests.functional import test_text_generation_server as server

    ref = reference("mcore_dist_tp1")
    prompt = " ".join(str(int(t)) for t in ref["tokens"][0])
    want = int(ref["logits"][0, -1, :200].argmax())  # ids this tokenizer can produce
    flags = [f for f in megatron_argv("mcore_dist_tp1")]
    with server.Server(fixture_dir("mcore_dist_tp1"), tmp_path, extra=flags) as running:
        status, body = running.request({"prompts": [prompt], "tokens_to_generate": 1,
                                        "top_k": 1})
    assert status == 200, body
    assert body["text"][0].split()[-1] == str(want)


def test_null_tokenizer_ids_follow_a_pretrained_checkpoint(tmp_path):
    """--pretrained-checkpoint with an empty --load (a finetuning start): the same rule."""
    from megatron.training.training import parse_entry_flags
    from megatron.tokenizer import build_tokenizer

    argv = megatron_argv("legacy_tp1") + ["--device", "cpu", "--load", str(tmp_path),
                                          "--pretrained-checkpoint", fixture_dir("legacy_tp1")]
    tokenizer = build_tokenizer(parse_entry_flags(argv, None, None))
    assert (tokenizer.vocab_size, tokenizer.eod) == (200, 199)
