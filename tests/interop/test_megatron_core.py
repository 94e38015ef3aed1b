"""torch_dist checkpoints both ways with Megatron-Core itself (slow: builds a virtual environment
with the ``megatron-core`` release from PyPI, once, and runs it under torchrun on the CPU).

The reference is Megatron-Core's own loader, saver and forward (``megatron_core_harness.py``,
run in that environment where this project is not importable) on Megatron's fixture model, whose
logits Megatron recorded in ``reference.pt``:

* files written here (by the converter, at TP 2 x PP 2, and by a training run's
  ``--ckpt-convert-format``) load in Megatron-Core at TP 1 and TP 2 and give Megatron's logits;
* a checkpoint Megatron-Core saves (its release's layout: ``common.pt``, several data files per
  rank) loads here at TP 1 and TP 2 and gives the same logits.

The environment lives in ``$MEGATRON_CORE_VENV`` (default ``~/.cache/megatron-compat/
megatron-core-<version>``); building it needs PyPI.
"""

import contextlib
import fcntl
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

from megatron.checkpoint.dist import DistCheckpointReader
from tests.functional.gpt_runs import run_pretrain
from tests.functional.test_megatron_written import (LOGITS_ATOL, _logits_after_load,
                                                    fixture_dir, megatron_argv, reference,
                                                    writable_copy)
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
HARNESS = pathlib.Path(__file__).with_name("megatron_core_harness.py")
MEGATRON_CORE = "megatron-core==0.16.1"
FIXTURE = "mcore_dist_tp1"  # its flags.json describes the model; legacy_tp1 holds the same bits


def _venv_dir() -> pathlib.Path:
    default = pathlib.Path.home() / ".cache" / "megatron-compat" / MEGATRON_CORE.replace("==", "-")
    return pathlib.Path(os.environ.get("MEGATRON_CORE_VENV", default))


@contextlib.contextmanager
def building(folder: pathlib.Path):
    """Held while ``folder`` is checked and built: test processes running side by side (pytest's
    workers) build it once, the others waiting, instead of writing into it together."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def test_building_lets_one_builder_in_and_the_others_wait(tmp_path):
    """Three builders of one folder at once (threads; each opens the lock file itself, as a
    pytest worker would): one builds, the others wait for it and find it built, and no two are
    inside together."""
    import threading
    import time

    folder, spans, built = tmp_path / "env", [], []
    ready = folder / ".ready"

    def builder():
        with building(folder):
            start = time.monotonic()
            if not ready.exists():
                time.sleep(0.3)
                folder.mkdir()
                ready.touch()
                built.append(threading.get_ident())
            spans.append((start, time.monotonic()))

    threads = [threading.Thread(target=builder) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(built) == 1 and len(spans) == 3
    spans.sort()
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert start >= end, spans   # a waiter got in only after the one before had left
    assert spans[-1][0] - spans[0][0] >= 0.3   # the waiters waited for the build


@pytest.fixture(scope="module")
def mcore_python():
    venv = _venv_dir()
    python = venv / "bin" / "python"
    ready = venv / ".ready"
    with building(venv):
        _build_venv(venv, python, ready)
    return python


def _build_venv(venv, python, ready):
    if not ready.exists():
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        torch_pin = f"torch=={torch.__version__.split('+')[0]}"
        result = subprocess.run([str(python), "-m", "pip", "install", "-q", torch_pin, "numpy",
                                 "packaging", "psutil", MEGATRON_CORE],
                                capture_output=True, text=True)
        assert result.returncode == 0, f"installing {MEGATRON_CORE}: {result.stderr[-2000:]}"
        ready.write_text(MEGATRON_CORE)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _megatron_core(python, mode: str, ckpt: str, out, tp: int, *extra) -> torch.Tensor:
    """Run the harness under torchrun at ``tp`` ranks from a folder outside the checkout (so
    only Megatron-Core's ``megatron`` package is importable); returns its logits."""
    cwd = pathlib.Path(out).parent
    torchrun = pathlib.Path(python).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", str(tp), str(HARNESS), mode,
           ckpt, os.path.join(fixture_dir(FIXTURE), "flags.json"),
           os.path.join(fixture_dir(FIXTURE), "reference.pt"), str(out), *map(str, extra)]
    result = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return torch.load(out, weights_only=True)


def _assert_megatrons_logits(logits):
    want = reference(FIXTURE)["logits"]
    assert logits.shape == want.shape
    assert float((logits - want).abs().max()) <= LOGITS_ATOL


