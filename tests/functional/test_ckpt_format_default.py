"""``--ckpt-format`` defaults to ``torch_dist``, as in Megatron-LM, and ``--load`` reads either
format whatever the flag says: the folder's own files decide.

Reference: the losses of one run that never stopped (one process, fp32, dropout 0); a resume at
the same layout continues them bit for bit from a folder of either format, under either flag.
"""

import os

import pytest

from megatron.training.arguments import ArgumentsError
from tests.unit.test_megatron_recipes import MIXTRAL_8X7B, _validate
from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

ITERS, SAVED_AT = 4, 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("data") / "counting"))


def _flags(corpus, extra=()):
    return gpt_flags(corpus, ITERS, dropout=0.0, micro_batch=1, extra=list(extra))


def _run(argv):
    return run_on_ranks(run_pretrain, 1, argv)[0]


@pytest.fixture(scope="module")
def saved(corpus, tmp_path_factory):
    """One folder per format (``--ckpt-format`` given for torch only), and the losses of the
    runs that wrote them."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for name, extra in (("torch_dist", []), ("torch", ["--ckpt-format", "torch"])):
        folder = str(root / name)
        run = _run(_flags(corpus, ["--save", folder, "--save-interval", str(SAVED_AT), *extra]))
        out[name] = (folder, dict(run["losses"]))
    return out


def test_a_current_mixtral_recipe_with_expert_tp_1_saves_without_the_flag():
    """Megatron's Mixtral recipe (TP 2, expert TP 1, --save, no --ckpt-format) is accepted and
    saves torch_dist; asking for the torch format names why it cannot."""
    words = MIXTRAL_8X7B.split() + ["--expert-tensor-parallel-size", "1", "--save", "/tmp/ckpt"]
    assert _validate(words, 64, False).ckpt_format == "torch_dist"
    with pytest.raises(ArgumentsError, match=r"^--ckpt-format torch cannot save "
                       r"--expert-tensor-parallel-size 1 with --tensor-model-parallel-size 2"):
        _validate(words + ["--ckpt-format", "torch"], 64, False)


def test_a_save_without_the_flag_writes_torch_dist_with_the_same_losses(saved):
    dist_folder, dist_losses = saved["torch_dist"]
    torch_folder, torch_losses = saved["torch"]
    assert dist_losses == torch_losses       # the format changes the files, not the numbers
    files = os.listdir(os.path.join(dist_folder, "iter_0000002"))
    assert ".metadata" in files and "metadata.json" in files, files
    assert not any(f.startswith("mp_rank_") for f in files), files
    assert os.listdir(os.path.join(torch_folder, "iter_0000002")) == ["mp_rank_00"]


@pytest.mark.parametrize("folder_format, flag", [
    ("torch", []),                                  # a torch folder under the default
    ("torch_dist", ["--ckpt-format", "torch"])])    # a torch_dist folder under the other flag
def test_load_detects_the_format_of_the_folder(corpus, saved, folder_format, flag):
    folder, straight = saved[folder_format]
    resumed = _run(_flags(corpus, ["--load", folder, "--ckpt-step", str(SAVED_AT), *flag]))
    assert [i for i, _ in resumed["losses"]] == list(range(SAVED_AT + 1, ITERS + 1))
    for i, loss in resumed["losses"]:
        assert loss == straight[i], (i, resumed["losses"], straight)


def _train_with_a_stray_tensor(argv):
    """pretrain_gpt with one parameter the torch_dist format has no key for."""
    import torch

    import pretrain_gpt
    from megatron.training import global_vars
    from megatron.training.training import pretrain

    def model_provider(*args, **kwargs):
        model = pretrain_gpt.model_provider(*args, **kwargs)
        model.language_model.encoder.layers[0].stray_scale = torch.nn.Parameter(torch.ones(1))
        return model

    try:
        state = pretrain(pretrain_gpt.train_valid_test_datasets_provider, model_provider, None,
                         pretrain_gpt.forward_step, argv=argv)
        return {"losses": state.train_loss_history}
    except Exception as err:   # noqa: BLE001 - the message is what the test reads
        return {"error": f"{type(err).__name__}: {err}"}
    finally:
        global_vars.unset_global_variables()


def test_a_model_torch_dist_cannot_hold_is_refused_before_training(corpus, tmp_path):
    out = run_on_ranks(_train_with_a_stray_tensor, 1,
                       _flags(corpus, ["--save", str(tmp_path / "dist")]))[0]
    assert out.get("error", "").startswith(
        "CheckpointError: --ckpt-format torch_dist (the default) cannot save this model: "
        "layer tensor 'stray_scale' has no Megatron-Core key"), out
    assert out["error"].endswith("; save it with --ckpt-format torch"), out
    assert not os.path.exists(tmp_path / "dist" / "latest_checkpointed_iteration.txt")
    out = run_on_ranks(_train_with_a_stray_tensor, 1, _flags(
        corpus, ["--save", str(tmp_path / "torch"), "--ckpt-format", "torch"]))[0]
    assert [i for i, _ in out["losses"]] == list(range(1, ITERS + 1)), out
