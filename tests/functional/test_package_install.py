"""The package metadata: setup.py declares the runtime dependencies of requirements.txt, and (slow)
a fresh virtual environment with ``pip install .`` preprocesses with sentence splitting, trains,
converts and serves, from a folder outside the checkout."""

import ast
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _setup_literal(name):
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"setup.py has no {name}")


def _requirement_names(lines):
    return {re.split(r"[<>=!~\[; ]", line.strip(), maxsplit=1)[0].lower()
            for line in lines if line.strip() and not line.lstrip().startswith(("#", "-r"))}


def test_setup_declares_the_runtime_requirements():
    requirements = (ROOT / "requirements.txt").read_text().splitlines()
    install = _setup_literal("INSTALL_REQUIRES")
    assert _requirement_names(install) == _requirement_names(requirements)
    pins = {r for r in requirements if r.startswith("torch")}
    assert pins <= set(install)  # the same torch pin as the compiled extensions need
    extras = _setup_literal("EXTRAS_REQUIRE")
    assert "transformers" in extras["hf"]
    dev = _requirement_names((ROOT / "requirements-dev.txt").read_text().splitlines())
    assert _requirement_names(extras["test"]) == dev
    assert re.search(r'name="megatron-compat"', (ROOT / "setup.py").read_text())


def _copy_source(dest):
    keep = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.split()
    for rel in keep:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _venv_runner(py, work, env):
    """``run(*cmd)``: ``py`` with ``cmd`` in ``work``; asserts success, returns stdout."""
    def run(*cmd, timeout=600):
        proc = subprocess.run([py, *map(str, cmd)], cwd=work, env=env, capture_output=True,
                              text=True, timeout=timeout)
        assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout

    return run


@pytest.fixture(scope="module")
def venv_with_dependencies(tmp_path_factory):
    """A fresh virtual environment holding setup.py's INSTALL_REQUIRES and nothing of this
    package: shared by both installs, so torch and the rest are installed once, not twice. Each
    test's ``pip install`` then resolves the same requirements against it."""
    venv = tmp_path_factory.mktemp("shared") / "venv"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    run = _venv_runner(str(venv / "bin" / "python"), venv.parent, env)
    run("-m", "pip", "install", "--quiet", *_setup_literal("INSTALL_REQUIRES"), timeout=2400)
    return venv, env


@pytest.mark.slow
@pytest.mark.parametrize("editable", [False, True], ids=["install", "editable"])
def test_fresh_venv_pip_install_preprocesses_trains_converts_and_serves(
        tmp_path, venv_with_dependencies, editable):
    """``pip install .`` and ``pip install --no-build-isolation -e .``, each from its own copy
    of the source into the shared environment; the editable install replaces the other where
    both run. The regular install builds in an isolated environment from pyproject.toml's build
    requirements and builds every extension (about a minute on 2 cores). The editable one is the
    README's GPU-machine install: it builds against the torch already in the environment (no
    second torch download into an isolated build environment), builds the data helpers and
    leaves out the fused kernels (``MEGATRON_SKIP_FUSED_BUILD=1``, its runs on the pure-torch
    bodies): their in-place build is what ``tools/setup_env.sh`` does for every test run, so
    compiling them a second time here would prove nothing new."""
    venv, env = venv_with_dependencies
    source, work = tmp_path / "source", tmp_path / "outside"
    _copy_source(source)
    work.mkdir()
    py = str(venv / "bin" / "python")
    if editable:
        env = dict(env, MEGATRON_SKIP_FUSED_BUILD="1", MEGATRON_FUSED_KERNELS="0")
    run = _venv_runner(py, work, env)

    if editable:
        # Without build isolation pip uses what the environment has: pyproject.toml's build
        # requirements (torch is already there, at the pinned version).
        build = ast.literal_eval(re.search(r"^requires = (\[.*\])$",
                                           (ROOT / "pyproject.toml").read_text(), re.M)[1])
        run("-m", "pip", "install", "--quiet", *build, timeout=2400)
    run("-m", "pip", "install", "--quiet",
        *(["--no-build-isolation", "-e"] if editable else []), source, timeout=2400)
    where = run("-c", "import megatron; print(megatron.__file__)")
    assert str(source if editable else venv) in where
    built = run("-c", "from megatron.fused_kernels import ops; import megatron.data._index_helpers "
                      "as h; print(ops.kernels_available('cpu'), h.__file__)")
    # The compiled helpers are found where the install put them; the fused kernels are built
    # ahead of time by the regular install.
    assert built.split()[0] == str(not editable), built
    assert str(source if editable else venv) in built.split()[1], built
    with open(work / "corpus.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": f"Dr. Smith met {i} cats. They sat down. Then a dog "
                                        "came by. It was late."}) + "\n")
    # The tools put the folder above them on sys.path: from a copy beside the work folder they
    # find no megatron there and run on the installed package (from source/tools a regular
    # install ran the checkout's copy, the server JIT-building the kernels it lacked: ~40 s).
    tools = work / "tools"
    shutil.copytree(source / "tools", tools)
    run(tools / "train_tokenizer.py", "--input", "corpus.jsonl", "--json-keys", "text",
        "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-size", "200", "--output",
        "vocab.txt")
    run(tools / "preprocess_data.py", "--input", "corpus.jsonl", "--output-prefix", "bert",
        "--json-keys", "text", "--split-sentences", "--tokenizer-type",
        "BertWordPieceLowerCase", "--vocab-file", "vocab.txt", "--workers", "1")
    assert (work / "bert_text_sentence.idx").exists()
    run("-c", "import shutil; from megatron.tokenizer import gpt2_vocab_files as f; "
              "v, m = f(); shutil.copy(v, 'vocab.json'); shutil.copy(m, 'merges.txt')")
    bpe = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "vocab.json", "--merge-file",
           "merges.txt"]
    run(tools / "preprocess_data.py", "--input", "corpus.jsonl", "--output-prefix", "gpt",
        "--json-keys", "text", "--append-eod", "--workers", "1", *bpe)
    # A copy of the entry script outside the checkout runs on the installed package.
    shutil.copy(source / "pretrain_gpt.py", work / "pretrain_gpt.py")
    out = run("pretrain_gpt.py", *"""--num-layers 2 --hidden-size 64 --num-attention-heads 4
        --seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4
        --lr 1e-3 --train-iters 2 --log-interval 1 --eval-interval 2 --eval-iters 1
        --data-path gpt_text_document --split 90,8,2 --num-workers 0 --save ckpt
        --device cpu""".split(), *bpe)
    assert "iteration        2/       2" in out
    run(tools / "checkpoint" / "convert.py", "--model-type", "GPT", "--loader", "megatron",
        "--saver", "hf", "--load-dir", "ckpt", "--save-dir", "hf")
    assert (work / "hf" / "model.safetensors").exists()
    port = _free_port()
    server = subprocess.Popen(
        [py, str(tools / "run_text_generation_server.py"), "--use-checkpoint-args", "--load",
         "ckpt", *bpe, "--device", "cpu", "--host", "127.0.0.1", "--port", str(port)],
        cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        answer = None
        deadline = time.monotonic() + 120
        while answer is None and time.monotonic() < deadline and server.poll() is None:
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/api", method="PUT",
                data=json.dumps({"prompts": ["The cat"], "tokens_to_generate": 3}).encode(),
                headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    answer = json.load(response)
            except OSError:
                time.sleep(1)
        assert answer is not None and answer["text"][0].startswith("The cat")
    finally:
        server.terminate()
        server.wait(timeout=60)
