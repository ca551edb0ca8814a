"""Does a small host read (``.item()``, what every vote and finite check does) wait behind a
large device-to-host copy on another stream? It does if both use the copy engine; then the
one-GPU stand-in link (D2H into pinned memory) serializes a pipeline that a real NCCL link,
which moves bytes with SM kernels, would not.

    python3 bench/scripts/link_probe.py
"""

import time

import torch


def main() -> None:
    src = torch.empty(288 << 20, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty(src.shape, dtype=torch.uint8, pin_memory=True)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    copy_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    flag.item()
    alone_ms = (time.perf_counter() - t0) * 1e3
    rows = []
    for _ in range(3):
        torch.cuda.synchronize()
        dst.copy_(src, non_blocking=True)  # on the default stream
        t0 = time.perf_counter()
        with torch.cuda.stream(side):
            flag.add_(1)
            flag.item()
        rows.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    print(
        f"D2H of 288 MiB: {copy_ms:.2f} ms; a flag read alone {alone_ms:.3f} ms, "
        f"while that copy runs on another stream: {', '.join(f'{r:.2f}' for r in rows)} ms"
    )


if __name__ == "__main__":
    main()
