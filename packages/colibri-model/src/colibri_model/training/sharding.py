"""FSDP2 (`fully_shard`) for models whose weights and AdamW state do not fit one device per copy.

With `parallelism="fsdp"` under torchrun, the model is built on the meta device and sharded
before any storage exists (model_init.py), so no rank ever holds the full model; each block is
all-gathered just for its forward and backward. DDP keeps a full copy per rank and is the
simpler, faster choice while the model fits (nano's 2.6B parameters + AdamW take ~42 GB in
fp32); FSDP2 applies to micro and grande.

Units, innermost first (each `fully_shard` call is one all-gather / reduce-scatter group):
  - every MoE router, in fp32 (`ROUTER_POLICY`): its scores pick the top-k and are compared
    with the expert bias, which the balancer moves by gamma = 1e-3, below bf16's step near 0.5
    (~0.004). A router is E x d numbers (nano: 64 x 1024 fp32, 256 KiB), so it stays gathered
    from forward to backward (`reshard_after_forward=False`): one small all-gather per layer
    and step instead of two;
  - every block, then the root (embedding, final norm, LM head), in the run's precision.

Mixed precision (bf16 runs): `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`:
parameters are all-gathered and computed in bf16 (so the grouped expert matmuls get bf16
weights), gradients reduce-scattered in fp32 into fp32 shards, and AdamW updates fp32 master
weights. fp32 runs use fp32 throughout.

NOTE: a router unit is an FSDP module nested inside its block, and its hooks run in the middle
of the block's forward: `torch.compile(block, fullgraph=True)` then fails ("Attempted to call
function marked as skipped", measured with torch 2.13 on gloo; torchtitan weaves its compile
around FSDP(GroupedExperts) for the same reason). So `fp32_routers=False` (the trainer passes it
when compiling) leaves the routers in their block's unit: their weights are then all-gathered in
bf16 like the rest of the block, while the master weights and the router's arithmetic stay fp32.

NOTE: norms are not given fp32 units. Each would add an all-gather and a reduce-scatter per norm
(four per block) for d numbers, and little would be won: RMSNorm normalises in fp32 and its
output is rounded to the bf16 activation dtype anyway, so a bf16 copy of the weight adds at most
one more bf16 rounding (relative 2^-9) to a product that is rounded to bf16 regardless; the
master weights stay fp32, so small updates still accumulate.

Checkpoints of a sharded run are DCP directories (dcp_checkpoint.py): every rank writes its own
shards, nothing is gathered.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

# cast_forward_inputs=False: the router casts its input to fp32 itself and returns the gates in
# its input's dtype; the block's policy decides that dtype, not this one.
ROUTER_POLICY = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                     cast_forward_inputs=False)


def precision_policy(bf16: bool) -> MixedPrecisionPolicy:
    if bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)


def shard_model(model: torch.nn.Module, bf16: bool = False, fp32_routers: bool = True) -> None:
    """Shard `model` in place (on the meta device or materialised): routers, blocks, root."""
    policy = precision_policy(bf16)
    for layer in model.moe_layers() if fp32_routers else []:
        fully_shard(layer.router, reshard_after_forward=False, mp_policy=ROUTER_POLICY)
    for block in model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
