"""Build script: metadata is in setup.cfg; this file only adds the C extension.

``cgx._cquant`` is the fast CPU path of quantization (a fused single pass in
plain C, loaded with ctypes). It is optional: without a C compiler cgx falls
back to the pure-torch reference (correct, but several times slower) and warns.
"""

import glob
import os

from setuptools import Extension, setup

_sources = sorted(glob.glob(os.path.join("cgx", "csrc", "*.c")))

ext_modules = []
if _sources:
    ext_modules.append(
        Extension(
            "cgx._cquant",
            sources=_sources,
            # quant_impl.h is the kernel body included by quant.c: rebuild when it changes
            depends=sorted(glob.glob(os.path.join("cgx", "csrc", "*.h"))),
            # -ffp-contract=off: no fused multiply-add, so the C path rounds
            # exactly like the torch reference and the Triton kernels.
            extra_compile_args=["-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno"],
            optional=True,
        )
    )

setup(ext_modules=ext_modules)
