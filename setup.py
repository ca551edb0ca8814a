"""Build script: the pure-Python package always; the CUDA extension glm_fp8._C only when asked
for and possible.

GLM_FP8_BUILD_CUDA=1 forces the extension (fails loudly without a CUDA toolkit), =0 skips it;
unset, it is built when csrc/ holds sources, torch is a CUDA build and nvcc is found.
GLM_FP8_CUDA_ARCH overrides the -gencode flags (default: sm_90, plus sm_100 where nvcc has it).
"""

import glob
import os
import subprocess

from setuptools import setup


def default_arch(cuda_home):
    archs = ["90"]
    try:
        listed = subprocess.run(
            [os.path.join(cuda_home or "", "bin", "nvcc"), "--list-gpu-arch"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        if "compute_100" in listed.split():
            archs.append("100")
    except (OSError, subprocess.CalledProcessError):
        pass
    return " ".join(f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs)


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
    arch = os.environ.get("GLM_FP8_CUDA_ARCH") or default_arch(CUDA_HOME)
    ext = CUDAExtension(
        "glm_fp8._C",
        sources,
        include_dirs=[os.path.abspath("csrc")],
        # No fast-math: the kernels must divide and round exactly as docs/numerics.md says.
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", *arch.split()]},
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = cuda_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
