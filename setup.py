"""Builds the CPU kernel library (cpu_kernels/: one file per kernel family, registry.cc exporting them; common.h says
which file holds what; atlas_ops.cc: the stand-ins of Ascend's fused operators) and the export's own C
(export/native: round-to-nearest and the golden's quantized rows in C); everything else is in setup.cfg.

Both are optional: without a C++ compiler the install still succeeds, `--device cpu` exports then use MindSpore's own
MatMul and say so, and a quantized export rounds and computes its golden references in numpy (the same values, slower).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "cpu_kernels._mslite_llm_cpu_kernels",
    sources=["cpu_kernels/" + f for f in ("registry.cc", "pool.cc", "matmul16.cc", "attention.cc", "decode_ops.cc",
                                          "matmul_quant.cc", "moe.cc", "atlas_ops.cc")],
    depends=["cpu_kernels/" + f for f in ("common.h", "pool.h", "matmul16.h", "ops.h", "dtypes.h")],
    language="c++",
    extra_compile_args=["-O3", "-std=c++14", "-pthread"],
    extra_link_args=["-pthread"],
    optional=True,
), Extension(
    # the export's own C (export/native: round-to-nearest, the golden reference's quantized rows); its own library,
    # no code shared with cpu_kernels/. -std=c99: no contraction of a multiply and an add; -fopenmp-simd: the
    # reductions' pragma only, no OpenMP runtime.
    "export.native._native",
    sources=["export/native/rtn.c", "export/native/golden_rows.c"],
    extra_compile_args=["-O3", "-std=c99", "-fopenmp-simd"],
    optional=True,
)], options={"build_ext": {"parallel": True}})  # the nine files compile on every core (pip install -e .)
