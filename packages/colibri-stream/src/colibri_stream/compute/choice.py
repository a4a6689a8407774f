"""`compute="auto"`: the native q4 kernel, torch's int4 kernels or dequantized matmuls, decided by
timing them here.

`resolve_compute` is where that happens, once, before a plan is built: `Engine.open` and
`Engine.plan` (engine.py, through assembly.py) resolve the option into `ComputeRoutes`, one route
per engine dtype the plan may size, and hand those to plan.py, which (with footprint.py) only adds
sizes up and never runs a kernel.

Which is faster depends on the CPU torch dispatches to, not on the model, and by a lot. Measured
on one machine (AMD EPYC, Zen 5, 2 vCPUs, torch 2.13.0+cpu, 1 thread, one token, median of 15),
forcing each capability with ATEN_CPU_CAPABILITY, one expert's SwiGLU in microseconds:

    expert (d x width)     capability   int4, bf16 act.   int4, f32 act.   dequantized f32
    NanoColibri 1024x512   AVX-512            62              2267              202
                           AVX2              192              2465              286
                           default          2390              2256              300
    Micro 1536x768         AVX-512           146              5152              716
                           AVX2              392              5186              770
                           default          5363              5093              791

So the int4 kernel with bf16 activations is 1.5-5x faster than a dense fp32 matmul where torch
has a vectorised int4 kernel, and 7-8x slower where it has none (default: ARM builds, old x86),
while f32 activations are always the slow path. A fixed rule would be wrong on some machine, so
"auto" times the kernels, once per process, on random weights of the model's expert shape
raised to at least NanoColibri's (below that, call overhead hides what the kernel costs, and a
decision taken on microseconds would flip with the load), and takes the dequantized path only
when it is at least `DEQUANT_MARGIN` times faster: int4 experts hold 4-8x fewer bytes, so under
a RAM budget they keep more experts cached, which a small compute gain does not buy. Each route
is timed as its best of `ROUNDS` interleaved calls: load only ever adds time. It costs a few
milliseconds (tens where the int4 kernel is slow).

Where the native kernel (compute/native_kernel.py) builds, it is timed too and chosen unless
torch's int4 kernel is more than `NATIVE_MARGIN` times faster on the expert alone. The margin is
wide because the expert's matmuls are not all a step pays: the native path computes from the
bytes read, so each miss saves the repack into torch's layout (1.3-2.3x the read, bench/RESULTS.md),
and it holds the resident projections as stored (q4/q8) instead of dequantized f32, so a step
reads 4-8x fewer resident bytes and a budget keeps more experts. The native route is timed as
decode runs it (a token's experts in one call per projection): measured on an AMD EPYC with
AVX-512 VNNI, one thread, NanoColibri's shape, 86-104 us per expert against 125-144 us for
torch's int4 (one expert at a time, as its route runs); timed one expert at a time, native was
the slower (170 us), but decode never runs it so. A whole decode step of a 24 x 64
Qwen3-MoE ran 1.1-1.5x faster native, and an OLMoE-shaped container in a memory cgroup of half
its size decoded 0.42 tok/s on torch's route (26 experts cached beside its f32 resident part,
393 MB read per token) against 1.71 tok/s native (110 experts, 131 MB per token).

A model without routed experts has no expert kernel to choose, only whether its projections stay
as stored on the native kernel or are dequantized into torch's matmuls: "auto" takes the native
route where the same timing finds the native kernel within `NATIVE_MARGIN` of the dequantized
matmuls (on SmolLM2-135M, one thread, AVX-512 VNNI: decode 16.3 tok/s dequantized, 123 native,
prefill 0.91x; the weights 538 MB in f32 against 139 MB as q8).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .expert_compute import int4_supported
from .native_expert import native_supported
from .native_kernel import kernel_unavailable

if TYPE_CHECKING:
    from colibri_int4 import ExpertBlobLayout
    from colibri_model import ColibriConfig

    from ..options import EngineOptions

DEQUANT_MARGIN = 2.0
NATIVE_MARGIN = 1.6
ROUNDS = 5
MIN_SHAPE = (1024, 512)  # d_model, expert_dim of the timed expert at least (NanoColibri's)
GROUP = 64


@dataclass(frozen=True)
class ComputeTiming:
    """One expert's SwiGLU matmuls for one token, each way, on this machine (best seconds).

    Attributes:
        int4_seconds: torch's int4 kernel with `kernel_dtype` activations.
        dequant_seconds: dense matmuls in the resident `dtype`.
        capability: the CPU kernel set torch dispatched to (e.g. "AVX2").
        threads: the threads timed on (1: see `time_compute`).
        shape: the (d_model, expert_dim) timed.
        native_seconds: per expert, timed as a decode token's TOKEN_EXPERTS experts in one call.
    """

    int4_seconds: float
    dequant_seconds: float
    capability: str
    threads: int
    shape: tuple[int, int]
    native_seconds: float | None = None  # None where the native kernel was not timed

    @property
    def choice(self) -> str:
        torch_choice = "dequant" if self.dequant_seconds * DEQUANT_MARGIN <= self.int4_seconds else "int4"
        if self.native_seconds is None:
            return torch_choice
        fastest_torch = min(self.int4_seconds, self.dequant_seconds)
        return "native" if self.native_seconds <= fastest_torch * NATIVE_MARGIN else torch_choice


_timings: dict[tuple, ComputeTiming] = {}


def _best_seconds(routes: dict, rounds: int = ROUNDS) -> dict[str, float]:
    best = dict.fromkeys(routes, float("inf"))
    for forward in routes.values():
        forward()  # warm-up: first calls allocate and pick kernels
    for _ in range(rounds):  # interleaved, so a load spike hits both routes alike
        for name, forward in routes.items():
            started = time.perf_counter()
            forward()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def _routes(d_model: int, expert_dim: int, dtype: torch.dtype, kernel_dtype: torch.dtype, native: bool,
            int4: bool = True) -> dict:
    gen = torch.Generator().manual_seed(0)

    def int4_weight(rows: int, cols: int):
        nibbles = torch.randint(0, 16, (rows, cols), dtype=torch.int32, generator=gen)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1)
        scales_and_zeros = torch.full((cols // GROUP, rows, 2), 0.01).to(kernel_dtype)
        return packed, scales_and_zeros

    if int4:
        gate_up, gate_up_sz = int4_weight(2 * expert_dim, d_model)
        down, down_sz = int4_weight(d_model, expert_dim)
    dense_gate_up = torch.randn(2 * expert_dim, d_model, generator=gen).to(dtype) * 0.01
    dense_down = torch.randn(d_model, expert_dim, generator=gen).to(dtype) * 0.01
    x = torch.randn(1, d_model, generator=gen)

    def int4_route():
        h = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(kernel_dtype), gate_up, GROUP, gate_up_sz)
        gate, up = h.split(expert_dim, dim=-1)
        torch.ops.aten._weight_int4pack_mm_for_cpu((F.silu(gate) * up).contiguous(), down, GROUP, down_sz)

    def dequant():
        gate, up = F.linear(x.to(dtype), dense_gate_up).split(expert_dim, dim=-1)
        F.linear(F.silu(gate) * up, dense_down)

    routes = {"int4": int4_route, "dequant": dequant} if int4 else {"dequant": dequant}
    if native:
        routes["native"] = _native_route(d_model, expert_dim, gen)
    return routes


TOKEN_EXPERTS = 8  # the native route is timed as a decode token runs it: this many experts in one call


def _native_route(d_model: int, expert_dim: int, gen: torch.Generator):
    """A decode token's experts as the engine computes them natively (NativeQ4Expert.forward_each:
    gate|up of all of them in one call, then down of all in one); per expert, divide by TOKEN_EXPERTS."""
    from .native_kernel import QuantizedActivations, q4_experts

    def q4_weight(rows: int, cols: int):
        packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen)
        return packed, torch.full((rows, cols // GROUP), 0.01).to(torch.bfloat16).view(torch.int16), None

    gate_ups = [q4_weight(2 * expert_dim, d_model) for _ in range(TOKEN_EXPERTS)]
    downs = [q4_weight(d_model, expert_dim) for _ in range(TOKEN_EXPERTS)]
    x = torch.randn(1, d_model, generator=gen)

    def native():
        h = q4_experts(QuantizedActivations(x), gate_ups, GROUP, row_each=False)
        gate, up = h.split(expert_dim, dim=-1)
        q4_experts(QuantizedActivations(F.silu(gate) * up), downs, GROUP, row_each=True)

    return native


def time_compute(d_model: int, expert_dim: int, dtype: torch.dtype, kernel_dtype: torch.dtype,
                 native: bool = False, int4: bool = True) -> ComputeTiming:
    """Time the routes (cached per process, capability, shape and dtypes); `native`: time the
    native kernel too (where it builds); `int4=False`: not torch's int4 kernel (a model without
    experts has nothing for it; `int4_seconds` is then infinite).

    Timed on one thread whatever the engine runs: the question is which kernels are faster, and
    on a loaded machine a parallel region waits for its other threads' time slices (measured on a
    2-vCPU EPYC under load: 2-21 ms with 2 threads for an expert that takes 0.1 ms on one), which
    made the choice follow the load instead of the kernels."""
    shape = (max(d_model, MIN_SHAPE[0]), max(expert_dim, MIN_SHAPE[1]))
    shape = (-(-shape[0] // GROUP) * GROUP, -(-shape[1] // GROUP) * GROUP)  # the kernel's K % group
    capability = torch.backends.cpu.get_cpu_capability()
    key = (capability, shape, dtype, kernel_dtype, native, int4)
    if key not in _timings:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            best = _best_seconds(_routes(*shape, dtype, kernel_dtype, native, int4))
        finally:
            torch.set_num_threads(threads)
        per_expert = best["native"] / TOKEN_EXPERTS if "native" in best else None
        _timings[key] = ComputeTiming(best.get("int4", float("inf")), best["dequant"], capability, 1, shape,
                                      per_expert)
    return _timings[key]


@dataclass(frozen=True)
class ComputeRoutes:
    """The routed-expert compute of an engine, resolved: "native" | "int4" | "dequant" for each
    engine dtype a plan may size (the route may differ by dtype, since the dequantized matmuls run
    in it). What `make_plan` takes instead of the `compute` option.

    Attributes:
        by_dtype: {engine dtype: route}.

    >>> ComputeRoutes({torch.float32: "int4"}).route(torch.float32)
    'int4'
    """

    by_dtype: Mapping[torch.dtype, str]

    def route(self, dtype: torch.dtype) -> str:
        try:
            return self.by_dtype[dtype]
        except KeyError:
            resolved = ", ".join(str(d).removeprefix("torch.") for d in self.by_dtype) or "none"
            raise ValueError(f"no compute route was resolved for dtype {str(dtype).removeprefix('torch.')} "
                             f"(resolved: {resolved}); resolve_compute with the plan's dtypes") from None


def resolve_compute(opts: EngineOptions, layout: ExpertBlobLayout | None, config: ColibriConfig,
                    dtypes: Iterable[torch.dtype]) -> ComputeRoutes:
    """`opts.compute` resolved for each of `dtypes` (`choose_compute`); "auto" times the routes
    here (`time_compute`, once per process and shape), an explicit choice is checked, never timed."""
    return ComputeRoutes({dtype: choose_compute(opts, layout, config, dtype) for dtype in dtypes})


def choose_compute(opts: EngineOptions, layout: ExpertBlobLayout | None, config: ColibriConfig,
                   dtype: torch.dtype) -> str:
    """native or int4 where asked or where possible and timed faster here; ValueError where the
    route asked for cannot run on this container or device."""
    if opts.compute == "dequant":
        return "dequant"
    native_reason = (native_supported(layout, config.d_model, config.expert_dim) if layout is not None
                     else kernel_unavailable())
    if opts.device.type != "cpu":
        native_reason = native_reason or f"the native kernel is a CPU kernel (device {opts.device})"
    if opts.compute == "native":
        if native_reason:
            raise ValueError(f"compute='native' is not possible: {native_reason}")
        return "native"
    if layout is None:  # a model without routed experts: its projections on the native kernel, or dequantized
        if opts.compute == "int4":  # torch's int4 kernels serve routed experts only
            raise ValueError("compute='int4' is not possible: the model has no routed experts (torch's int4 "
                             "kernels run experts only); compute='native' or 'dequant' runs its projections")
        if native_reason:
            return "dequant"
        return time_compute(config.d_model, config.dense_ffn_dim, dtype, opts.kernel_dtype, native=True,
                            int4=False).choice
    reason = int4_supported(layout, config.d_model, config.expert_dim)
    if opts.device.type != "cpu":
        reason = reason or f"the int4 kernels used here are CPU kernels (device {opts.device})"
    if opts.compute == "int4" and reason:
        raise ValueError(f"compute='int4' is not possible: {reason}")
    if reason:
        return "native" if opts.compute == "auto" and not native_reason else "dequant"
    if opts.compute == "auto":
        return time_compute(config.d_model, config.expert_dim, dtype, opts.kernel_dtype, not native_reason).choice
    return "int4"

