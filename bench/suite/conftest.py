"""Benchmarks run on the GPU when there is one, else in Triton's CPU interpreter (small shapes)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
