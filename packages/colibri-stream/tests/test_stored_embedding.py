"""The embedding held as stored: the same logits, bit for bit, as the materialised table, in
every encoding and engine dtype, mapped from the container and so outside the budget."""

import numpy as np
import pytest
import torch
from colibri_int4 import Container, QuantScheme
from colibri_stream import Engine
from colibri_stream.stored_embedding import StoredEmbedding
from torch import nn

from .conftest import build_container

IDS = [[5, 17, 5, 300, 0, 511, 17, 42]]  # a repeat, the first and the last row


@pytest.mark.parametrize("embed_dtype", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_logits_equal_the_materialised_embedding_bit_for_bit(tmp_path, embed_dtype, dtype):
    scheme = QuantScheme(group_size=32, resident_dtype="int8", embed_dtype=embed_dtype)
    container, _ = build_container(tmp_path, scheme, vocab_size=512)
    with Container.open(container) as c:
        raw = next(r for r in c.iter_resident() if r.name == "embed.weight")
        table = torch.from_numpy(raw.dequantize())
    with Engine.open(container, ram_budget="1GB", dtype=dtype) as eng:
        assert isinstance(eng.model.embed, StoredEmbedding)
        assert eng.model.embed.raw.encoding == {"int4": "q4", "int8": "q8"}.get(embed_dtype, embed_dtype)
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


def test_a_tied_embedding_stays_materialised(tmp_path):
    container, _ = build_container(tmp_path, QuantScheme(group_size=32), tie_embeddings=True)
    with Engine.open(container, ram_budget="1GB") as eng:
        assert isinstance(eng.model.embed, nn.Embedding)


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
