"""Control-plane wire format: msgpack frames with a schema version, signed with HMAC-SHA256.

A frame travels as two ZeroMQ parts, ``[payload, mac]``; ``FrameCodec`` builds and checks them.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import time
from dataclasses import dataclass
from typing import Any, TypeGuard

import msgpack

from flowtrain.log import get_logger

SCHEMA_VERSION = 1

# A frame bigger than this is refused before it is unpacked; control frames are small, and
# the limit keeps a bug (or a hostile peer holding the secret) from exhausting memory.
MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
# The transport's limit on one message part (ZMQ_MAXMSGSIZE), set on every control socket: a
# bigger part makes libzmq drop the connection while reading its header, before any of it is
# buffered, so an unauthenticated peer cannot grow the process by sending one. The payload is
# the largest part of a legitimate frame (ZeroMQ identities, topics and the MAC are tiny).
MAX_FRAME_BYTES = MAX_PAYLOAD_BYTES + 64 * 1024
# Caps the number of items one array or map header may announce.
MAX_CONTAINER_ITEMS = 1_000_000
MIN_SECRET_BYTES = 16
MAC_BYTES = hashlib.sha256().digest_size

REJECT_REASONS = ("unsigned", "bad_signature", "malformed", "unknown_version", "replayed")
# How far below a sender's highest sequence number a frame may arrive and still be taken once
# (frames can overtake each other when a sender's queue is full); older ones are replays.
REPLAY_WINDOW = 1024


def limit_frames(socket: Any) -> None:
    """Refuses oversized frames on ``socket`` in the transport (see MAX_FRAME_BYTES); call
    before it binds or connects."""
    import zmq

    socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)


def _log() -> Any:
    # Looked up per call: a logger bound at import keeps the logging configuration of that
    # moment and would ignore configure_logging() called later by the rank or the launcher.
    return get_logger("flowtrain.control.protocol")


class Kind:
    """The kinds of control frames (the ``k`` field of a payload)."""

    HELLO = "HELLO"
    WELCOME = "WELCOME"
    HEARTBEAT = "HEARTBEAT"
    BARRIER = "BARRIER"
    BARRIER_RELEASE = "BARRIER_RELEASE"
    KV_SET = "KV_SET"
    KV_GET = "KV_GET"
    KV_VALUE = "KV_VALUE"
    ROUTE = "ROUTE"
    FAILURE = "FAILURE"
    TELEMETRY = "TELEMETRY"
    ABORT = "ABORT"
    BYE = "BYE"
    # --peer-recovery: a rank's vote on committing its step, the coordinator's verdict, and a
    # new membership (generation) of the data-parallel group
    COMMIT = "COMMIT"
    COMMIT_RESULT = "COMMIT_RESULT"
    RECONFIGURE = "RECONFIGURE"
    JOIN = "JOIN"  # a replacement rank is ready to enter the group

    ALL = frozenset(
        {
            HELLO,
            WELCOME,
            HEARTBEAT,
            BARRIER,
            BARRIER_RELEASE,
            KV_SET,
            KV_GET,
            KV_VALUE,
            ROUTE,
            FAILURE,
            TELEMETRY,
            ABORT,
            BYE,
            COMMIT,
            COMMIT_RESULT,
            RECONFIGURE,
            JOIN,
        }
    )


@dataclass(frozen=True)
class Frame:
    """One decoded, verified control frame."""

    kind: str
    sender: str
    seq: int
    body: dict
    version: int


class FrameRejected(Exception):
    """A frame that failed verification or decoding; ``reason`` is one of ``REJECT_REASONS``."""

    def __init__(self, reason: str, detail: str) -> None:
        if reason not in REJECT_REASONS:
            raise ValueError(f"reject reason must be one of {REJECT_REASONS}, got {reason!r}")
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def check_secret(secret: bytes) -> bytes:
    """Returns the secret if it is long enough to sign frames; ValueError otherwise."""
    if not isinstance(secret, (bytes, bytearray)):
        raise ValueError(f"the job secret must be bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the job secret is {len(secret)} bytes long; it must be at least {MIN_SECRET_BYTES} "
            f"bytes (for example secrets.token_bytes(32))"
        )
    return bytes(secret)


def curve_server_keys(secret: bytes) -> tuple[bytes, bytes]:
    """The coordinator's CurveZMQ key pair (public, secret; Z85), derived from the job secret:
    every process that holds the secret knows the server's public key without it being handed
    out, and no one else can act as the server. Clients use a fresh key pair each; the frames
    stay signed with the job secret, which is what authenticates a rank."""
    import zmq
    import zmq.utils.z85

    seed = hmac.new(check_secret(secret), b"flowtrain curve server", hashlib.sha256).digest()
    private = zmq.utils.z85.encode(seed)
    return zmq.curve_public(private), private


def encrypt_server(socket: Any, secret: bytes) -> None:
    """Makes a bound socket a CurveZMQ server: peers that do not encrypt are not accepted."""
    import zmq

    public, private = curve_server_keys(secret)
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    socket.setsockopt(zmq.CURVE_SECRETKEY, private)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, public)


def encrypt_client(socket: Any, secret: bytes) -> None:
    """Makes a connecting socket a CurveZMQ client of the job's server (before connect)."""
    import zmq

    public, private = zmq.curve_keypair()
    socket.setsockopt(zmq.CURVE_SERVERKEY, curve_server_keys(secret)[0])
    socket.setsockopt(zmq.CURVE_PUBLICKEY, public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, private)


