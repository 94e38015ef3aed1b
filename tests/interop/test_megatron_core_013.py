"""``--dist-ckpt-save-pre-mcore-014`` with Megatron-Core 0.13 itself, the last release that
reads and writes the distributed optimizer's flattened ``fully_sharded_model_space`` layout
(slow; ``megatron_core_013_harness.py`` runs that release under torchrun on the CPU).

* a training run here saves the layout at DP 2 and at TP 2; Megatron-Core 0.13's distributed
  optimizer, asking for that sharding type, loads it and holds exactly the moments and main
  parameters of the file, as a reader written from the layout's definition on plain
  ``torch.distributed.checkpoint`` decodes them;
* that optimizer saves the layout at TP 2 and at DP 2 with moments derived from the weights;
  this project reads them back exactly, and a run here resumes from the file at TP 1 x DP 2
  and TP 2 with the losses of a resume from the same state converted to today's layout.

The release is the ``megatron-core==0.13.1`` wheel (2 MB, pure Python), installed without
dependencies into ``$MEGATRON_CORE_013_DIR`` (default ``~/.cache/megatron-compat/
megatron-core-0.13.1``) on first use, and imported ahead of the 0.16.1 environment of
``test_megatron_core.py``, whose torch and numpy it uses. Without it (no PyPI and no such
folder) the tests are skipped and say so.
"""

import os
import pathlib
import shutil
import subprocess

import pytest
import torch

from megatron.checkpoint.dist import DistCheckpointReader
from megatron.checkpoint.dist.flattened import open_view
from tests.functional.gpt_runs import run_pretrain
from tests.functional.test_megatron_written import fixture_dir, megatron_argv, writable_copy
from tests.functional.test_pre_mcore_014 import _tensors, _unflatten
from tests.interop.test_megatron_core import _env, building, mcore_python  # noqa: F401 - a fixture
from tests.multiprocess import run_on_ranks
from tools.checkpoint.convert import main as convert_main

pytestmark = pytest.mark.slow

HARNESS = pathlib.Path(__file__).with_name("megatron_core_013_harness.py")
RELEASE = "megatron-core==0.13.1"
TRAINED = "mcore_dist_tp1_trained"
PRE = "--dist-ckpt-save-pre-mcore-014"
FIELDS = ("exp_avg", "exp_avg_sq", "fp32_param")
LAYOUTS = {"dp2": [], "tp2": ["--tensor-model-parallel-size", "2"]}


def _release_dir() -> pathlib.Path:
    default = pathlib.Path.home() / ".cache" / "megatron-compat" / RELEASE.replace("==", "-")
    return pathlib.Path(os.environ.get("MEGATRON_CORE_013_DIR", default))


@pytest.fixture(scope="module")
def mcore013(mcore_python):  # noqa: F811 - the fixture imported above
    """``(python, folder)``: the 0.16.1 environment's python and the folder holding 0.13."""
    folder = _release_dir()
    with building(folder):
        failed = _install_release(mcore_python, folder)
    if failed:
        pytest.skip(failed)
    version = subprocess.run([str(mcore_python), "-c", "import megatron.core as m; "
                              "print(m.__version__)"], env=_release_env(folder), cwd=folder,
                             capture_output=True, text=True)
    assert version.stdout.strip().startswith("0.13."), version.stdout + version.stderr[-2000:]
    return mcore_python, folder


def _install_release(mcore_python, folder):
    """None when ``folder`` holds the release (installed now or before), else why not."""
    if not (folder / "megatron" / "core" / "__init__.py").is_file():
        shutil.rmtree(folder, ignore_errors=True)
        result = subprocess.run([str(mcore_python), "-m", "pip", "install", "-q", "--no-deps",
                                 "--target", str(folder), RELEASE],
                                capture_output=True, text=True)
        if result.returncode != 0:
            shutil.rmtree(folder, ignore_errors=True)
            return (f"{RELEASE} is not in {folder} and could not be installed there "
                    f"(pip install --no-deps --target {folder} {RELEASE}): "
                    f"{(result.stderr.strip().splitlines() or [''])[-1][-300:]}")
    return None


def _release_env(folder) -> dict:
    env = _env()
    env["PYTHONPATH"] = str(folder)
    return env


