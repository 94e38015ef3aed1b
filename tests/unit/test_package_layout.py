"""The package's shape: no import cycle, no private name crossing a module boundary, the
module paths a Megatron-LM user's own scripts import.

The import graph is read from the source (every ``import`` statement, at module level or inside
a function), so a cycle hidden behind a function-level import counts too.
"""

import ast
import pathlib
import subprocess
import sys
from typing import Dict, List, Set

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron"


def _modules() -> Dict[str, pathlib.Path]:
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: pathlib.Path, mods: Dict[str, pathlib.Path]):
    """(imported module, imported names) for every import statement of module ``name``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in mods:
                    yield full, []
                else:
                    yield base, [alias.name]


def _graph(mods) -> Dict[str, Set[str]]:
    graph = {}
    for name, path in mods.items():
        graph[name] = {dep for dep, _ in _imports(name, path, mods) if dep in mods and dep != name}
    return graph


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_cycle():
    """The finder itself: a planted three-module cycle and a self-free chain."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle_in_the_package():
    mods = _modules()
    assert "megatron.training.training" in mods and "megatron.checkpoint.load" in mods
    assert _cycles(_graph(mods)) == []


def test_convert_is_above_the_checkpoint_package():
    """``megatron/convert`` imports the checkpoint package, never the reverse; ``megatron/core``
    imports nothing of the project outside itself."""
    mods = _modules()
    graph = _graph(mods)
    wrong = [(m, d) for m, deps in graph.items() for d in deps
             if (m.startswith("megatron.checkpoint") and d.startswith("megatron.convert"))
             or (m.startswith("megatron.core") and not d.startswith("megatron.core"))]
    assert wrong == []


def _is_extension(package: str, name: str) -> bool:
    """A compiled extension module (``_index_helpers.*.so``), private by naming convention."""
    folder = ROOT.joinpath(*package.split("."))
    return any(folder.glob(f"{name}.*.so")) or any(folder.glob(f"{name}.*.pyd"))


def test_no_private_name_crosses_a_module_boundary():
    """A name that starts with ``_`` is used only in the module that defines it: nothing imports
    one from another module of the package (and so nothing re-exports one)."""
    mods = _modules()
    crossing = []
    for name, path in mods.items():
        for dep, names in _imports(name, path, mods):
            if dep.startswith("megatron"):
                crossing += [f"{name} imports {dep}.{n}" for n in names
                             if n.startswith("_") and not n.startswith("__")
                             and not _is_extension(dep, n)]
    assert crossing == []


def test_top_level_holds_packages_and_a_handful_of_modules():
    modules = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= 4, modules
    assert not [p for p in PACKAGE.glob("*.py") if p.name.startswith(("checkpoint", "training_",
                                                                         "arguments_"))]


def test_megatron_lm_import_paths():
    """What a Megatron-LM user's script imports works here, in a fresh interpreter, and the
    public names are the harness's own functions."""
    code = (
        "from megatron.training import pretrain, get_args, print_rank_0, get_tokenizer\n"
        "from megatron.training import get_timers, print_rank_last, is_last_rank\n"
        "from megatron.training.arguments import parse_args\n"
        "from megatron.training.checkpointing import save_checkpoint, load_checkpoint\n"
        "import megatron.training.training as t, megatron.training.global_vars as g\n"
        "assert pretrain is t.pretrain and get_args is g.get_args\n"
        "args = parse_args(None, False, argv=['--num-layers', '3'])\n"
        "assert args.num_layers == 3\n"
        "def extra(parser):\n"
        "    parser.add_argument('--my-flag', type=int, default=7)\n"
        "    return parser\n"
        "assert parse_args(extra, argv=[]).my_flag == 7\n"
        "try:\n"
        "    get_args()\n"
        "except RuntimeError as err:\n"
        "    assert 'pretrain' in str(err)\n"
        "else:\n"
        "    raise AssertionError('get_args() before pretrain() returned')\n"
        "print_rank_0('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_importing_a_light_harness_module_does_not_build_the_harness():
    """``megatron.training``'s names resolve on use: importing the train state (as the
    checkpoint package does) leaves the training loop unimported."""
    code = ("import sys, megatron.training.train_state\n"
            "print('megatron.training.training' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
