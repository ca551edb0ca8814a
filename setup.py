"""Build script: the pure-Python package always; the CUDA extension glm_fp8._C only when asked
for and possible.

GLM_FP8_BUILD_CUDA=1 forces the extension (fails loudly without a CUDA toolkit), =0 skips it;
unset, it is built when csrc/ holds sources, torch is a CUDA build and nvcc is found.
"""

import glob
import os

from setuptools import setup


def cuda_extensions():
    want = os.environ.get("GLM_FP8_BUILD_CUDA", "auto")
    sources = sorted(glob.glob("csrc/*.cu") + glob.glob("csrc/*.cpp"))
    if want == "0" or not sources:
        if want == "1":
            raise RuntimeError("GLM_FP8_BUILD_CUDA=1 but csrc/ holds no sources")
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        if want == "1":
            raise
        return [], {}
    if want != "1" and (CUDA_HOME is None or torch.version.cuda is None):
        return [], {}
    arch = os.environ.get("GLM_FP8_CUDA_ARCH", "-gencode=arch=compute_90,code=sm_90")
    ext = CUDAExtension(
        "glm_fp8._C",
        sources,
        # No fast-math: the kernels must divide and round exactly as numerics.md says.
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", *arch.split()]},
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = cuda_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
