"""Client events are bounded in nesting before any parse: deep JSON is a client error, never a RecursionError."""

from __future__ import annotations

import json

import pytest

from metronome.serving.protocol import MAX_NESTING, ProtocolError, decode_client_event, nesting_within


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_nesting_is_measured_outside_strings_and_bounded():
    assert nesting_within(nested(MAX_NESTING)) and not nesting_within(nested(2 * MAX_NESTING + 1))
    # Brackets inside strings (escaped quotes and backslashes included) do not count.
    text = json.dumps({"type": "x", "text": '[[[[ \\" ]]' * 1000 + "\\" + "{" * 500}).encode()
    assert nesting_within(text)
    assert not nesting_within(b"[" * 100_000)          # unbalanced: refused too
    assert not nesting_within(b"[}" * 40)               # mismatched


@pytest.mark.parametrize("payload", [nested(100_000), b'{"type": "conversation.item.create", "item": '
                                     + b'{"a": ' * 5000 + b"1" + b"}" * 5001])
def test_deep_json_is_a_client_error(payload):
    with pytest.raises(ProtocolError) as refused:
        decode_client_event(payload)
    assert refused.value.code == "nested_too_deep"


def test_ordinary_events_still_decode():
    event = decode_client_event(json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "[[[" * 50}]}}))
    assert event.text() == "[[[" * 50
    with pytest.raises(ProtocolError) as refused:
        decode_client_event(b'{"type": [1]}')
    assert refused.value.code == "invalid_event"
