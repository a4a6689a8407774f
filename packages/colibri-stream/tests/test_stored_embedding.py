"""The embedding held as stored: the same logits, bit for bit, as the materialised table, in
every encoding and engine dtype, mapped from the container and so outside the budget."""

import numpy as np
import pytest
import torch
from colibri_int4 import Container, QuantScheme
from colibri_stream import Engine
from colibri_stream.compute.native_linear import NativeLinear
from colibri_stream.sizes import aligned
from colibri_stream.stored_embedding import StoredEmbedding
from torch import nn

from .conftest import build_container

IDS = [[5, 17, 5, 300, 0, 511, 17, 42]]  # a repeat, the first and the last row


@pytest.mark.parametrize("embed_dtype", ["bf16", "int8", "int6", "int4"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_logits_equal_the_materialised_embedding_bit_for_bit(tmp_path, embed_dtype, dtype):
    scheme = QuantScheme(group_size=32, resident_dtype="int8", embed_dtype=embed_dtype)
    container, _ = build_container(tmp_path, scheme, vocab_size=512)
    with Container.open(container) as c:
        raw = next(r for r in c.iter_resident() if r.name == "embed.weight")
        table = torch.from_numpy(raw.dequantize())
    with Engine.open(container, ram_budget="1GB", dtype=dtype) as eng:
        assert isinstance(eng.model.embed, StoredEmbedding)
        assert eng.model.embed.raw.encoding == {"int4": "q4", "int6": "q6", "int8": "q8"}.get(embed_dtype, embed_dtype)
        ids = torch.tensor(IDS)
        stored = eng.model(ids).logits
        held = eng.runner.dtype
        eng.model.embed = nn.Embedding.from_pretrained(table.to(held))
        materialised = eng.model(ids).logits
    assert torch.equal(stored, materialised)


def test_the_table_is_mapped_from_the_container_and_left_out_of_the_budget(tmp_path):
    container, _ = build_container(tmp_path, QuantScheme(group_size=32, embed_dtype="int8"), vocab_size=512)
    plan = Engine.plan(container, dtype="f32")
    with Container.open(container) as c:
        entry = next(t for t in c.header.tensors if t.name == "embed.weight")
    assert plan.footprint.mapped_bytes == entry.length and plan.to_dict()["mapped_bytes"] == entry.length
    with Engine.open(container, ram_budget=plan.full_budget, dtype="f32") as eng:
        held = eng.model.embed
        assert not held.raw.data.flags.writeable  # views of the read-only map, no copy
        assert not list(held.buffers())
        assert eng.stats.resident_bytes <= eng.budget.resident_bytes
        logits = eng.model(torch.tensor(IDS)).logits
    assert torch.isfinite(logits).all()


def test_a_tied_embedding_stays_materialised_off_the_native_kernel(tmp_path):
    container, _ = build_container(tmp_path, QuantScheme(group_size=32), tie_embeddings=True)
    with Engine.open(container, ram_budget="1GB", compute="dequant") as eng:
        assert isinstance(eng.model.embed, nn.Embedding) and eng.model.lm_head is None


@pytest.mark.parametrize(("embed_dtype", "encoding"), [("int8", "q8"), ("int6", "q6")])
def test_a_native_engine_holds_a_tied_head_as_stored_and_maps_the_table(tmp_path, embed_dtype, encoding):
    """The head reads the stored int8 or int6 table (one copy, in the arena), the lookups the file's
    map; its logits are the materialised tied head's to the activations' int8 rounding."""
    container, _ = build_container(tmp_path, QuantScheme(group_size=32, embed_dtype=embed_dtype),
                                   tie_embeddings=True, vocab_size=512)
    with Container.open(container) as c:
        entry = next(t for t in c.header.tensors if t.name == "embed.weight")
        table = torch.from_numpy(next(r for r in c.iter_resident() if r.name == "embed.weight").dequantize())
    plan = Engine.plan(container, dtype="f32", compute="native")
    assert plan.footprint.mapped_bytes == entry.length
    assert plan.footprint.resident_by_dtype[encoding] >= aligned(entry.length)  # the head (and projections)
    with Engine.open(container, ram_budget=plan.full_budget, dtype="f32", compute="native") as eng:
        assert isinstance(eng.model.embed, StoredEmbedding)
        assert isinstance(eng.model.lm_head, NativeLinear) and eng.model.lm_head.encoding == encoding
        assert eng.stats.resident_bytes <= eng.budget.resident_bytes
        ids = torch.tensor(IDS)
        stored = eng.model(ids).logits
        eng.model.embed, eng.model.lm_head = nn.Embedding.from_pretrained(table), None  # the tied f32 head
        materialised = eng.model(ids).logits
    stored, materialised = stored.detach(), materialised.detach()
    scale = float(materialised.abs().max())
    assert float((stored - materialised).abs().max()) < 0.02 * scale  # (near ties may flip: no argmax check)


def test_an_untied_int6_head_runs_on_the_native_kernel_near_the_dequantized_route(tmp_path):
    """A 6-bit head (`embed_dtype="int6"`) is held as stored, counted exactly by the plan, and gives
    the dequantized route's logits to the activations' int8 rounding, prefill and decode alike."""
    container, _ = build_container(tmp_path, QuantScheme(group_size=32, embed_dtype="int6"), vocab_size=512)
    with Container.open(container) as c:
        head = next(t for t in c.header.tensors if t.name == "lm_head.weight")
    assert head.encoding == "q6"
    plan = Engine.plan(container, dtype="f32", compute="native")
    assert plan.footprint.resident_by_dtype["q6"] == aligned(head.length)  # the head alone is q6
    with Engine.open(container, ram_budget=plan.full_budget, dtype="f32", compute="native") as eng:
        assert isinstance(eng.model.lm_head, NativeLinear) and eng.model.lm_head.encoding == "q6"
        assert eng.stats.resident_bytes == sum(eng.opened_plan.footprint.resident_by_dtype.values())
        native = eng.logits(IDS[0]).detach()
        step = eng.session()
        step.append(IDS[0][:-1])
        decoded = step.append(IDS[0][-1:])  # the one-token decode path
    with Engine.open(container, ram_budget="1GB", dtype="f32", compute="dequant") as eng:
        reference = eng.logits(IDS[0]).detach()
    scale = float(reference.abs().max())
    assert float((native - reference).abs().max()) < 0.02 * scale
    assert float((torch.as_tensor(decoded).reshape(-1) - reference[-1]).abs().max()) < 0.02 * scale


def test_an_id_past_the_vocabulary_is_an_index_error_naming_the_rows(tmp_path):
    container, _ = build_container(tmp_path, QuantScheme(group_size=32), vocab_size=512)
    with Engine.open(container, ram_budget="1GB") as eng:
        with pytest.raises(IndexError, match="512 rows"):
            eng.model.embed(torch.tensor([[3, 512]]))


def test_take_gives_each_row_what_the_whole_dequantization_gives(tmp_path):
    container, _ = build_container(tmp_path, QuantScheme(group_size=32, embed_dtype="int4"), vocab_size=512)
    with Container.open(container) as c:
        raw = next(r for r in c.iter_resident() if r.name == "embed.weight")
        whole = raw.dequantize()
        picked = raw.take(np.array([7, 7, 0, 511]))
    assert picked.shape == (4, raw.shape[1])
    assert np.array_equal(picked.dequantize(), whole[[7, 7, 0, 511]])
