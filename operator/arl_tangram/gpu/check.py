"""``make gpu-check``: this machine's GPUs, read-only, and how fast the built-in backend restores onto one.

1. Reads the NVML inventory (queries only: it never changes MIG mode, clocks or any GPU setting) and
   prints it.
2. Measures the host-to-device bandwidth itself: one pinned host buffer copied to the device, timed
   after a warm-up, median of several copies.
3. Runs the built-in reward backend through restore / score / evict cycles on the GPU with a model of
   the same size (weights pinned in host memory, no write-back), checks its scores against numpy,
   and prints the restore latency and GB/s beside that bandwidth (aim: 80% or more of it).

It imports only the standard library, numpy, nvidia-ml-py and torch (and the package's own
``gpu.inventory``, ``gpu.mig``, ``gpu.nvml`` and ``rewards.builtin``, which import nothing else), so it
runs where only those are installed. Without a GPU it prints one line and exits 1. Exit 0: the
restore reached the aim; 1: no GPU or no PyTorch; 3: it ran, below the aim.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from arl_tangram.gpu.inventory import describe
from arl_tangram.gpu.nvml import NvmlUnavailable, read_nvml

AIM = 0.8  # restore bandwidth as a fraction of the measured pinned host-to-device bandwidth
DIM = 256  # embedding width of the check's model: the embedding table is one large contiguous copy
BELOW_AIM = 3


def _fail(message: str) -> int:
    print(f"gpu-check: {message}", file=sys.stderr)
    return 1


def h2d_bandwidth(torch: Any, device: str, nbytes: int, repeats: int) -> tuple[float, bool]:
    """Median bytes per second of one pinned host buffer copied to ``device``; whether it was pinned."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    try:
        host = host.pin_memory()
        pinned = True
    except RuntimeError:
        pinned = False
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=pinned)  # warm-up: first-touch and driver mapping costs
    torch.cuda.synchronize(device)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=pinned)
        torch.cuda.synchronize(device)
        rates.append(nbytes / (time.perf_counter() - t0))
    del dev, host
    return statistics.median(rates), pinned


def restore_cycles(device: str, nbytes: int, cycles: int) -> dict[str, Any]:
    """Restore / score / evict the built-in backend ``cycles`` times (after one warm-up cycle)."""
    from arl_tangram.rewards.builtin import BuiltinScorer, random_model, score_numpy

    buckets = max(1, nbytes // (DIM * 4))
    meta, arrays = random_model(buckets=buckets, dim=DIM, hidden=64, seed=7)
    scorer = BuiltinScorer(meta, arrays, device)
    texts = [f"def f{i}(x): return x * {i}" for i in range(64)]
    want = score_numpy(arrays, meta, texts)
    scorer.restore()  # warm-up: the caching allocator gets its blocks once
    got = scorer.score(texts)
    scorer.evict()
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    if worst > 1e-3:
        raise RuntimeError(f"GPU scores differ from numpy by {worst:.2e}")
    seconds = []
    for _ in range(cycles):
        seconds.append(scorer.restore())
        scorer.score(texts[:8])
        scorer.evict()
    med = statistics.median(seconds)
    return {
        "model_bytes": scorer.nbytes,
        "pinned": scorer.pinned,
        "restore_s_median": med,
        "restore_s_max": max(seconds),
        "restore_gbps": scorer.nbytes / med / 1e9,
        "cycles": cycles,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=1024, help="bytes moved per copy and model size (MiB)")
    p.add_argument("--cycles", type=int, default=10, help="restore/evict cycles after the warm-up")
    p.add_argument("--device", default="cuda:0", help="the CUDA device to measure")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = p.parse_args(argv)
    if args.size_mib < 1 or args.cycles < 1:
        return _fail("--size-mib and --cycles must be >= 1")
    try:
        inv = read_nvml()
    except NvmlUnavailable as exc:
        return _fail(str(exc))
    if not inv.gpus:
        return _fail("NVML reports no GPU on this machine")
    try:
        import torch
    except ImportError:
        return _fail("PyTorch is not installed: the inventory is above; the restore check needs torch")
    if not torch.cuda.is_available():
        return _fail(f"PyTorch {torch.__version__} sees no CUDA device (CPU-only build, or no driver access)")
    nbytes = args.size_mib * 2**20
    free, _ = torch.cuda.mem_get_info(torch.device(args.device))
    if nbytes * 3 > free:  # the copy buffer and the model's device copy, with room to spare
        nbytes = max(2**20, free // 4)
    bw, pinned = h2d_bandwidth(torch, args.device, nbytes, repeats=max(5, args.cycles))
    res = restore_cycles(args.device, nbytes, args.cycles)
    ratio = res["restore_gbps"] * 1e9 / bw
    report = {
        "gpu": torch.cuda.get_device_name(torch.device(args.device)),
        "inventory_gpus": len(inv.gpus),
        "h2d_gbps": bw / 1e9,
        "h2d_pinned": pinned,
        **res,
        "ratio": ratio,
        "aim": AIM,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(describe(inv))
        print(f"device {args.device}: {report['gpu']}")
        print(
            f"host-to-device, {'pinned' if pinned else 'pageable'}: {bw / 1e9:.2f} GB/s "
            f"({nbytes / 2**20:.0f} MiB copies, median)"
        )
        print(
            f"built-in backend restore: {res['restore_s_median'] * 1e3:.1f} ms median "
            f"(max {res['restore_s_max'] * 1e3:.1f} ms) for {res['model_bytes'] / 2**20:.0f} MiB = "
            f"{res['restore_gbps']:.2f} GB/s over {res['cycles']} cycles"
        )
        verdict = "meets" if ratio >= AIM else "is below"
        print(f"restore / host-to-device: {ratio:.2f} ({verdict} the aim of {AIM:.2f})")
    return 0 if ratio >= AIM else BELOW_AIM


if __name__ == "__main__":
    raise SystemExit(main())
