"""``python -m glm_fp8.cli``: the ``glm-fp8`` command."""

from glm_fp8.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