def _harness(mcore013, mode: str, ckpt, tp: int, out, *extra) -> list:
    """Run the harness on 2 ranks at tensor-parallel size ``tp``; each rank's view of its
    optimizer."""
    python, folder = mcore013
    torchrun = pathlib.Path(python).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", str(HARNESS), mode,
           str(ckpt), os.path.join(fixture_dir(TRAINED), "flags.json"), str(tp), str(out),
           *map(str, extra)]
    result = subprocess.run(cmd, cwd=pathlib.Path(out).parent, env=_release_env(folder),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [torch.load(f"{out}.{rank}", weights_only=True) for rank in range(2)]


def _merged(views) -> dict:
    """The ranks' views as whole tensors per field and key: every element held by some rank,
    alike where several hold it (a tensor replicated over TP)."""
    whole = {}
    for view in views:
        for field, per_key in view["global"].items():
            for key, part in per_key.items():
                into = whole.setdefault(field, {}).setdefault(
                    key, torch.full_like(part, float("nan")))
                held = ~torch.isnan(part)
                both = held & ~torch.isnan(into)
                assert torch.equal(into[both], part[both]), (field, key)
                into[held] = part[held]
    for field, per_key in whole.items():
        for key, tensor in per_key.items():
            assert not torch.isnan(tensor).any(), f"{field} of {key}: elements no rank holds"
    return whole


def _argv(layout, load, *extra):
    argv = megatron_argv(TRAINED)
    at = argv.index("--tensor-model-parallel-size")
    del argv[at:at + 2]
    argv += LAYOUTS[layout] + ["--use-distributed-optimizer", "--load", str(load), "--device",
                               "cpu", "--mock-data", "--num-workers", "0", "--eval-iters", "0",
                               *extra]
    if layout == "dp2":  # the same global batch of 2
        argv[argv.index("--micro-batch-size") + 1] = "1"
    return argv


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_megatron_core_013_loads_what_the_flag_writes(mcore013, tmp_path, layout):
    save = tmp_path / "saved"
    run_on_ranks(run_pretrain, 2, _argv(layout, writable_copy(TRAINED, tmp_path), PRE,
                                        "--exit-interval", "4", "--save", str(save),
                                        "--save-interval", "4"))
    iter_dir = save / "iter_0000004"
    (tmp_path / "mcore").mkdir()
    views = _harness(mcore013, "load", iter_dir, 2 if layout == "tp2" else 1,
                     tmp_path / "mcore" / "view")
    stored, _ = _tensors(str(iter_dir))
    wanted = sorted(k for k in stored if k.startswith("optimizer.state."))
    asked = sorted({meta[0] for view in views for meta in view["meta"]})
    assert asked == wanted
    held = _merged(views)
    assert sorted(held["exp_avg"]) == sorted(k for k in stored if not k.startswith("optim"))
    for field in FIELDS:
        for key, tensor in held[field].items():
            want = _unflatten(stored[f"optimizer.state.{field}.{key}"], tuple(stored[key].shape))
            assert torch.equal(tensor, want), (field, key)
    for key, tensor in held["fp32_param"].items():
        assert torch.equal(tensor, stored[key]), key   # fp32 training: the parameter itself
    assert [view["step"] for view in views] == [[4.0], [4.0]]
    saved_lr = DistCheckpointReader(str(iter_dir)).common_state()["optimizer"]["optimizer"]
    assert views[0]["lr"] == [g["lr"] for g in saved_lr["param_groups"]]


@pytest.fixture(scope="module")
def written_by_013(mcore013, tmp_path_factory):
    """Megatron-Core 0.13's saves of the fixture model, at TP 2 and at DP 2."""
    root = tmp_path_factory.mktemp("mcore013")
    source = pathlib.Path(writable_copy(TRAINED, root)) / "iter_0000003"
    torch.save({}, source / "common.pt")   # that release reads its common state from there
    saved = {}
    for layout, tp in (("tp2", 2), ("dp2", 1)):
        (root / layout).mkdir()
        _harness(mcore013, "save", source, tp, root / layout / "view", root / layout / "ckpt")
        saved[layout] = root / layout / "ckpt"
    return saved


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_this_project_reads_what_megatron_core_013_writes(written_by_013, layout):
    iter_dir = written_by_013[layout] / "iter_0000010"
    reader = open_view(DistCheckpointReader(str(iter_dir)))
    flat = reader.shape("optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight")
    assert flat == (4, 256, 64)   # read through the view: the flattened file is 4-D
    models = [k for k in reader.tensor_keys() if not k.startswith("optimizer.")]
    assert len(models) == 16
    for key in models:
        weight = reader.read(key)
        assert torch.equal(reader.read(f"optimizer.state.fp32_param.{key}"), weight), key
        assert torch.equal(reader.read(f"optimizer.state.exp_avg.{key}"), weight / 2 + 0.01), key
        assert torch.equal(reader.read(f"optimizer.state.exp_avg_sq.{key}"), weight * weight)


def test_runs_here_resume_from_megatron_core_013s_file(written_by_013, tmp_path):
    """From 0.13's TP 2 file, at TP 1 x DP 2 and at TP 2: the losses of a resume from the same
    state converted to today's layout by tools/checkpoint/convert.py."""
    source = written_by_013["tp2"]
    today = tmp_path / "today"
    assert convert_main(["--model-type", "GPT", "--load-dir", str(source), "--save-dir",
                         str(today), "--target-ckpt-format", "torch_dist"]) == 0
    raw = DistCheckpointReader(str(today / "iter_0000010"))
    assert raw.shape("optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight") == (
        4, 256, 64)
    for layout in ("dp2", "tp2"):
        got = run_on_ranks(run_pretrain, 2, _argv(layout, source, "--exit-interval", "12"))[-1]
        want = run_on_ranks(run_pretrain, 2, _argv(layout, today, "--exit-interval", "12"))[-1]
        assert [i for i, _ in got["losses"]] == [11, 12]
        assert got["losses"] == want["losses"], layout
