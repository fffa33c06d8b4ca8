"""Message types: validation, JSON round trip, and untrusted input never crashes oddly."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.protocol.errors import LocalProtocolError, RemoteProtocolError
from agent.protocol.messages import (
    MESSAGE_TYPES,
    DataBatch,
    Deletion,
    DeletionAck,
    Duplication,
    DuplicationAck,
    Start,
    from_dict,
    from_json,
)

SAMPLES = [
    Duplication("a", 1, 3, ("b", "c")),
    DuplicationAck("x", 2, 3),
    Start("a", 1, ("s1", "s2"), ("p1",)),
    Deletion("a", 1, 7),
    DeletionAck("p1", 0, 7),
    DataBatch("a", 1, 12, 100),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.type)
def test_round_trip_through_json(msg):
    assert from_json(msg.to_json()) == msg
    assert from_dict(json.loads(json.dumps(msg.to_dict()))) == msg


def test_every_type_has_a_sample():
    assert {m.type for m in SAMPLES} == set(MESSAGE_TYPES)


@pytest.mark.parametrize(
    "build",
    [
        lambda: Duplication("a", 1, 0, ()),  # announces nobody
        lambda: Duplication("a", 1, 0, ("a",)),  # announces itself
        lambda: Duplication("a", 1, 0, ("b", "b")),
        lambda: Deletion("", 1, 0),
        lambda: Deletion("a", -1, 0),
        lambda: Deletion("a", True, 0),
        lambda: Start("a", 1, ["b"], ()),  # lists are not accepted by the constructor
    ],
)
def test_constructor_rejects_bad_fields(build):
    with pytest.raises(LocalProtocolError):
        build()


@pytest.mark.parametrize(
    "raw",
    [b"\xff\xfe", "not json", "[]", "null", "{}", '{"type": "nope"}', '{"type": ["start"]}',
     '{"type": "deletion", "sender": "a", "stage": 1}',
     '{"type": "deletion", "sender": "a", "stage": 1, "round": 1, "extra": 2}',
     '{"type": "deletion", "sender": "a", "stage": "1", "round": 1}',
     '{"type": "start", "sender": "a", "stage": 1, "succs": "ab", "preds": []}',
     '{"type": "start", "sender": "a", "stage": 1, "succs": [{}], "preds": []}',
     '[' * 100000],
)
def test_garbage_raises_remote_protocol_error(raw):
    with pytest.raises(RemoteProtocolError):
        from_json(raw)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(sorted(MESSAGE_TYPES) + ["x"]),
    body=st.dictionaries(
        st.sampled_from(["sender", "stage", "round", "new_instances", "succs", "preds", "seq", "count", "z"]),
        json_values,
    ),
)
def test_arbitrary_dicts_only_raise_remote_protocol_error(kind, body):
    data = dict(body, type=kind)
    try:
        msg = from_dict(data)
    except RemoteProtocolError:
        return
    assert from_dict(msg.to_dict()) == msg
