"""Count the host syncs of a training step on CUDA, two independent ways.

A host sync (`.item()`, a device-to-host copy, `nonzero`, a data-dependent shape) stalls the CPU
until the GPU drains its queue, so the next kernels launch late; at a few hundred per
micro-batch they cap MFU. `count_host_syncs(step, device)` runs `step()` a few times and returns,
per step:

- `sync_debug_warnings`: the warnings of `torch.cuda.set_sync_debug_mode("warn")`, which flags
  each synchronizing call torch itself makes (including from the autograd engine's threads,
  whose warnings it hands back to the caller);
- `cuda_sync_calls`: the CUDA runtime's synchronizing calls the profiler records
  (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize, blocking cudaMemcpy);
- `cuda_memcpy_async`: every cudaMemcpyAsync, for context (host-to-device input copies too).

On CPU there is no asynchronous device to wait for: `None`, which reports print as "not
countable". Uses only APIs that torch 2.11 already has.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def count_host_syncs(step: Callable[[], object], device: torch.device, steps: int = 2) -> dict[str, float] | None:
    """Host syncs per call of `step()` on `device` (see the module docstring); None on CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    flagged = sum("synchroniz" in str(w.message).lower() for w in caught)
    torch.cuda.synchronize(device)

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize(device)
    calls = {row.key: row.count for row in prof.key_averages()}
    sync_calls = sum(calls.get(name, 0) for name in SYNC_CALLS) - 1  # our own synchronize above
    return {"sync_debug_warnings": flagged / steps, "cuda_sync_calls": max(sync_calls, 0) / steps,
            "cuda_memcpy_async": calls.get("cudaMemcpyAsync", 0) / steps}
