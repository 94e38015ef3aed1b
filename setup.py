"""Package and C++/CUDA extensions.

The extensions are built with ``torch.utils.cpp_extension`` (ninja). CUDA sources are added only
when the installed torch is a CUDA build and ``nvcc`` is available; a CPU-only machine builds the
CPU bodies alone.
"""

import os

from setuptools import find_packages, setup


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
    return exts


def _cmdclass():
    from torch.utils.cpp_extension import BuildExtension

    return {"build_ext": BuildExtension.with_options(use_ninja=True)}


setup(
    name="megatron-cpu",
    version="0.1.0",
    description="Megatron-style pretraining of transformer language models, CPU and GPU",
    packages=find_packages(include=["megatron", "megatron.*"]),
    python_requires=">=3.10",
    ext_modules=_extensions(),
    cmdclass=_cmdclass(),
    zip_safe=False,
)
