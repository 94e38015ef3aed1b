"""No conversion destroys what it was given (issue 28): ``tools/checkpoint/convert.py`` never
writes over its source, refuses a non-empty target without ``--overwrite``, and a conversion
that fails midway leaves the target as it was and the source byte-identical.

The sources are tiny: a Hugging Face folder written by ``save_hf`` from a 2-layer GPT, and a
Megatron checkpoint written by ``save_megatron`` from the same stream. Folders are compared by the
SHA-256 of every file.
"""

import hashlib
import os
import re

import pytest
import torch

from megatron.convert.dist_io import load_dist, save_dist
from megatron.convert.hf import save_hf
from megatron.convert.megatron_io import load_megatron, save_megatron
from megatron.convert.target import TargetRefusedError
from tests.unit.test_convert_hf import build_model, canonical_pieces, make_meta
from tools.checkpoint.convert import main

SAVERS = {"hf": ["--saver", "hf", "--allow-no-tokenizer"],
          "megatron": ["--saver", "megatron"],
          "torch_dist": ["--saver", "megatron", "--target-ckpt-format", "torch_dist"]}


def _pieces(seed=0):
    cfg, model = build_model(seed=seed)
    return canonical_pieces(model, make_meta(cfg))


def _hashes(root):
    """Relative path -> SHA-256 of every file under ``root`` (None when it does not exist)."""
    if not os.path.exists(root):
        return None
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _leftovers(parent):
    return [n for n in os.listdir(parent) if ".converting-" in n or ".replaced-" in n]


@pytest.fixture
def hf_source(tmp_path):
    folder = str(tmp_path / "hf_source")
    save_hf(iter(_pieces(seed=0)), folder, allow_no_tokenizer=True)
    return folder


def _convert(capsys, load_dir, save_dir, saver, *extra):
    """Run the command line in this process; returns (exit status, stderr)."""
    argv = ["--model-type", "GPT", "--loader", "hf", *SAVERS[saver], "--load-dir", load_dir,
            "--save-dir", save_dir, *extra]
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("saver", SAVERS)
@pytest.mark.parametrize("relation", ["same", "symlink", "inside", "contains"])
def test_target_overlapping_the_source_is_refused(tmp_path, capsys, hf_source, saver, relation):
    """Without and with --overwrite (and --target-params-dtype bf16, which turned the source's fp32
    weights into bf16 ones when the HF saver wrote over them) the source stays byte-identical."""
    save_dir = {"same": hf_source, "inside": os.path.join(hf_source, "sub"),
                "contains": str(tmp_path)}.get(relation)
    if relation == "symlink":
        save_dir = str(tmp_path / "link")
        os.symlink(hf_source, save_dir)
    before, around = _hashes(hf_source), sorted(os.listdir(tmp_path))
    what = {"same": "is the source", "symlink": "is the source", "inside": "is inside the source",
            "contains": "contains the source"}[relation]
    for extra in ([], ["--overwrite"]):
        code, err = _convert(capsys, hf_source, save_dir, saver, "--target-params-dtype", "bf16",
                             *extra)
        assert code == 2, err
        assert re.fullmatch(rf"convert.py: error: --save-dir {re.escape(save_dir)} (\(= .*\) )?"
                            rf"{what} --load-dir {re.escape(hf_source)}: a conversion never "
                            r"writes where it reads; choose a --save-dir outside --load-dir\n",
                            err), err
        assert _hashes(hf_source) == before
        assert sorted(os.listdir(tmp_path)) == around


@pytest.mark.parametrize("saver", SAVERS)
def test_non_empty_target_needs_overwrite(tmp_path, capsys, hf_source, saver):
    """A non-empty --save-dir is refused, exit 2, naming what it holds; with --overwrite its old
    content is replaced by exactly what a conversion into a new folder writes."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"someone else's weights")
    before = _hashes(str(target))
    code, err = _convert(capsys, hf_source, str(target), saver)
    assert code == 2, err
    assert err == (f"convert.py: error: --save-dir {target}: not empty (holds config.json, "
                   "model.safetensors); choose a new or empty folder, or pass --overwrite to "
                   "replace its content once the conversion is complete\n")
    assert _hashes(str(target)) == before

    assert _convert(capsys, hf_source, str(target), saver, "--overwrite")[0] == 0
    fresh = str(tmp_path / "fresh")
    assert _convert(capsys, hf_source, fresh, saver)[0] == 0
    assert _hashes(str(target)).keys() == _hashes(fresh).keys()
    if saver == "hf":   # the Megatron files record their folder and time; HF files do not
        assert _hashes(str(target)) == _hashes(fresh)
    assert _leftovers(str(tmp_path)) == []


def _fail_on_write(monkeypatch):
    import safetensors.torch

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)


@pytest.mark.parametrize("existing", [False, True])
def test_hf_conversion_failing_midway_changes_nothing(tmp_path, capsys, hf_source, monkeypatch,
                                                      existing):
    """The safetensors writer fails (disk full): the target is absent, or with --overwrite
    unchanged, nothing is left next to it, and the source is byte-identical."""
    target = str(tmp_path / "target")
    if existing:
        save_hf(iter(_pieces(seed=1)), target, allow_no_tokenizer=True)
    before_source, before_target = _hashes(hf_source), _hashes(target)
    _fail_on_write(monkeypatch)
    with pytest.raises(OSError, match="No space left on device"):
        main(["--model-type", "GPT", "--loader", "hf", *SAVERS["hf"], "--load-dir", hf_source,
              "--save-dir", target] + (["--overwrite"] if existing else []))
    assert _hashes(target) == before_target
    assert _hashes(hf_source) == before_source
    assert _leftovers(str(tmp_path)) == []


def _cut(pieces, after):
    for i, piece in enumerate(pieces):
        if i == after:
            raise KeyboardInterrupt
        yield piece


@pytest.mark.parametrize("save,load", [(save_megatron, load_megatron), (save_dist, load_dist)],
                         ids=["torch", "torch_dist"])
def test_megatron_overwrite_failing_midway_keeps_the_old_checkpoint(tmp_path, save, load):
    """--overwrite of a Megatron checkpoint: a stream that stops after its first layer leaves the
    old checkpoint byte-identical; a complete one replaces it whole."""
    target = str(tmp_path / "target")
    save(iter(_pieces(seed=1)), target, 1, 1)
    (tmp_path / "target" / "notes.txt").write_text("kept until replaced")
    before = _hashes(target)
    with pytest.raises(TargetRefusedError, match="not empty"):
        save(iter(_pieces(seed=2)), target, 1, 1)
    with pytest.raises(KeyboardInterrupt):
        save(_cut(iter(_pieces(seed=2)), 3), target, 1, 1, overwrite=True)
    assert _hashes(target) == before
    assert _leftovers(str(tmp_path)) == []
    save(iter(_pieces(seed=2)), target, 1, 1, overwrite=True)
    assert "notes.txt" not in _hashes(target)
    want = _pieces(seed=2)[2].tensors
    got = list(load(target))[2].tensors
    assert all(torch.equal(got[k], want[k]) for k in want)
