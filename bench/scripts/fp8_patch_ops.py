"""Does torch on this device run the float8_e4m3fn ops that vLLM 0.34 calls to apply a sparse
checkpoint patch (``load_checkpoint_weight_patches``), with the bytes' meaning?

    python3 bench/scripts/fp8_patch_ops.py [--device cuda]

vLLM stages a sparse patch of an FP8 tensor as ``torch.full(nan)`` then ``index_copy_`` of the new
values, and its loader's final copy becomes ``torch.where(torch.isnan(source), destination,
source, out=destination)``. A CPU build of torch lacks ``index_copy_`` of e4m3
(tests/integrations/test_vllm_sparse_patch_real.py stands in for it with the uint8 views). This
runs each op on random e4m3 bytes (every pattern but NaN's) and compares the result with the
same op on the uint8 views (e4m3fn's NaN is S.1111.111). Prints one line per op: "same",
"differs" or the error torch raised.
"""

from __future__ import annotations

import argparse

import torch

F8 = torch.float8_e4m3fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--n", type=int, default=1 << 20)
    args = p.parse_args()
    dev = torch.device(args.device)
    gen = torch.Generator(dev).manual_seed(0)
    raw = torch.randint(0, 256, (args.n,), device=dev, generator=gen, dtype=torch.int32).to(torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0  # no NaN among the values a patch carries
    values = raw.view(F8)
    dest = torch.randint(0, 256, (args.n,), device=dev, generator=gen, dtype=torch.int32).to(torch.uint8)
    idx = torch.randperm(args.n, device=dev, generator=gen)[: args.n // 100].sort().values
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}")

    def probe(name, run, want):
        try:
            got = run()
            print(f"{name}: {'same' if torch.equal(got.view(torch.uint8), want) else 'differs'}")
            return got
        except (RuntimeError, NotImplementedError) as exc:
            print(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
            return None

    nan_u8 = torch.full((args.n,), 0x7F, dtype=torch.uint8, device=dev)
    staged_u8 = nan_u8.clone().index_copy_(0, idx, raw[idx])
    full = probe(
        "torch.full(nan, float8_e4m3fn)",
        lambda: torch.full((args.n,), float("nan"), dtype=F8, device=dev),
        nan_u8,
    )
    staged = probe(
        "index_copy_ (float8_e4m3fn)",
        lambda: (full.clone() if full is not None else nan_u8.clone().view(F8)).index_copy_(
            0, idx, values[idx]
        ),
        staged_u8,
    )
    source = staged if staged is not None else staged_u8.view(F8)
    is_nan_u8 = (staged_u8 & 0x7F) == 0x7F
    probe("isnan (float8_e4m3fn)", lambda: torch.isnan(source).to(torch.uint8), is_nan_u8.to(torch.uint8))
    out = dest.clone().view(F8)
    probe(
        "where(isnan(src), dst, src, out=dst) (float8_e4m3fn)",
        lambda: torch.where(is_nan_u8, out, source, out=out),
        torch.where(is_nan_u8, dest, staged_u8),
    )


if __name__ == "__main__":
    main()
