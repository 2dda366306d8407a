"""Tests of the control-plane wire format: signing, decoding, each rejection reason, the counter."""

from __future__ import annotations

import hashlib
import hmac

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowtrain.control.protocol import (
    MAC_BYTES,
    REJECT_REASONS,
    REPLAY_WINDOW,
    SCHEMA_VERSION,
    Frame,
    FrameCodec,
    FrameRejected,
    Kind,
    RejectCounter,
)

SECRET = b"0123456789abcdef-test-secret"


def sign(payload: bytes, secret: bytes = SECRET) -> bytes:
    return hmac.new(secret, payload, hashlib.sha256).digest()


def signed(message: object) -> list[bytes]:
    payload = msgpack.packb(message, use_bin_type=True)
    return [payload, sign(payload)]


def reason_of(parts: list[bytes]) -> str:
    with pytest.raises(FrameRejected) as caught:
        FrameCodec(SECRET, "reader").decode(parts)
    return caught.value.reason


def test_round_trip_keeps_every_field_and_counts_sequence() -> None:
    writer = FrameCodec(SECRET, "rank3")
    reader = FrameCodec(SECRET, "coordinator")
    body = {"name": "epoch", "blob": b"\x00\xff", "nested": {"x": [1, 2.5, None]}}
    first = writer.encode(Kind.BARRIER, body)
    second = writer.encode(Kind.HEARTBEAT, {})
    assert len(first) == 2 and len(first[1]) == MAC_BYTES
    start = msgpack.unpackb(first[0])["n"]
    assert reader.decode(first) == Frame(
        kind="BARRIER", sender="rank3", seq=start, body=body, version=SCHEMA_VERSION
    )
    assert reader.decode(second).seq == start + 1
    assert msgpack.unpackb(first[0]) == {"v": 1, "k": "BARRIER", "s": "rank3", "n": start,
                                         "b": body}
    assert first[1] == sign(first[0])


def test_published_frame_carries_topic_and_verifies() -> None:
    codec = FrameCodec(SECRET, "coordinator")
    parts = codec.encode_published(
        "metrics", {"topic": "metrics", "rank": 0, "body": {"loss": 1.5}}
    )
    assert parts[0] == b"metrics"
    frame = FrameCodec(SECRET, "tui").decode_published(parts)
    assert frame.body == {"topic": "metrics", "rank": 0, "body": {"loss": 1.5}}
    with pytest.raises(FrameRejected) as caught:
        FrameCodec(SECRET, "tui").decode_published([b"other", *parts[1:]])
    assert caught.value.reason == "malformed"


def test_secret_shorter_than_16_bytes_is_refused_with_its_length() -> None:
    with pytest.raises(ValueError, match="15 bytes"):
        FrameCodec(b"x" * 15, "rank0")
    FrameCodec(b"x" * 16, "rank0")


def test_unknown_kind_and_unpackable_body_are_refused_at_encode() -> None:
    codec = FrameCodec(SECRET, "rank0")
    with pytest.raises(ValueError, match="NOPE"):
        codec.encode("NOPE", {})
    with pytest.raises(TypeError, match="KV_SET"):
        codec.encode(Kind.KV_SET, {"value": object()})


def test_one_part_frame_is_unsigned() -> None:
    assert reason_of([FrameCodec(SECRET, "a").encode(Kind.BYE, {})[0]]) == "unsigned"


def test_three_part_frame_is_unsigned() -> None:
    assert reason_of([*FrameCodec(SECRET, "a").encode(Kind.BYE, {}), b"x"]) == "unsigned"


def test_empty_mac_is_unsigned() -> None:
    assert reason_of([b"garbage", b""]) == "unsigned"


def test_garbage_signed_is_malformed_and_unsigned_garbage_is_bad_signature() -> None:
    garbage = b"\xc1\xc1 not msgpack at all"
    assert reason_of([garbage, sign(garbage)]) == "malformed"
    assert reason_of([garbage, b"\x00" * MAC_BYTES]) == "bad_signature"


def test_wrong_secret_is_bad_signature() -> None:
    parts = FrameCodec(b"another-secret-of-enough-length", "a").encode(Kind.BYE, {})
    assert reason_of(parts) == "bad_signature"


def test_mac_of_wrong_length_is_bad_signature() -> None:
    payload, mac = FrameCodec(SECRET, "a").encode(Kind.BYE, {})
    assert reason_of([payload, mac[:-1]]) == "bad_signature"
    assert reason_of([payload, mac + b"\x00"]) == "bad_signature"


def test_flipped_payload_bit_is_bad_signature() -> None:
    payload, mac = FrameCodec(SECRET, "a").encode(Kind.BYE, {})
    tampered = bytes([payload[0] ^ 1]) + payload[1:]
    assert reason_of([tampered, mac]) == "bad_signature"


def test_truncated_msgpack_correctly_signed_is_malformed() -> None:
    payload, _ = FrameCodec(SECRET, "a").encode(Kind.KV_SET, {"key": "k", "value": "v" * 50})
    truncated = payload[:-10]
    assert reason_of([truncated, sign(truncated)]) == "malformed"


def test_extra_data_after_the_object_is_malformed() -> None:
    payload, _ = FrameCodec(SECRET, "a").encode(Kind.BYE, {})
    doubled = payload + payload
    assert reason_of([doubled, sign(doubled)]) == "malformed"


def test_unknown_version_correctly_signed() -> None:
    parts = signed({"v": SCHEMA_VERSION + 1, "k": "BYE", "s": "a", "n": 1, "b": {}})
    assert reason_of(parts) == "unknown_version"