def _our_logits(load_dir: str, tp: int):
    shutil.copy(os.path.join(fixture_dir(FIXTURE), "reference.pt"), load_dir)
    argv = megatron_argv(FIXTURE)
    argv[argv.index("--tensor-model-parallel-size") + 1] = str(tp)
    argv += ["--load", load_dir, "--device", "cpu"]
    logits, iteration, _ = run_on_ranks(_logits_after_load, tp, argv)[0]
    return logits, iteration


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Megatron's legacy file, converted here to torch_dist at TP 2 x PP 2 (four writers)."""
    out = tmp_path_factory.mktemp("converted") / "dist"
    cmd = [sys.executable, str(ROOT / "tools" / "checkpoint" / "convert.py"), "--model-type",
           "GPT", "--loader", "megatron", "--saver", "megatron", "--load-dir",
           fixture_dir("legacy_tp1"), "--save-dir", str(out), "--target-tensor-parallel-size",
           "2", "--target-pipeline-parallel-size", "2", "--target-ckpt-format", "torch_dist"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_core_loads_what_the_converter_writes(mcore_python, converted, tmp_path, tp):
    iter_dir = converted / "iter_0000010"
    assert len(list(iter_dir.glob("*.distcp"))) == 4
    _assert_megatrons_logits(_megatron_core(mcore_python, "load", str(iter_dir),
                                            tmp_path / "logits.pt", tp))


def test_megatron_core_loads_a_training_runs_save(mcore_python, tmp_path):
    """pretrain_gpt.py's own torch_dist writer (--ckpt-convert-format), read at TP 2."""
    source = writable_copy("legacy_tp1", tmp_path)
    saved = str(tmp_path / "dist")
    argv = megatron_argv("legacy_tp1") + ["--load", source, "--device", "cpu",
                                           "--ckpt-convert-format", "torch_dist",
                                           "--ckpt-convert-save", saved]
    run_on_ranks(run_pretrain, 1, argv)
    _assert_megatrons_logits(_megatron_core(mcore_python, "load",
                                            os.path.join(saved, "iter_0000010"),
                                            tmp_path / "logits.pt", 2))


def test_megatron_core_loads_a_transformer_engine_runs_save(mcore_python, tmp_path):
    """A --transformer-impl transformer_engine save (TransformerEngine's uint8 extra state, the
    fused norm names) loads in Megatron-Core. Its own TransformerEngine spec cannot be built
    without TransformerEngine installed (``get_gpt_layer_with_transformer_engine_spec`` needs
    ``TESpecProvider``), so the harness reads it with the local spec, whose keys are the same."""
    source = writable_copy("legacy_tp1", tmp_path)
    saved = str(tmp_path / "dist")
    argv = megatron_argv("legacy_tp1") + ["--load", source, "--device", "cpu",
                                           "--transformer-impl", "transformer_engine",
                                           "--ckpt-convert-format", "torch_dist",
                                           "--ckpt-convert-save", saved]
    run_on_ranks(run_pretrain, 1, argv)
    iter_dir = os.path.join(saved, "iter_0000010")
    reader = DistCheckpointReader(iter_dir)
    (extra,) = reader.read_object("decoder.layers.mlp.linear_fc1._extra_state/shard_0_4")
    assert isinstance(extra, torch.Tensor) and extra.dtype == torch.uint8
    _assert_megatrons_logits(_megatron_core(mcore_python, "load", iter_dir,
                                            tmp_path / "logits.pt", 1))


def test_a_checkpoint_megatron_core_saves_loads_here(mcore_python, tmp_path):
    """Megatron-Core loads its 2026 fixture (given the common.pt its release reads) and saves
    it again at TP 2 in its own release's layout; this project reads that at TP 1 and 2."""
    fixture = pathlib.Path(writable_copy(FIXTURE, tmp_path)) / "iter_0000010"
    torch.save({}, fixture / "common.pt")  # this release reads its common state from there
    saved = tmp_path / "saved_by_megatron_core"
    logits = _megatron_core(mcore_python, "round", str(fixture), tmp_path / "logits.pt", 2,
                            saved)
    _assert_megatrons_logits(logits)
    assert (saved / "iter_0000010" / "common.pt").is_file()
    assert not any(k.startswith("common_state") for k in _byte_keys(saved / "iter_0000010"))
    for tp in (1, 2):
        ours, iteration = _our_logits(str(saved), tp)
        assert iteration == 10
        _assert_megatrons_logits(ours)


def test_a_torch_format_save_of_megatron_core_loads_here(mcore_python, tmp_path):
    """Megatron-Core's GPT (local spec) at TP 2 saved as Megatron-LM's ``--ckpt-format torch``
    saves it: its own state dict, Megatron-Core's keys, per rank. It loads here at TP 2 and
    gives Megatron's logits."""
    fixture = pathlib.Path(writable_copy(FIXTURE, tmp_path)) / "iter_0000010"
    torch.save({}, fixture / "common.pt")
    saved = tmp_path / "torch_saved_by_megatron_core"
    _assert_megatrons_logits(_megatron_core(mcore_python, "torch", str(fixture),
                                            tmp_path / "logits.pt", 2, saved))
    state = torch.load(saved / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt",
                       weights_only=False)
    assert "decoder.layers.3.self_attention.linear_qkv.weight" in state["model"]
    ours, iteration = _our_logits(str(saved), 2)
    assert iteration == 10
    _assert_megatrons_logits(ours)


def test_megatron_core_loads_what_the_core_saver_writes(mcore_python, tmp_path):
    """``--saver core --saver-transformer-impl local`` at TP 2: Megatron-Core's local-spec GPT
    loads each rank's file with a strict ``load_state_dict`` and gives Megatron's logits."""
    out = tmp_path / "core"
    cmd = [sys.executable, str(ROOT / "tools" / "checkpoint" / "convert.py"), "--model-type",
           "GPT", "--loader", "legacy", "--saver", "core", "--saver-transformer-impl", "local",
           "--load-dir", fixture_dir("legacy_tp1"), "--save-dir", str(out),
           "--target-tensor-parallel-size", "2"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    _assert_megatrons_logits(_megatron_core(mcore_python, "torchload",
                                            str(out / "iter_0000010"), tmp_path / "logits.pt",
                                            2))


def _byte_keys(iter_dir):
    from megatron.checkpoint.dist import DistCheckpointReader

    return DistCheckpointReader(str(iter_dir)).byte_keys()


# -- optimizer state ----------------------------------------------------------------------------

TRAINED = "mcore_dist_tp1_trained"  # Megatron's file after 3 optimizer steps


def _optimizer_view(python, iter_dir, tmp_path) -> dict:
    """The Adam state Megatron-Core's own optimizer holds after loading ``iter_dir``."""
    cwd = tmp_path / "mcore_optim"
    cwd.mkdir(exist_ok=True)
    return _megatron_core(python, "optim", str(iter_dir), cwd / "state.pt", 1)


def _assert_view_is_the_file(view, iter_dir, step):
    from megatron.checkpoint.dist import DistCheckpointReader

    reader = DistCheckpointReader(str(iter_dir))
    assert view["step"] == step
    assert len(view["exp_avg"]) == 16  # every tensor key of the model
    for field in ("exp_avg", "exp_avg_sq"):
        for key, tensor in view[field].items():
            assert torch.equal(tensor, reader.read(f"optimizer.state.{field}.{key}")), key
    groups = reader.common_state()["optimizer"]["param_groups"]
    assert view["lr"] == [g["lr"] for g in groups]
    assert view["wd"] == [0.1, 0.0]


@pytest.mark.parametrize("source", [TRAINED, "legacy_tp1_trained"])
def test_megatron_core_reads_the_adam_state_the_converter_writes(mcore_python, tmp_path,
                                                                   source):
    """Megatron's trained files (torch_dist, and legacy with apex FusedAdam's state), resharded
    here to torch_dist at TP 2: Megatron-Core's optimizer gets the moments, step and learning
    rates the file holds, which for the torch_dist source are exactly Megatron's own."""
    out = tmp_path / "tp2"
    cmd = [sys.executable, str(ROOT / "tools" / "checkpoint" / "convert.py"), "--model-type",
           "GPT", "--loader", "megatron", "--saver", "megatron", "--load-dir",
           fixture_dir(source), "--save-dir", str(out), "--target-tensor-parallel-size", "2",
           "--target-ckpt-format", "torch_dist"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    view = _optimizer_view(mcore_python, out / "iter_0000003", tmp_path)
    _assert_view_is_the_file(view, out / "iter_0000003", 3.0)
    if source == TRAINED:
        _assert_view_is_the_file(view, os.path.join(fixture_dir(TRAINED), "iter_0000003"), 3.0)


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2"],
                                    ["--use-distributed-optimizer"]],
                         ids=["tp2", "dp2_distributed_optimizer"])
def test_megatron_core_reads_the_adam_state_a_training_run_saves(mcore_python, tmp_path,
                                                                   layout):
    """One more step of Megatron's trained file here, on 2 ranks, saved by pretrain_gpt.py's
    torch_dist writer (with the distributed optimizer every DP rank writes its own range):
    Megatron-Core's optimizer reads back what the file holds."""
    load = writable_copy(TRAINED, tmp_path)
    save = tmp_path / "saved"
    argv = megatron_argv(TRAINED)
    at = argv.index("--tensor-model-parallel-size")
    del argv[at:at + 2]
    argv += layout + ["--load", load, "--device", "cpu", "--mock-data", "--num-workers", "0",
                      "--eval-iters", "0", "--exit-interval", "4",
                      "--save", str(save), "--save-interval", "4"]
    if "--use-distributed-optimizer" in layout:  # DP 2: the same global batch of 2
        argv[argv.index("--micro-batch-size") + 1] = "1"
    run_on_ranks(run_pretrain, 2, argv)
    iter_dir = save / "iter_0000004"
    view = _optimizer_view(mcore_python, iter_dir, tmp_path)
    _assert_view_is_the_file(view, iter_dir, 4.0)
