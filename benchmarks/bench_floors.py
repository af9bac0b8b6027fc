"""The host's floors for a load onto an accelerator, measured in the run that is compared against them.

The bytes of a load travel storage -> page cache -> host memory -> device; a load is as fast as the slowest hop it
does not overlap. On one host, in one run:

- host->device copies of ``--copy-mb`` from pageable memory, from pinned memory on one stream and split over four
  streams; device->host into pinned and pageable memory;
- the device's own copy bandwidth (bytes read + written per second, what LoRA fusion on the device is held to);
- where an fp32 checkpoint's cast to bf16 is cheapest: fp32 pinned -> device then cast there (what the staging ring
  does: twice the bytes over the link, a device-speed cast), against a cast on the host (all cores) then bf16
  pinned -> device (half the bytes, a host-speed cast), both in GB of fp32 source per second;
- page-cache reads of a warm ``--size-gb`` file with ``os.preadv`` in 64 MiB jobs into pinned memory (plain memory
  on a CPU host) with 1, 4, 8 and 16 threads;
- the file through ``staging.DeviceStaging`` (our ring: read threads into pinned buffers, copies on a copy stream)
  into device memory, with 8 threads: what our loads can reach on this host, against the rows above.

Nothing here is a goal: gpu_proof.py and bench_load.py state their goals as ratios to these figures. On a CPU host
(``--device cpu``) the device rows are None and say why; ``--tiny`` checks the plumbing at small sizes.

    python benchmarks/bench_floors.py [--device cuda] [--size-gb 2] [--copy-mb 1024] [--out-dir DIR] [--tiny] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

JOB_BYTES = 64 << 20
THREADS = (1, 4, 8, 16)


def best_seconds(fn, sync, reps: int = 3) -> float:
    fn()  # warm-up
    sync()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def copy_rows(device: torch.device, nbytes: int) -> dict:
    """GB/s of host<->device copies and of a device-to-device copy."""
    from vllm_diffusion_plugin.engine import platform

    sync = lambda: platform.synchronize(device)  # noqa: E731
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.fill_(1)
    pinned = platform.pinned_empty(nbytes, device)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    other = torch.empty_like(on_device)
    streams = [platform.new_stream(device) for _ in range(4)]
    quarter = nbytes // 4

    def four_streams() -> None:
        for i, stream in enumerate(streams):
            with platform.on_stream(device, stream):
                on_device[i * quarter:(i + 1) * quarter].copy_(pinned[i * quarter:(i + 1) * quarter],
                                                               non_blocking=True)
        for stream in streams:
            stream.synchronize()

    fp32 = pinned[:nbytes // 4 * 4].view(torch.float32)
    fp32.fill_(0.5)
    bf16_host = platform.pinned_empty(fp32.numel() * 2, device).view(torch.bfloat16)
    on_device_fp32 = on_device[:fp32.numel() * 4].view(torch.float32)
    on_device_bf16 = other[:fp32.numel() * 2].view(torch.bfloat16)

    def cast_on_device() -> None:
        on_device_fp32.copy_(fp32, non_blocking=True)
        on_device_bf16.copy_(on_device_fp32)

    def cast_on_host() -> None:
        bf16_host.copy_(fp32)
        on_device_bf16.copy_(bf16_host, non_blocking=True)

    gb = nbytes / 1e9
    return {
        "fp32_to_bf16_cast_on_device_gb_s": gb / best_seconds(cast_on_device, sync),
        "fp32_to_bf16_cast_on_host_gb_s": gb / best_seconds(cast_on_host, sync),
        "h2d_pageable_gb_s": gb / best_seconds(lambda: on_device.copy_(pageable), sync),
        "h2d_pinned_gb_s": gb / best_seconds(lambda: on_device.copy_(pinned, non_blocking=True), sync),
        "h2d_pinned_4_streams_gb_s": gb / best_seconds(four_streams, sync),
        "d2h_pinned_gb_s": gb / best_seconds(lambda: pinned.copy_(on_device, non_blocking=True), sync),
        "d2h_pageable_gb_s": gb / best_seconds(lambda: pageable.copy_(on_device), sync),
        "device_copy_gb_s": 2 * gb / best_seconds(lambda: other.copy_(on_device), sync),
    }


def page_cache_file(out_dir: Path, nbytes: int) -> Path:
    path = out_dir / f"floors-{nbytes}.bin"
    if not path.exists() or path.stat().st_size != nbytes:
        chunk = os.urandom(1 << 20) * 64
        with open(path, "wb") as f:
            for start in range(0, nbytes, len(chunk)):
                f.write(chunk[:nbytes - start])
    with open(path, "rb") as f:  # warm: every page in the page cache
        while f.read(JOB_BYTES):
            pass
    return path


def read_rows(path: Path, device: torch.device) -> dict:
    """GB/s of preadv into pinned (plain on a CPU) memory with 1/4/8/16 threads, 64 MiB jobs."""
    from vllm_diffusion_plugin.engine import platform

    size = path.stat().st_size
    buffer = (platform.pinned_empty(size, device) if device.type != "cpu" else torch.empty(size, dtype=torch.uint8))
    view = memoryview(buffer.numpy())
    fd = os.open(path, os.O_RDONLY)
    try:
        def job(start: int) -> None:
            done = 0
            while done < min(JOB_BYTES, size - start):
                done += os.preadv(fd, [view[start + done:start + min(JOB_BYTES, size - start)]], start + done)

        rows = {}
        for threads in THREADS:
            with ThreadPoolExecutor(threads) as pool:
                seconds = best_seconds(lambda: list(pool.map(job, range(0, size, JOB_BYTES))), lambda: None)
            rows[f"page_cache_read_{threads}_threads_gb_s"] = size / 1e9 / seconds
        return rows
    finally:
        os.close(fd)


def staging_row(path: Path, device: torch.device, threads: int = 8) -> dict:
    """GB/s of the warm file through our staging ring into device memory."""
    from vllm_diffusion_plugin.engine import platform
    from vllm_diffusion_plugin.engine.io.staging import DeviceStaging, StagedCopy
    from vllm_diffusion_plugin.engine.io.pagein import pread_into

    size = path.stat().st_size
    staging = DeviceStaging.open(device, threads=threads)
    dst = torch.empty(size, dtype=torch.uint8, device=device)
    fd = os.open(path, os.O_RDONLY)
    try:
        pieces = range(0, size, JOB_BYTES)

        def run() -> None:
            staging.copy_all((StagedCopy(dst[s:s + JOB_BYTES], torch.uint8,
                                         lambda buf, start, at=s: pread_into(fd, at + start, buf, path))
                              for s in pieces), threads=threads)

        seconds = best_seconds(run, lambda: platform.synchronize(device))
    finally:
        os.close(fd)
    return {f"staging_ring_{threads}_threads_gb_s": size / 1e9 / seconds,
            "staging_ring": {"slots": len(staging._buffers), "slot_bytes": staging.slot_bytes}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size-gb", type=float, default=2.0, help="the page-cache file")
    parser.add_argument("--copy-mb", type=int, default=1024, help="bytes per host<->device copy")
    parser.add_argument("--out-dir", type=Path, default=Path(tempfile.gettempdir()) / "vllm-diffusion-floors")
    parser.add_argument("--tiny", action="store_true", help="small sizes: check the plumbing")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.tiny:
        args.size_gb, args.copy_mb = 0.05, 16
    device = torch.device(args.device)
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, 0)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = page_cache_file(args.out_dir, int(args.size_gb * 1e9) // JOB_BYTES * JOB_BYTES or JOB_BYTES)
    report = {"device": str(device), "torch": torch.__version__, "cpu_count": os.cpu_count(),
              "file_bytes": path.stat().st_size, "copy_bytes": args.copy_mb << 20, **read_rows(path, device)}
    if device.type == "cpu":
        report["device_rows"] = "no accelerator: host<->device and staging rows not measured"
    else:
        report |= copy_rows(device, args.copy_mb << 20) | staging_row(path, device)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key:36s} {value:.2f}" if isinstance(value, float) else f"{key:36s} {value}")
    return report


if __name__ == "__main__":
    main()
