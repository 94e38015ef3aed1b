"""Every CUDA kernel header in csrc/fused compiles with this machine's nvcc for sm_80 and sm_90.

The CUDA bodies cannot run without a GPU (and torch here may be a CPU build), so this is the
check that they are valid CUDA: each ``*_kernels.cuh`` is included by a small driver that
instantiates every launcher (and so every kernel template) for float, __half and
__nv_bfloat16, compiled with ``nvcc -c`` for each architecture, warnings as errors. Skipped when
nvcc is absent. The headers must not need torch; the thin torch bindings (``*_cuda.cu``) are
compiled too, in a slow test, against torch's headers, as one translation unit.
"""

import os
import re
import subprocess

import pytest

from megatron.fused_kernels import loader

NVCC = loader.find_nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found")

ARCHS = ["sm_80", "sm_90"]
TYPES = ["float", "__half", "__nv_bfloat16"]

# Body of `template <typename T> void use()` per header: calls every launcher with T.
DRIVERS = {
    "softmax/softmax_kernels.cuh": """
        MaskIndex idx{};
        launch_masked_softmax_fwd<T>(nullptr, nullptr, idx, nullptr, 0, 0, 1.0f, 0);
        launch_masked_softmax_bwd<T>(nullptr, nullptr, nullptr, idx, nullptr, 0, 0, 1.0f, 0);
        launch_causal_softmax_fwd<T>(nullptr, nullptr, 0, 0, 0, 1.0f, 0);
        launch_causal_softmax_bwd<T>(nullptr, nullptr, nullptr, 0, 0, 0, 1.0f, 0);
    """,
    "layer_norm/layer_norm_kernels.cuh": """
        launch_norm_fwd<T, float>(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 0,
                                  1e-5f, false, 0);
        launch_norm_fwd<T, __half>(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 0,
                                   1e-5f, false, 0);
        launch_norm_fwd<T, __nv_bfloat16>(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                          0, 0, 1e-5f, true, 0);
        launch_norm_bwd<T, float>(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                  nullptr, nullptr, 0, 0, false, 0);
        launch_norm_bwd<T, __half>(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                   nullptr, nullptr, nullptr, 0, 0, false, 0);
        launch_norm_bwd<T, __nv_bfloat16>(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                          nullptr, nullptr, nullptr, 0, 0, true, 0);
    """,
    "bias_gelu/bias_gelu_kernels.cuh": """
        launch_bias_gelu_fwd<T>(nullptr, nullptr, nullptr, 0, 1, 0);
        launch_bias_gelu_bwd<T>(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 1, 0);
    """,
    "bias_dropout_add/bias_dropout_add_kernels.cuh": """
        DropoutArgs a{};
        launch_bias_dropout_add_fwd<T>(nullptr, nullptr, nullptr, nullptr, 0, 1, a, 0);
        launch_bias_dropout_add_bwd<T>(nullptr, nullptr, nullptr, nullptr, 0, 1, a, 0);
    """,
    "adam/adam_kernels.cuh": """
        AdamArgs s{};
        launch_adamw<T, float>(nullptr, nullptr, 0, s, 0);
        launch_adamw<T, __half>(nullptr, nullptr, 0, s, 0);
        launch_adamw<T, __nv_bfloat16>(nullptr, nullptr, 0, s, 0);
    """,
    "cross_entropy/cross_entropy_kernels.cuh": """
        launch_cross_entropy_fwd<T>(nullptr, nullptr, nullptr, 0, 1, 0, 0);
        launch_cross_entropy_bwd<T>(nullptr, nullptr, nullptr, nullptr, nullptr, 0, 1, 0, 0.0f,
                                    1.0f, 0);
    """,
}


def _relative(path: str) -> str:
    return os.path.relpath(path, loader.CSRC_DIR)


def test_every_kernel_header_has_a_driver():
    assert sorted(DRIVERS) == sorted(_relative(h) for h in loader.kernel_headers())


def _local_includes(path: str):
    """The header itself and every header it includes with quotes, transitively."""
    seen, todo = set(), [os.path.abspath(path)]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        with open(current) as f:
            for name in re.findall(r'#include\s+"([^"]+)"', f.read()):
                todo.append(os.path.abspath(os.path.join(os.path.dirname(current), name)))
    return seen


@pytest.mark.parametrize("header", sorted(DRIVERS))
def test_kernel_header_does_not_need_torch(header):
    for path in _local_includes(os.path.join(loader.CSRC_DIR, header)):
        with open(path) as f:
            includes = re.findall(r"#include\s+[<\"]([^>\"]+)[>\"]", f.read())
        bad = [i for i in includes if i.split("/")[0] in ("torch", "ATen", "c10")]
        assert not bad, f"{_relative(path)} includes torch headers {bad}"


def _nvcc(args, tmp_path, timeout=300):
    out = subprocess.run([NVCC] + args, capture_output=True, text=True, timeout=timeout,
                         cwd=tmp_path)
    assert out.returncode == 0, f"nvcc {' '.join(args)} failed:\n{out.stderr[-4000:]}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("header", sorted(DRIVERS))