@pytest.mark.parametrize(
    "message",
    [
        [1, 2, 3],
        "a string",
        42,
        {"k": "BYE", "s": "a", "n": 1, "b": {}},  # no version
        {"v": True, "k": "BYE", "s": "a", "n": 1, "b": {}},  # bool is not a version
        {"v": 1, "k": "NOPE", "s": "a", "n": 1, "b": {}},
        {"v": 1, "k": "BYE", "s": 5, "n": 1, "b": {}},
        {"v": 1, "k": "BYE", "s": "a", "n": "1", "b": {}},
        {"v": 1, "k": "BYE", "s": "a", "n": 1, "b": [1]},
        {"v": 1, "k": "BYE", "s": "a", "n": 1, "b": {}, "extra": 1},
        {1: 1, (2,): 2},
    ],
)
def test_wrong_shapes_correctly_signed_are_malformed(message: object) -> None:
    assert reason_of(signed(message)) == "malformed"


def test_unhashable_map_key_correctly_signed_is_malformed() -> None:
    # A map whose key is itself a map: msgpack cannot build the dict (unhashable key).
    payload = b"\x81\x81\x01\x02\x03"
    assert reason_of([payload, sign(payload)]) == "malformed"


def test_deep_nesting_correctly_signed_is_malformed() -> None:
    payload = b"\x91" * 100_000 + b"\xc0"
    assert reason_of([payload, sign(payload)]) == "malformed"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_arbitrary_parts_raise_only_frame_rejected(parts: list[bytes]) -> None:
    try:
        FrameCodec(SECRET, "reader").decode(parts)
    except FrameRejected as rejection:
        assert rejection.reason in REJECT_REASONS


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_arbitrary_payload_correctly_signed_raises_only_frame_rejected(payload: bytes) -> None:
    try:
        frame = FrameCodec(SECRET, "reader").decode([payload, sign(payload)])
    except FrameRejected as rejection:
        assert rejection.reason in ("malformed", "unknown_version")
    else:
        assert frame.version == SCHEMA_VERSION and frame.kind in Kind.ALL


def test_counter_counts_each_reason_and_never_raises() -> None:
    counter = RejectCounter("test")
    for _ in range(3):
        counter.record("malformed", "bad", b"rank0")
    counter.record("unsigned", "x", "rank1")
    for _ in range(250):
        counter.record("bad_signature", "flood", b"\xff\xfe")
    counter.record("not_a_reason", object(), object())
    assert counter.counts == {
        "unsigned": 1,
        "bad_signature": 250,
        "malformed": 3,
        "unknown_version": 0,
        "replayed": 0,
        "not_a_reason": 1,
    }
    assert counter.total == 255


def test_counter_logs_first_ten_then_every_hundredth(monkeypatch: pytest.MonkeyPatch) -> None:
    import flowtrain.control.protocol as protocol

    logged: list[int] = []

    class Recorder:
        def warning(self, event: str, **fields: object) -> None:
            logged.append(int(fields["count"]))  # type: ignore[call-overload]

    monkeypatch.setattr(protocol, "_log", Recorder)
    counter = RejectCounter("test")
    for _ in range(300):
        counter.record("malformed", "x", "peer")
    assert logged == [*range(1, 11), 100, 200, 300]


# ------------------------------------------------------------------------------------ replays


def test_a_replayed_frame_is_rejected_and_counted() -> None:
    writer = FrameCodec(SECRET, "rank1")
    reader = FrameCodec(SECRET, "coordinator")
    hello = writer.encode(Kind.HELLO, {"rank": 1})
    beat = writer.encode(Kind.HEARTBEAT, {})
    assert reader.decode(hello).kind == "HELLO"
    assert reader.decode(beat).kind == "HEARTBEAT"
    counter = RejectCounter("test")
    for captured in (hello, beat, hello):  # the same signed bytes, sent again
        with pytest.raises(FrameRejected) as caught:
            reader.decode(captured)
        assert caught.value.reason == "replayed"
        assert "already received" in caught.value.detail
        counter.record_rejection(caught.value, b"rank1")
    assert counter.counts["replayed"] == 3
    assert reader.decode(writer.encode(Kind.BYE, {})).kind == "BYE"  # new frames still pass


def test_frames_that_overtook_each_other_pass_once_within_the_window() -> None:
    writer = FrameCodec(SECRET, "rank0")
    reader = FrameCodec(SECRET, "coordinator")
    frames = [writer.encode(Kind.HEARTBEAT, {"i": i}) for i in range(5)]
    for i in (0, 3, 1, 2, 4):  # out of order, as a full send queue can deliver them
        assert reader.decode(frames[i]).body == {"i": i}
    with pytest.raises(FrameRejected, match="replayed"):
        reader.decode(frames[1])
    old = frames[0]
    for _ in range(REPLAY_WINDOW + 1):
        reader.decode(writer.encode(Kind.HEARTBEAT, {}))
    with pytest.raises(FrameRejected, match="older than the last 1024"):
        reader.decode(old)


def test_a_restarted_sender_numbers_above_its_predecessor() -> None:
    reader = FrameCodec(SECRET, "coordinator")
    before = FrameCodec(SECRET, "rank2")
    captured = before.encode(Kind.HELLO, {"rank": 2})
    reader.decode(captured)
    for _ in range(100):
        reader.decode(before.encode(Kind.HEARTBEAT, {}))
    after = FrameCodec(SECRET, "rank2")  # the same rank, started again
    assert reader.decode(after.encode(Kind.HELLO, {"rank": 2})).kind == "HELLO"
    with pytest.raises(FrameRejected, match="replayed"):
        reader.decode(captured)
