"""Builds the CPU kernel library (cpu_kernels/gemv.cc, atlas_ops.cc: the stand-ins of Ascend's fused operators, and
quant.cc: the int8/int4 weight matmuls); everything else is in setup.cfg.

The library is optional: without a C++ compiler the install still succeeds, `--device cpu`
exports then use MindSpore's own MatMul and say so.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "cpu_kernels._mslite_llm_cpu_kernels",
    sources=["cpu_kernels/gemv.cc", "cpu_kernels/atlas_ops.cc", "cpu_kernels/quant.cc"],
    depends=["cpu_kernels/dtypes.h"],
    language="c++",
    extra_compile_args=["-O3", "-std=c++14", "-pthread"],
    extra_link_args=["-pthread"],
    optional=True,
)])
