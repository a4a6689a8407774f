"""`write_synthetic_container`: a container that passes every reader check, with random weights."""

from __future__ import annotations

import numpy as np
import pytest
from colibri_int4 import SYNTHETIC_SCHEME, Container, ContainerError, QuantScheme, write_synthetic_container


def test_synthetic_container_is_valid_and_deterministic(tmp_path, make_config):
    config = make_config(a_field_colibri_int4_does_not_know=1)
    path = write_synthetic_container(tmp_path / "a.coli", config, seed=3)
    with Container.open(path) as c:
        assert c.config == config  # carried verbatim, like an export's
        assert c.scheme == SYNTHETIC_SCHEME
        assert c.verify().failures == []  # every tensor and blob CRC
        assert len(c.header.experts.entries) == 2 * config["n_experts"]
        weights = c.read_resident()
        assert np.all(weights["norm.weight"] == 1) and np.all(weights["layers.1.moe.router.expert_bias"] == 0)
        embed = weights["embed.weight"]
        assert np.isfinite(embed).all() and 0.005 < embed.std() < 0.1
        experts = [c.read_expert(layer, e) for layer, e in ((1, 0), (1, 1), (2, 3))]
        assert all(np.isfinite(x["down"]).all() for x in experts)
        assert not np.array_equal(experts[0]["gate"], experts[1]["gate"])  # fresh nibbles per expert
    again = write_synthetic_container(tmp_path / "b.coli", config, seed=3)
    other = write_synthetic_container(tmp_path / "c.coli", config, seed=4)
    assert again.read_bytes() == path.read_bytes() != other.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.coli", "b.coli", "c.coli"]  # no .tmp left


def test_other_schemes_and_shapes(tmp_path, make_config):
    scheme = QuantScheme(group_size=32, symmetric=False, resident_dtype="bf16")
    config = make_config(tie_embeddings=True, qk_norm=False, n_experts=3)
    with Container.open(write_synthetic_container(tmp_path / "x.coli", config, scheme)) as c:
        assert c.verify().ok and "lm_head.weight" not in c.read_resident()


def test_bad_shape_field_is_refused_and_leaves_no_file(tmp_path, make_config):
    with pytest.raises(ContainerError, match="d_model"):
        write_synthetic_container(tmp_path / "x.coli", make_config(d_model=0))
    assert list(tmp_path.iterdir()) == []
