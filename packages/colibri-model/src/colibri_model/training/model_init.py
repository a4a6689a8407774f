"""A fresh model for training: built on the meta device, materialised, then seeded and initialised.

Every world size and parallelism gets the same weights from the same seed:

    with torch.device("meta"): model = ColibriForCausalLM(config)   # shapes only, no memory
    (FSDP2: shard_model(model): each parameter becomes a meta DTensor shard)
    model.to_empty(device)                # allocate this rank's storage only (uninitialised)
    torch.manual_seed(seed); model.reset_parameters()

Under FSDP2 a parameter is a DTensor holding only this rank's rows, and `normal_` on it would
draw per-shard numbers (CPU: each rank's own generator; CUDA: DTensor's offset-based Philox),
which match no one-process init. `CpuDrawnInit` intercepts the random fills that
`reset_parameters` issues on a DTensor: it draws the FULL tensor on the CPU with the global
generator, exactly as a one-process CPU init draws it, and copies this rank's rows into the
shard. So every rank consumes the generator identically, the gathered weights equal a one-process
init bit for bit (tests/test_train_fsdp.py), and the RNG state after init is the same everywhere.

Cost: each rank draws every parameter once on the CPU, one tensor at a time (peak: the largest
single tensor in fp32, nano's embedding, 49152 x 1024 x 4 B = 192 MiB); device memory holds only
the shard. The draw is one generator stream, ~1.2e8 normals/s (measured, one core of an AMD EPYC
Zen 5: tiny's 7.5M parameters in 0.075 s), so nano (2.6B) takes ~22 s and grande (27B) ~4 min
per rank, once, at the start of a run (later legs resume and never initialise). That is the
price of bit-identical weights across world sizes; a per-tensor-seeded device draw would be
faster but match no one-process CPU init.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.overrides import TorchFunctionMode

from ..config import ColibriConfig
from ..model import ColibriForCausalLM

# In-place random fills on a tensor. `nn.init` functions (normal_, trunc_normal_, kaiming_*, ...)
# reach the mode as themselves (they check for torch-function overrides first), the Tensor
# methods as themselves; any other random fill on a DTensor is refused below, because it would
# silently give per-rank numbers.
_DRAWN = {torch.Tensor.normal_, torch.Tensor.uniform_}
_REFUSED = {torch.Tensor.bernoulli_, torch.Tensor.cauchy_, torch.Tensor.exponential_,
            torch.Tensor.geometric_, torch.Tensor.log_normal_, torch.Tensor.random_}


def _is_init_function(func) -> bool:
    return getattr(func, "__module__", None) == "torch.nn.init"


def shard_rows(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """The part of `full` that `like`'s rank holds (FSDP2 shards dim 0, `torch.chunk` style)."""
    if like.device_mesh.ndim != 1 or tuple(like.placements) != (Shard(0),):
        raise NotImplementedError(f"sharded init supports a 1-D mesh with Shard(0), not {like.placements}")
    rank, world = like.device_mesh.get_local_rank(), like.device_mesh.size()
    chunks = torch.chunk(full, world, dim=0)
    part = chunks[rank] if rank < len(chunks) else full[:0]
    if tuple(part.shape) != tuple(like.to_local().shape):
        raise RuntimeError(f"shard of {tuple(full.shape)} for rank {rank}/{world} has shape {tuple(part.shape)}, "
                           f"the DTensor holds {tuple(like.to_local().shape)}")
    return part


class CpuDrawnInit(TorchFunctionMode):
    """Random fills drawn on the CPU with the global generator, whatever the target holds.

    A DTensor shard gets its rows of the full tensor; a plain tensor off the CPU (one GPU) gets
    the whole draw copied in; a plain CPU tensor is filled as usual.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        drawn = func in _DRAWN or _is_init_function(func)
        if not isinstance(target, torch.Tensor) or not (drawn or func in _REFUSED):
            return func(*args, **kwargs)
        sharded = isinstance(target, DTensor)
        if func in _REFUSED and sharded:
            raise NotImplementedError(f"{func.__name__} on a sharded parameter would draw per-rank numbers")
        if func in _REFUSED or (not sharded and target.device.type == "cpu"):
            return func(*args, **kwargs)
        if kwargs.get("generator") is not None:
            raise NotImplementedError("the model init draws from the global CPU generator only")
        # NOTE: inside this method the mode is off, so `func` on the CPU tensor runs the plain
        # one-process code (an nn.init function runs its own Tensor.normal_ and so on).
        full = torch.empty(target.shape, dtype=target.dtype, device="cpu")
        rest = {k: v for k, v in kwargs.items() if k != "tensor"}
        func(full, *args[1:], **rest)
        with torch.no_grad():
            if sharded:
                target.to_local().copy_(shard_rows(full, target))
            else:
                target.copy_(full)
        return target


def meta_model(config: ColibriConfig) -> ColibriForCausalLM:
    with torch.device("meta"):
        return ColibriForCausalLM(config)


def materialise(model: ColibriForCausalLM, device: torch.device) -> None:
    """Allocate the (possibly sharded) storage and reset the buffers that are not saved."""
    model.to_empty(device=device)
    for layer in model.moe_layers():  # to_empty leaves garbage; these counters must start at 0
        layer.router.tokens_per_expert.zero_()


def initialise(model: ColibriForCausalLM, seed: int) -> None:
    """The seeded init: the same numbers for plain, sharded and on-device parameters."""
    torch.manual_seed(seed)
    with torch.no_grad(), CpuDrawnInit():
        model.reset_parameters()