def _is_int(value: Any) -> TypeGuard[int]:
    # msgpack gives bools for true/false; a bool is an int to Python but not a valid field here.
    return type(value) is int


class FrameCodec:
    """Encodes frames from one sender and verifies frames from anyone holding the same secret."""

    def __init__(self, secret: bytes, sender: str) -> None:
        self._mac = hmac.new(check_secret(secret), digestmod=hashlib.sha256)
        self.sender = sender
        # Numbered from the wall clock in nanoseconds, not from 1: a sender started again
        # under the same name (a restarted or replacement rank) numbers above everything its
        # predecessor sent, so its frames are new and its predecessor's, replayed, are not.
        # (Hosts' clocks need only agree to within the predecessor's lifetime.)
        self._seq = itertools.count(time.time_ns())
        self._seen = ReplayGuard()

    def _sign(self, payload: bytes) -> bytes:
        # Copying a keyed HMAC skips re-deriving the key pads for every frame.
        mac = self._mac.copy()
        mac.update(payload)
        return mac.digest()

    def encode(self, kind: str, body: dict) -> list[bytes]:
        """Returns the two ZeroMQ parts ``[payload, mac]`` of one frame."""
        if kind not in Kind.ALL:
            raise ValueError(f"unknown frame kind {kind!r}; expected one of {sorted(Kind.ALL)}")
        if not isinstance(body, dict):
            raise TypeError(f"the body of a {kind} frame must be a dict, got {type(body).__name__}")
        message = {
            "v": SCHEMA_VERSION,
            "k": kind,
            "s": self.sender,
            "n": next(self._seq),
            "b": body,
        }
        try:
            payload = msgpack.packb(message, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TypeError(
                f"the body of a {kind} frame cannot be packed with msgpack: {exc}"
            ) from exc
        return [payload, self._sign(payload)]

    def decode(self, parts: list[bytes], origin: str | None = None) -> Frame:
        """Verifies and unpacks ``[payload, mac]``; raises FrameRejected and nothing else.
        ``origin``: the name of the socket it came from, which must be the signed sender (the
        check comes before the replay check, so a frame signed under another sender's name
        cannot move that sender's sequence numbers)."""
        if len(parts) != 2:
            raise FrameRejected("unsigned", f"expected 2 parts [payload, mac], got {len(parts)}")
        payload, mac = bytes(parts[0]), bytes(parts[1])
        if not mac:
            raise FrameRejected("unsigned", "the mac part is empty")
        if len(mac) != MAC_BYTES:
            raise FrameRejected("bad_signature", f"mac is {len(mac)} bytes, expected {MAC_BYTES}")
        if not hmac.compare_digest(mac, self._sign(payload)):
            raise FrameRejected(
                "bad_signature", "mac does not match the payload under this job's secret"
            )
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise FrameRejected(
                "malformed", f"payload is {len(payload)} bytes, limit {MAX_PAYLOAD_BYTES}"
            )
        try:
            message = msgpack.unpackb(
                payload,
                raw=False,
                strict_map_key=False,
                use_list=True,
                max_str_len=MAX_PAYLOAD_BYTES,
                max_bin_len=MAX_PAYLOAD_BYTES,
                max_ext_len=MAX_PAYLOAD_BYTES,
                max_array_len=MAX_CONTAINER_ITEMS,
                max_map_len=MAX_CONTAINER_ITEMS,
            )
        except (
            Exception
        ) as exc:  # msgpack raises several types (ExtraData, ValueError, StackError, ...)
            raise FrameRejected(
                "malformed", f"payload is not one msgpack object: {type(exc).__name__}: {exc}"
            ) from None
        frame = _check_message(message)
        if origin is not None and frame.sender != origin:
            raise FrameRejected(
                "malformed", f"{frame.kind} signed by {frame.sender!r} arrived from socket "
                             f"{origin!r}; both must be the sender's name"
            )
        self._seen.check(frame)
        return frame

    def encode_published(self, topic: str, body: dict) -> list[bytes]:
        """``[topic, payload, mac]`` for a PUB socket; the topic is repeated in the signed body."""
        return [topic.encode(), *self.encode(Kind.TELEMETRY, body)]

    def decode_published(self, parts: list[bytes]) -> Frame:
        """Verifies ``[topic, payload, mac]`` from a SUB socket; the topic must match the body's."""
        if len(parts) != 3:
            raise FrameRejected(
                "unsigned", f"expected 3 parts [topic, payload, mac], got {len(parts)}"
            )
        frame = self.decode(parts[1:])
        try:
            topic = bytes(parts[0]).decode()
        except UnicodeDecodeError:
            raise FrameRejected("malformed", "the topic part is not UTF-8") from None
        if frame.kind != Kind.TELEMETRY or frame.body.get("topic") != topic:
            raise FrameRejected(
                "malformed",
                f"published frame of kind {frame.kind} carries topic {frame.body.get('topic')!r} "
                f"but was sent under topic {topic!r}",
            )
        return frame


class ReplayGuard:
    """Takes each (sender, sequence number) once: a frame at or below a sender's highest
    number that was already seen, or more than ``REPLAY_WINDOW`` below it, is a replay (a
    captured frame sent again, which its valid signature alone would let through)."""

    def __init__(self) -> None:
        self._highest: dict[str, int] = {}
        self._recent: dict[str, set[int]] = {}  # numbers seen within the window

    def check(self, frame: Frame) -> None:
        """Records ``frame``'s number; FrameRejected("replayed") if it was taken before."""
        sender, seq = frame.sender, frame.seq
        highest = self._highest.get(sender)
        recent = self._recent.setdefault(sender, set())
        if highest is not None and seq <= highest:
            if seq <= highest - REPLAY_WINDOW or seq in recent:
                raise FrameRejected(
                    "replayed",
                    f"{frame.kind} from {sender!r} numbered {seq} was already received (or is "
                    f"older than the last {REPLAY_WINDOW} of its frames); a captured frame "
                    f"sent again",
                )
        else:
            self._highest[sender] = highest = seq
        recent.add(seq)
        if len(recent) > 2 * REPLAY_WINDOW:  # amortised: the set stays within 2 windows
            self._recent[sender] = {n for n in recent if n > highest - REPLAY_WINDOW}


def _check_message(message: Any) -> Frame:
    if not isinstance(message, dict):
        raise FrameRejected("malformed", f"payload is a {type(message).__name__}, expected a map")
    version = message.get("v")
    if not _is_int(version):
        raise FrameRejected(
            "malformed", f"field 'v' (schema version) is {version!r}, expected an int"
        )
    # A newer schema may change the other fields, so the version is judged before them.
    if version != SCHEMA_VERSION:
        raise FrameRejected(
            "unknown_version", f"schema version {version}, this side speaks {SCHEMA_VERSION}"
        )
    kind, sender, seq, body = message.get("k"), message.get("s"), message.get("n"), message.get("b")
    if not isinstance(kind, str) or kind not in Kind.ALL:
        raise FrameRejected(
            "malformed", f"field 'k' (kind) is {kind!r}, expected one of {sorted(Kind.ALL)}"
        )
    if not isinstance(sender, str):
        raise FrameRejected("malformed", f"field 's' (sender) is {sender!r}, expected a str")
    if not _is_int(seq):
        raise FrameRejected("malformed", f"field 'n' (sequence) is {seq!r}, expected an int")
    if not isinstance(body, dict):
        raise FrameRejected(
            "malformed", f"field 'b' (body) is a {type(body).__name__}, expected a map"
        )
    if len(message) != 5:
        extra = sorted(str(key) for key in message if key not in ("v", "k", "s", "n", "b"))
        raise FrameRejected(
            "malformed", f"unexpected fields {extra}; a frame has exactly v, k, s, n, b"
        )
    return Frame(kind=kind, sender=sender, seq=seq, body=body, version=version)


class RejectCounter:
    """Counts rejected frames per reason and logs them without letting a flood drown the log."""

    # The first few of each reason are logged, then one in LOG_EVERY.
    LOG_FIRST = 10
    LOG_EVERY = 100

    def __init__(self, owner: str = "") -> None:
        self.owner = owner
        self.counts: dict[str, int] = {reason: 0 for reason in REJECT_REASONS}

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def record(self, reason: str, detail: str, peer: object) -> None:
        """Counts one rejected frame; never raises, whatever it is given."""
        try:
            count = self.counts.get(reason, 0) + 1
            self.counts[reason] = count
            if count <= self.LOG_FIRST or count % self.LOG_EVERY == 0:
                if isinstance(peer, (bytes, bytearray)):
                    peer = bytes(peer).decode("utf-8", "backslashreplace")
                _log().warning(
                    "control frame rejected",
                    owner=self.owner,
                    peer=str(peer),
                    reason=reason,
                    detail=str(detail)[:300],
                    count=count,
                )
        except Exception:  # a broken logger must not take the control plane down
            pass

    def record_rejection(self, error: FrameRejected, peer: object) -> None:
        self.record(error.reason, error.detail, peer)


def check_heartbeat(interval: float, misses: int) -> None:
    """Both ends of the control plane validate their heartbeat settings the same way."""
    if interval <= 0:
        raise ValueError(f"heartbeat_interval must be > 0 seconds, got {interval}")
    if misses < 1:
        raise ValueError(f"heartbeat_misses must be at least 1, got {misses}")