def test_kernel_header_compiles(header, arch, tmp_path):
    body = "\n".join(f"template void use<{t}>();" for t in TYPES)
    driver = tmp_path / "driver.cu"
    driver.write_text(
        f'#include "{os.path.join(loader.CSRC_DIR, header)}"\n'
        "using namespace megatron_fused::cuda;\n"
        f"template <typename T> void use() {{\n{DRIVERS[header]}\n}}\n{body}\n")
    _nvcc(["-std=c++17", f"-arch={arch}", "--Werror", "all-warnings", "-c", str(driver), "-o",
           str(tmp_path / "driver.o")], tmp_path)


BINDINGS = [os.path.basename(p) for p in loader.cuda_sources()]

# What a binding may call or name, and the header that declares it. A binding must include the
# header itself: the slow test compiles every binding in one translation unit (torch's headers
# are parsed once, not six times), where one file's include would otherwise cover another's.
USES = {
    r"\bat::empty\(": "ATen/ops/empty.h",
    r"\bat::empty_like\(": "ATen/ops/empty_like.h",
    r"\bat::zeros\(": "ATen/ops/zeros.h",
    r"\bat::zeros_like\(": "ATen/ops/zeros_like.h",
    r"\bat::CUDAGeneratorImpl\b": "ATen/cuda/CUDAGeneratorImpl.h",
    r"\bTORCH_LIBRARY(_IMPL|_FRAGMENT)?\(": "torch/library.h",
    r"\bstd::(mutex|lock_guard|unique_lock)\b": "mutex",
    r"\bstd::(map|multimap)\b": "map",
    r"\bstd::unordered_map\b": "unordered_map",
    r"\bstd::vector\b": "vector",
    r"\bstd::(pair|move|swap|forward)\b": "utility",
    r"\bstd::(memcpy|memset|strcmp|strlen)\b": "cstring",
    r"\bstd::(sqrt|pow|exp|log|fabs|isfinite|isnan)\b": "cmath",
    r"\bcuda_ptr(_or_null)?<|\bdispatch_cuda_float_types\b|\bcurrent_stream\(": (
        "../common/cuda_binding.h"),
}


def _binding_path(binding):
    return next(p for p in loader.cuda_sources() if os.path.basename(p) == binding)


def _strip_comments(text):
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


def _missing_includes(binding, text):
    """The headers ``text`` (a binding's source) uses without including them."""
    text = _strip_comments(text)
    included = set(re.findall(r"#include\s+[<\"]([^>\"]+)[>\"]", text))
    missing = [header for pattern, header in USES.items()
               if re.search(pattern, text) and header not in included]
    kernels = binding.replace("_cuda.cu", "_kernels.cuh")
    return missing + ([kernels] if kernels not in included else [])


@pytest.mark.parametrize("binding", BINDINGS)
def test_torch_binding_includes_what_it_uses(binding):
    """Each binding includes its own kernel header and the header of everything in ``USES``
    it calls, so it compiles on its own as it does in the unity build of the slow test."""
    with open(_binding_path(binding)) as f:
        missing = _missing_includes(binding, f.read())
    assert not missing, f"{binding} uses but does not include {missing}"


@pytest.mark.parametrize("header", ["mutex", "ATen/ops/zeros.h", "torch/library.h",
                                    "../common/cuda_binding.h",
                                    "bias_dropout_add_kernels.cuh"])
def test_include_check_names_a_removed_include(header):
    """The check is not vacuous: the binding's text without one of its includes fails it,
    naming that header."""
    binding = "bias_dropout_add_cuda.cu"
    with open(_binding_path(binding)) as f:
        text = f.read()
    line = next(l for l in text.splitlines() if l.startswith("#include") and header in l)
    assert _missing_includes(binding, text) == []
    assert _missing_includes(binding, text.replace(line + "\n", "")) == [header]


def _binding_command(sources, tmp_path):
    """nvcc against torch's headers, for one translation unit that includes every binding in
    ``sources``. A CPU-only torch lacks one generated CUDA config header; an empty stand-in is
    enough to compile (not to link)."""
    import sysconfig

    import torch
    from torch.utils import cpp_extension

    stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    if not torch.version.cuda:
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    unity = tmp_path / "bindings.cu"
    unity.write_text("".join(f'#include "{s}"\n' for s in sources))
    includes = [tmp_path / "stub"] + cpp_extension.include_paths() + [
        sysconfig.get_paths()["include"]]
    return [NVCC, "-std=c++20", "-arch=sm_80", "--expt-relaxed-constexpr", "-c", str(unity),
            "-o", str(tmp_path / "bindings.o")] + [f"-I{p}" for p in includes]


@pytest.mark.slow
def test_torch_bindings_compile(tmp_path):
    """The thin bindings against torch's headers, all six in one nvcc run (~30 s; one run
    each took 66-81 s two at a time on 2 cores). Each binding's own includes are checked by
    ``test_torch_binding_includes_what_it_uses``."""
    sources = [_binding_path(b) for b in BINDINGS]
    args = _binding_command(sources, tmp_path)
    out = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, f"nvcc {' '.join(args[1:])} failed:\n{out.stderr[-4000:]}"
