"""``glm-fp8``, the command line: ``main`` (the installed script; ``python -m glm_fp8.cli``), its
option parsers (``args``), the ``plan`` command (``plan``), the kernel benchmark (``bench``) and the
demo (``demo``). The top of the package: nothing in glm_fp8 imports it. Every glm_fp8 import below
``main`` happens inside the command that needs it, so that a CPU run can choose Triton's interpreter
(an environment variable read when the kernels are defined) before the kernels load."""

from glm_fp8.cli.main import main

__all__ = ["main"]
