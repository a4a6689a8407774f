"""validation_loss: the token-weighted sums stay on the device and the host reads them once per
run, whatever the number of batches; the loss equals the per-batch host computation (each batch's
mean loss read with .item(), weighted by its target count) exactly."""

from __future__ import annotations

import math

import pytest
import torch
from colibri_model import ColibriForCausalLM, get_preset
from colibri_model.data import IGNORE_INDEX
from colibri_model.host_syncs import HostSyncCounter
from colibri_model.training.distributed import DistributedContext
from colibri_model.training.validation import validation_loss

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()  # tiny tensors: a second OpenMP thread only adds barrier waits
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return ColibriForCausalLM(get_preset("tiny", vocab_size=512, max_seq_len=64))


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for i in range(n):
        x, y = torch.randint(0, 512, (2, 16), generator=g), torch.randint(0, 512, (2, 16), generator=g)
        y[0, : 3 + i] = IGNORE_INDEX  # uneven target counts: the weighting matters
        batches.append((x, y))
    return batches


@torch.no_grad()
def _per_batch_on_the_host(model, batches, top_k=None) -> float:
    """The loss as a per-batch loop computes it: one .item() per batch."""
    model.eval()
    model.set_top_k(top_k)
    loss_sum, tokens = 0.0, 0.0
    try:
        for x, y in batches:
            n = (y != IGNORE_INDEX).sum().item()
            if n:
                loss_sum += model(x, targets=y).lm_loss.double().item() * n
                tokens += n
    finally:
        model.set_top_k(None)
        model.train()
    return loss_sum / tokens


@pytest.mark.parametrize("n_batches", [1, 5])
def test_one_host_read_per_run_and_the_per_batch_loss_exactly(model, n_batches):
    batches = _batches(n_batches)
    with HostSyncCounter() as syncs:
        loss = validation_loss(model, batches, CPU, False, DistributedContext())
    assert dict(syncs.events) == {"host_read": 1}
    assert loss == _per_batch_on_the_host(model, batches)
    assert validation_loss(model, batches, CPU, False, DistributedContext(), top_k=2) == \
        _per_batch_on_the_host(model, batches, top_k=2)


def test_a_batch_without_targets_weighs_nothing_and_no_targets_at_all_is_nan(model):
    batches = _batches(2)
    empty = (batches[0][0], torch.full_like(batches[0][1], IGNORE_INDEX))
    ctx = DistributedContext()
    assert validation_loss(model, [batches[0], empty, batches[1]], CPU, False, ctx) == \
        validation_loss(model, batches, CPU, False, ctx)
    assert math.isnan(validation_loss(model, [empty], CPU, False, ctx))
    assert all(layer.router.count_tokens for layer in model.moe_layers()) and model.training
