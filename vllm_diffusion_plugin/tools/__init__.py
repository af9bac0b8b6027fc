"""Tools users run beside the load itself: the server runner and the measurements.

- :mod:`.servers`: real ``vllm serve DIR --omni`` servers on loopback, one at a time, with bounded waits and a
  clean stop (``vllm-diffusion demo --serve``, ``benchmarks/bench_serve_startup.py``, the serving proof);
- :mod:`.process_stats`: peak RSS and bytes read per process of a server's process group, sampled;
- :mod:`.pagecache`: evict a file's pages from the page cache and check residency (cold-start measurements).

The regression gate for the vllm-omni patch units lives beside them: ``python -m
vllm_diffusion_plugin.doors.omni.regression``.
"""
