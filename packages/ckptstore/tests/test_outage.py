"""A store that stops answering (issue 30, "Storage"): StoreUnreachableError tells "the store did
not answer" apart from every other failure (a real moto_server behind a proxy that is cut and
restored), nothing committed is lost or judged broken meanwhile, and Outage -- the policy a
training loop follows through it -- retries with a doubling pause and says when it began and
ended (fake clocks)."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ckpt_helpers import s3server

from ckptstore import (
    CheckpointError,
    CheckpointStore,
    Outage,
    StoreUnreachableError,
    unreachable,
)
from ckptstore.errors import disk_error


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def outage(clock: Clock, **kw: Any) -> Outage:
    kw.setdefault("jitter", 0.0)
    return Outage(clock=clock, wall=lambda: 1_800_000_000.0 + clock.now, **kw)


def test_the_first_failure_is_said_once_and_the_return_once(clock: Clock) -> None:
    o = outage(clock)
    assert not o.active and not o.due() and o.saved(5) is None
    refused = StoreUnreachableError("the store did not answer at s3://b/x")
    refused.__cause__ = ConnectionRefusedError(111, "Connect call failed")
    line = o.failed(20, refused, seconds=4.0)
    assert line is not None and line.startswith("store unreachable since 20")
    assert "(saving step 20: ConnectionRefusedError: [Errno 111] Connect call failed)" in line
    assert line.endswith("; training on, saving when it is back")
    assert o.failed(30, refused) is None  # said once per outage
    clock.now += 26
    assert (
        o.saved(40)
        == "store back: saved step 40 (30 s after it stopped answering, 2 save(s) failed meanwhile)"
    )
    assert not o.active and o.saved(50) is None


def test_retries_come_after_a_doubling_pause(clock: Clock) -> None:
    o = outage(clock, first_pause_s=5, max_pause_s=30)
    pauses = []
    for _ in range(5):
        o.failed(1, StoreUnreachableError("x"))
        pauses.append(o.pause())
        clock.now += o.pause() - 0.1
        assert not o.due()
        clock.now += 0.1
        assert o.due()
    assert pauses == [5, 10, 20, 30, 30]


def test_a_final_save_is_retried_while_a_try_fits(clock: Clock) -> None:
    o = outage(clock, first_pause_s=5, final_limit_s=60)
    o.failed(9, StoreUnreachableError("x"), seconds=8.0)
    assert o.final_pause(time_left=13.0) == 5.0  # pause 5 + a try of 8 fit in 13 s
    assert o.final_pause(time_left=12.9) is None
    clock.now += 5
    assert o.final_pause(time_left=8.0) == 0.0
    assert o.final_pause(time_left=None) == 0.0  # no deadline: up to final_limit_s
    clock.now += 45
    assert o.final_pause(time_left=None) is None  # 5 + 45 + a try of 8 > 60
    line = o.gave_up(9, durable=5)
    assert (
        "is still unreachable (since" in line and "no further try fits: step 9 is not saved" in line
    )
    assert line.endswith("the checkpoint of step 5 is intact and the next start resumes from it")
    assert "no checkpoint of this run is durable" in o.gave_up(9, durable=None)


def test_what_counts_as_the_store_not_answering() -> None:
    down: list[BaseException] = [
        ConnectionRefusedError(),
        ConnectionResetError(),
        TimeoutError(),
        OSError(errno.ESTALE, "Stale file handle"),
        OSError(errno.EHOSTUNREACH, "No route to host"),
    ]
    wrapped = OSError(errno.EIO, "s3://b/x: refused")
    wrapped.__cause__ = down[0]
    for e in [*down, wrapped, StoreUnreachableError("x")]:
        assert unreachable(e), repr(e)
    for e in [
        PermissionError(),
        FileNotFoundError(),
        OSError(errno.ENOSPC, "No space left"),
        OSError(errno.EIO, "disk"),
        ValueError(),
        CheckpointError("x"),
    ]:
        assert not unreachable(e), repr(e)
    err = disk_error(OSError(errno.ETIMEDOUT, "timed out"), "s3://b/x/step-00000003/f")
    assert isinstance(err, StoreUnreachableError) and isinstance(err, OSError)
    assert str(err).startswith("the store did not answer at s3://b/x/step-00000003/f (")
    assert "no space left" in str(disk_error(OSError(errno.ENOSPC, "full"), "f"))
    # Raised again `from` itself, an error would be its own cause: a loop for whoever walks
    # the chain (the trainer's outage line hung on it).
    again = disk_error(err, "s3://b/x")
    assert again is not err and again.__cause__ is err and str(again) == str(err)
    looped = StoreUnreachableError("x")
    looped.__cause__ = looped
    assert Outage().failed(1, looped) is not None


def _client_error(status: int, code: str, headers: dict[str, str] | None = None) -> Exception:
    from botocore.exceptions import ClientError

    response: Any = {
        "Error": {"Code": code, "Message": code},
        "ResponseMetadata": {"HTTPStatusCode": status, "HTTPHeaders": headers or {}},
    }
    inner = ClientError(response, "PutObject")
    outer = OSError(errno.EIO, code)  # what s3fs raises, from botocore's error
    outer.__cause__ = inner
    return outer


def _vendor(kind: str) -> Exception:
    from aiohttp import ServerDisconnectedError
    from botocore.exceptions import EndpointConnectionError, NoCredentialsError, ReadTimeoutError

    return {
        "endpoint": EndpointConnectionError(endpoint_url="http://x"),
        "read_timeout": ReadTimeoutError(endpoint_url="http://x"),
        "aiohttp": ServerDisconnectedError(),
        "no_credentials": NoCredentialsError(),
    }[kind]


# What S3 answers, classified once by its backend: (error, kind, retry_after).
S3_ANSWERS = [
    (lambda: _client_error(500, "InternalError"), "down", None),
    (lambda: _client_error(502, "BadGateway"), "down", None),
    (lambda: _client_error(503, "SlowDown", {"retry-after": "7"}), "down", 7.0),
    (lambda: _client_error(503, "SlowDown", {"retry-after": "Wed, 21 Oct"}), "down", None),
    (lambda: _client_error(400, "ThrottlingException"), "down", None),
    (lambda: _client_error(429, "TooManyRequests"), "down", None),
    (lambda: _client_error(403, "AccessDenied"), "config", None),
    (lambda: _client_error(403, "InvalidAccessKeyId"), "config", None),
    (lambda: _client_error(403, "SignatureDoesNotMatch"), "config", None),
    (lambda: _client_error(404, "NoSuchBucket"), "config", None),
    (lambda: _client_error(404, "NoSuchKey"), None, None),
    (lambda: _client_error(400, "InvalidArgument"), None, None),
    (lambda: _vendor("endpoint"), "down", None),
    (lambda: _vendor("read_timeout"), "down", None),
    (lambda: _vendor("aiohttp"), "down", None),
    (lambda: _vendor("no_credentials"), "config", None),
    (lambda: ConnectionResetError(), "down", None),
    (lambda: OSError(errno.EIO, "disk"), None, None),
]


@pytest.mark.parametrize(("make", "kind", "retry_after"), S3_ANSWERS)
def test_s3_answers_are_classified_once_by_the_backend(
    make: Any, kind: str | None, retry_after: float | None
) -> None:
    pytest.importorskip("s3fs")
    from ckptstore.errors import StoreConfigError
    from ckptstore.storage.s3 import S3Storage

    s3 = object.__new__(S3Storage)
    s3.root = "b/x"
    got = s3.classify(make())
    assert (got[0], got[1]) == (kind, retry_after) if got else kind is None
    said = s3.classified(make(), "s3://b/x/f")
    if kind == "down":
        assert isinstance(said, StoreUnreachableError) and said.retry_after == retry_after
        assert "\n" not in str(said) and "s3://b/x/f" in str(said)
    elif kind == "config":
        assert isinstance(said, StoreConfigError) and "a retry cannot help" in str(said)
    else:
        assert said is None


def test_a_pause_honours_retry_after_and_has_jitter(clock: Clock) -> None:
    o = Outage(clock=clock, first_pause_s=5, jitter=0.2)
    asked = StoreUnreachableError("busy")
    asked.retry_after = 40.0
    o.failed(1, asked)
    clock.now += 39.9
    assert not o.due()
    clock.now += 0.2
    assert o.due()
    nexts = set()
    for _ in range(20):
        o = Outage(clock=clock, first_pause_s=5, jitter=0.2)
        o.failed(1, StoreUnreachableError("down"))
        nexts.add(round(o._next - clock.now, 6))
    assert all(5.0 <= n <= 6.0 for n in nexts) and len(nexts) > 1


# -- a real S3 endpoint that goes away and comes back ---------------------------------------------
@pytest.fixture
def cut_s3() -> Iterator[Any]:
    why = s3server.unavailable_reason()
    if why is not None:
        pytest.skip(why)
    with s3server.MotoServer(proxy=True) as server:
        server.make_bucket("ckpt")
        yield server
        server.reconnect()


def few_retries(server: Any) -> dict[str, Any]:
    """The endpoint's options with botocore's retries turned down: each call against the cut
    endpoint fails within seconds instead of ten."""
    return {**server.storage_options(), "config_kwargs": {"retries": {"max_attempts": 1}}}


@pytest.mark.s3
def test_an_outage_is_told_apart_and_loses_nothing(cut_s3: Any) -> None:
    opts = few_retries(cut_s3)
    with CheckpointStore("s3://ckpt/run", storage_options=opts) as store:
        store.save(1, {"w": torch.ones(4)})
        cut_s3.disconnect()
        with pytest.raises(
            StoreUnreachableError, match="the store did not answer at s3://ckpt/run"
        ):
            store.save(2, {"w": torch.full((4,), 2.0)})
        with pytest.raises(StoreUnreachableError):  # not "step 1 cannot be trusted"
            store.latest_step()
        cut_s3.reconnect()
        store.save(3, {"w": torch.full((4,), 3.0)})
        assert store.steps() == [1, 3] and store.latest_step() == 3
        assert store.verify(1).ok and store.verify(3).ok


@pytest.mark.s3
def test_an_unreachable_store_at_start_is_told_apart(cut_s3: Any) -> None:
    cut_s3.disconnect()
    store = CheckpointStore("s3://ckpt/start", storage_options=few_retries(cut_s3))
    with pytest.raises(StoreUnreachableError, match="writer.lock"):
        store.acquire()
    store.close()


@pytest.mark.s3
def test_retries_against_a_dead_endpoint_leave_the_callers_random_stream_alone(
    cut_s3: Any,
) -> None:
    """botocore draws its retry jitter from Python's global random: a run that went on
    through an outage had another random state in its checkpoints than a straight run."""
    import random

    opts = {**cut_s3.storage_options(), "config_kwargs": {"retries": {"max_attempts": 3}}}
    with CheckpointStore("s3://ckpt/jitter", storage_options=opts) as store:
        store.save(1, {"w": torch.ones(4)})
        cut_s3.disconnect()
        random.seed(7)
        before = random.getstate()
        with pytest.raises(StoreUnreachableError):
            store.save(2, {"w": torch.ones(4)})  # retried twice by botocore, with jitter
        assert random.getstate() == before
        cut_s3.reconnect()
