"""Count the operations that would make the host wait for an accelerator, on any device.

`torch.cuda.set_sync_debug_mode` only works on CUDA. `HostSyncCounter` works on CPU too, so
the "no host sync inside a micro-batch" promise is tested where the suite runs: a
TorchDispatchMode sees every aten op (forward and backward) and counts those that read device
data on the host or whose output shape depends on device data:

- `_local_scalar_dense`: `.item()`, `float(t)`, `int(t)`, `bool(t)`, `if t:`;
- copies from a device to the CPU (`.cpu()`, `.tolist()`, `.numpy()` of a device tensor);
- data-dependent shapes: `nonzero`, `bincount`, `unique`, `masked_select`, `repeat_interleave`
  without `output_size`, indexing with a boolean mask, `histc` with min == max;
- `_grouped_mm` (or our `grouped_linear` op) on CUDA in another dtype than bf16 or below sm90:
  its fallback copies the group offsets to the host.

On CPU, `.tolist()`, `.numpy()` and `.cpu()` of a CPU tensor dispatch nothing; the counter
patches those three methods while it is active and counts them as `host_read`, so a CPU test
also sees the reads that would be device-to-host copies on a GPU.

Example:
    >>> with HostSyncCounter() as syncs:
    ...     model(x, targets=y).loss.backward()
    >>> syncs.total, dict(syncs.events)      # 0, {} when the micro-batch is sync-free
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_DATA_DEPENDENT = {"nonzero", "bincount", "_unique2", "unique_dim", "unique_consecutive", "masked_select"}
_PATCHED = ("tolist", "numpy", "cpu")


def _op_name(func) -> str:
    return func._schema.name.split("::")[-1]


def _first_tensor(args) -> torch.Tensor | None:
    return next((a for a in args if isinstance(a, torch.Tensor)), None)


def sync_reason(func, args, kwargs) -> str | None:
    """Why this aten call would block the host on an accelerator (None: it would not)."""
    name = _op_name(func)
    if name == "_local_scalar_dense":
        return "item"
    if name in _DATA_DEPENDENT:
        return name
    if name == "repeat_interleave" and isinstance(args[0], torch.Tensor) and kwargs.get("output_size") is None \
            and (len(args) < 4 or args[3] is None):
        return "repeat_interleave"
    if name in ("index", "index_put", "index_put_") and len(args) > 1:
        indices = args[1] or []
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
            return "boolean_index"
    if name == "histc":
        low, high = kwargs.get("min", args[2] if len(args) > 2 else 0), kwargs.get("max", args[3] if len(args) > 3 else 0)
        if low == high:
            return "histc_range"
    if name in ("_to_copy", "copy_"):
        src = args[1] if name == "copy_" else args[0]
        dst_device = args[0].device if name == "copy_" else kwargs.get("device")
        if src.device.type != "cpu" and dst_device is not None and torch.device(dst_device).type == "cpu":
            return "device_to_host"
    if "grouped_mm" in name or "grouped_linear" in name:
        x = _first_tensor(args)
        if x is not None and x.device.type == "cuda" and (
                x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (9, 0)):
            return "grouped_mm_fallback"
    return None


class HostSyncCounter(TorchDispatchMode):
    """Counts would-be host syncs by cause in `events`; `total` sums them (see the module doc)."""

    def __init__(self):
        super().__init__()
        self.events: Counter[str] = Counter()
        self._saved: dict[str, object] = {}
        self._ignoring = 0

    @property
    def total(self) -> int:
        return sum(self.events.values())

    @contextlib.contextmanager
    def ignoring(self):
        """Count nothing inside (e.g. a CPU-only code path that reads host tensors)."""
        self._ignoring += 1
        try:
            yield
        finally:
            self._ignoring -= 1

    def _count(self, reason: str) -> None:
        if not self._ignoring:
            self.events[reason] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = sync_reason(func, args, kwargs)
        if reason is not None:
            self._count(reason)
        return func(*args, **kwargs)

    def __enter__(self):
        counter = self
        for method in _PATCHED:
            original = getattr(torch.Tensor, method)
            self._saved[method] = original

            def counted(tensor, *args, _original=original, **kwargs):
                if tensor.device.type == "cpu":  # a device tensor's copy is seen by the dispatch mode
                    counter._count("host_read")
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, method, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for method, original in self._saved.items():
                setattr(torch.Tensor, method, original)
            self._saved.clear()
