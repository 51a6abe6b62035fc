"""Builds the CPU kernel library (cpu_kernels/: one file per kernel family, registry.cc exporting them; common.h says
which file holds what; atlas_ops.cc: the stand-ins of Ascend's fused operators); everything else is in setup.cfg.

The library is optional: without a C++ compiler the install still succeeds, `--device cpu`
exports then use MindSpore's own MatMul and say so.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "cpu_kernels._mslite_llm_cpu_kernels",
    sources=["cpu_kernels/" + f for f in ("registry.cc", "pool.cc", "matmul16.cc", "attention.cc", "decode_ops.cc",
                                          "matmul_quant.cc", "atlas_ops.cc")],
    depends=["cpu_kernels/" + f for f in ("common.h", "pool.h", "matmul16.h", "ops.h", "dtypes.h")],
    language="c++",
    extra_compile_args=["-O3", "-std=c++14", "-pthread"],
    extra_link_args=["-pthread"],
    optional=True,
)], options={"build_ext": {"parallel": True}})  # the seven files compile on every core (pip install -e .)
