"""Hypothesis fuzzing: mutated bytes anywhere and mutated header fields (with valid CRCs).

The property: opening and reading everything either raises `ContainerError` or returns
exactly the weights of the intact file (a flip in unchecked zero padding is harmless). Any
other exception (IndexError, MemoryError, ValueError from numpy, ...) fails the test.
"""

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from colibri_int4 import Container, ContainerError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), database=None)


def read_everything(path: Path) -> dict:
    with Container.open(path) as c:
        out = dict(c.read_resident())
        out["tokenizer"] = c.read_tokenizer_json()
        buf = np.empty(c.blob_length, dtype=np.uint8)
        for e in c.header.experts.entries:
            for part, array in c.read_expert_into(e.layer, e.expert, buf).dequantize().items():
                out[f"{e.layer}.{e.expert}.{part}"] = array
        if not c.verify().ok:
            raise ContainerError("verify failed")
    return out


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k] for k in a)


@pytest.fixture(scope="module")
def corpus(tiny_container, tmp_path_factory):
    path = tiny_container[0]
    data = path.read_bytes()
    (json_length,) = struct.unpack_from("<Q", data, 16)
    header = json.loads(data[32 : 32 + json_length])
    leaves = []

    def walk(node, trail):
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, trail + [key])
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, trail + [i])
        else:
            leaves.append(trail)

    walk(header, [])
    workdir = tmp_path_factory.mktemp("fuzz")
    return data, 32 + json_length, read_everything(path), leaves, workdir


def outcome_is_safe(path: Path, reference: dict) -> None:
    try:
        result = read_everything(path)
    except ContainerError:
        return
    assert same(result, reference), "a mutated container was read without error but gave different weights"


@SETTINGS
@given(data=st.data())
def test_fuzz_mutated_bytes(corpus, data):
    original, header_end, reference, _, workdir = corpus
    size = len(original)
    in_header = st.integers(0, header_end - 1)
    anywhere = st.integers(0, size - 1)
    flips = data.draw(st.lists(st.tuples(st.one_of(in_header, anywhere), st.integers(1, 255)), min_size=1, max_size=4))
    mutated = bytearray(original)
    for position, xor in flips:
        mutated[position] ^= xor
    if data.draw(st.booleans()):
        mutated = mutated[: data.draw(st.integers(0, size - 1))]
    path = workdir / "bytes.coli"
    path.write_bytes(bytes(mutated))
    outcome_is_safe(path, reference)


_HOSTILE_NUMBERS = st.one_of(
    st.integers(-(2**64), 2**64),
    st.sampled_from([0, 1, -1, 4096, 4095, 2**31, 2**32, 2**53, 2**62, 2**63 - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
)
_HOSTILE_VALUES = st.one_of(_HOSTILE_NUMBERS, st.none(), st.booleans(), st.text(max_size=8),
                            st.lists(st.integers(-5, 5), max_size=3), st.just({}))


@SETTINGS
@given(data=st.data())
def test_fuzz_mutated_header_fields(corpus, data, hostile):
    original, _, reference, leaves, workdir = corpus
    edits = data.draw(st.lists(st.tuples(st.sampled_from(leaves), _HOSTILE_VALUES), min_size=1, max_size=3))
    near_size = data.draw(st.booleans())

    def mutate(header):
        for trail, value in edits:
            node = header
            for key in trail[:-1]:
                node = node[key]
            if near_size and isinstance(value, int) and not isinstance(value, bool):
                value = len(original) - abs(value) % 8192  # offsets/lengths right at the end of the file
            node[trail[-1]] = value

    path = workdir / "header.coli"
    try:
        mutated = hostile(original, mutate)
    except ValueError:  # json.dumps refuses nothing here, but NaN-free JSON is not required
        return
    path.write_bytes(mutated)
    outcome_is_safe(path, reference)
