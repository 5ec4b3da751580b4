"""The NATS backends: a JetStream ``EventBus`` and a request/reply ``CommandChannel``.

Events go to one JetStream stream (file storage) with a duplicate window: a publisher sets
the message id (``Nats-Msg-Id`` = the event's ``event_id``), so a retried publish is stored
once. The controller reads through a durable pull consumer and acks each event only after
handling it, so an event in flight when the controller dies is redelivered to its successor.

Commands are NATS core request/reply on one subject per node; the reply is the agent's ack.
A command lost while a server restarts is simply re-sent by the controller's level-triggered
loop; the agent applies each command id at most once.

Reconnects: ``max_reconnect_attempts=-1`` (forever) with a short wait, and the initial
connect is bounded by our own timeout (nats-py would otherwise retry a dead server for
minutes), one that holds when nats-py does not end at a cancellation (:mod:`deadline`).
This module must never import etcd or daemon code.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Sequence
from typing import Any

import nats
import nats.errors
import nats.js.api
import nats.js.errors
import structlog
from nats.aio.client import Client as NatsClient

from sailor.coordination.api import CommandHandler, Delivery
from sailor.coordination.deadline import within
from sailor.coordination.errors import (
    CoordinationError,
    EventTooLargeError,
    PermanentError,
    ReplicasExceedClusterError,
    StreamConflictError,
    StreamNotPlacedError,
    StreamStorageError,
    TemporaryError,
    UnavailableError,
)
from sailor.coordination.keys import Keys, safe_token
from sailor.coordination.security.nats_auth import inbox_prefix
from sailor.coordination.security.settings import SecurityConfig
from sailor.coordination.stream_limits import (
    EVENT_MAX_BYTES,
    EVENT_MAX_MSG_SIZE,
    EVENT_MAX_MSGS_PER_SUBJECT,
)
from sailor.schemas.redact import redact_text, redact_urls

__all__ = [
    "NatsCommands",
    "NatsEventBus",
    "close_nats",
    "connect_nats",
    "placement_error",
    "storage_error",
    "unclustered_replicas",
]

_NO_PEERS = 10005
"""JetStream's error code for a stream whose replicas find too few servers to be placed on
(``no suitable peers for placement``, with the reasons it knows appended: ``, peer
offline`` while a member it knows is down)."""

_NOT_CLUSTERED = 10074
"""JetStream's error code for more than one replica on a server that is in no cluster
(``replicas > 1 not supported in non-clustered mode``; nats-server 2.15)."""

_log = structlog.get_logger("sailor.nats")

DUPLICATE_WINDOW_S = 120.0
"""JetStream's default dedup window (2 min): longer than any publisher's retry loop."""

_INSUFFICIENT_RESOURCES = 10047
"""JetStream's error code for a stream whose ``max_bytes`` (times its replicas) the server's
``max_file_store`` left over cannot reserve (``insufficient storage resources
available``, an HTTP-like 500)."""

_MESSAGE_TOO_LARGE = 10054
"""JetStream's error code for a publish above the stream's ``max_msg_size`` (``message
size exceeds maximum allowed``)."""


def storage_error(
    err_code: int | None, description: str | None, stream: str, max_bytes: int, replicas: int
) -> StreamStorageError | None:
    """What JetStream's refusal (``err_code``, ``description``) of ``stream`` means when it
    is the reservation of its ``max_bytes`` (:data:`_INSUFFICIENT_RESOURCES`); None when it
    is about something else. The server says only "insufficient storage resources": the
    operator learns which limit to change."""
    if err_code != _INSUFFICIENT_RESOURCES:
        return None
    return StreamStorageError(
        f"stream {stream!r}: the NATS server cannot reserve its max_bytes ({max_bytes} bytes "
        f"on each of {replicas} replica server(s)) out of JetStream's max_file_store: raise "
        "max_file_store in nats-server.conf, lower event_stream_max_bytes in the "
        "controller's config, or delete the streams of finished jobs",
        stream=stream,
        max_bytes=max_bytes,
        replicas=replicas,
        reason=description or "",
    )


async def connect_nats(
    url: str | Sequence[str],
    name: str,
    timeout: float = 5.0,
    security: SecurityConfig | None = None,
) -> NatsClient:
    """Connect with bounded first attempt and unbounded, fast reconnects afterwards.

    ``url`` may list every server of a NATS cluster: nats-py keeps them as its server pool,
    connects to the first that answers and, when the connection drops, reconnects along the
    pool (and to the servers the cluster announces), so losing one server is a reconnect.

    With ``security``: TLS verified against its CA (and our client certificate, if any), the
    NATS user and password from its login file, and a reply inbox of our own
    (``_INBOX_<user>``) so that the server's permissions can keep other clients out of it.
    """

    async def _quiet(exc: Exception) -> None:
        _log.debug("nats_error", client=name, error=redact_text(repr(exc)))

    extra: dict[str, Any] = {}
    if security is not None:
        try:
            extra["tls"] = security.ssl_context()
            login = security.nats_login()
        except (OSError, ssl.SSLError, ValueError) as exc:
            raise PermanentError("bad NATS security settings", error=str(exc)) from None
        if login is not None:
            extra["user"] = login.user
            extra["password"] = login.password.get_secret_value()
            extra["inbox_prefix"] = inbox_prefix(login.user)
    servers = [url] if isinstance(url, str) else list(url)
    nc = NatsClient()
    try:
        await within(
            nc.connect(
                servers=servers,
                name=name,
                connect_timeout=2,
                reconnect_time_wait=0.2,  # type: ignore[arg-type]  # seconds; the stub says int
                max_reconnect_attempts=-1,
                allow_reconnect=True,
                ping_interval=2,
                max_outstanding_pings=3,
                error_cb=_quiet,
                **extra,
            ),
            timeout,
            "nats connect",
        )
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        await close_nats(nc, timeout)
        raise UnavailableError(
            "nats unreachable", url=redact_urls(servers), error=redact_text(repr(exc))
        ) from exc
    return nc


def placement_error(
    err_code: int | None, description: str | None, replicas: int
) -> CoordinationError | None:
    """What JetStream's refusal to place a stream of ``replicas`` copies means; None when
    the refusal (``err_code``, ``description``) is about something else.

    A client cannot ask the cluster for its configured size (that takes the system
    account), nor count it: the servers it knows of (``Client.servers``) are the URLs it
    was given and those the servers up announced, so with one configured URL (a DNS name,
    a load balancer, a Service) a member that is down is unknown to it, and a server that
    listens on every interface announces each of its addresses. The answer is read from
    JetStream's own words alone:

    - a server in no cluster refuses any replicas > 1 (``_NOT_CLUSTERED``): no restart of
      a server ends that, only a config change: ``ReplicasExceedClusterError``;
    - too few peers (``_NO_PEERS``): members are down or not joined yet (``, peer offline``
      is appended only for one JetStream knew), whose return ends it, or the cluster has
      fewer servers than ``replicas``, which JetStream does not tell apart from that:
      ``StreamNotPlacedError``, retried (the leader reports it overdue past its deadline).
      A list of several ``nats_urls`` shorter than the replicas is refused when the
      config loads (``ControllerConfig``).

    A replica placed on a member that is down is not refused (nats-server 2.15 places an
    R3 stream on two live servers and a known offline one): that stream lives on at two.
    """
    why = description or ""
    if err_code == _NOT_CLUSTERED:
        return ReplicasExceedClusterError(
            f"{replicas} replicas asked of a NATS server in no cluster (a deployment of 1 server)",
            replicas=replicas,
            cluster_size=1,
            reason=why,
        )
    if err_code != _NO_PEERS:
        return None
    return StreamNotPlacedError(
        f"jetstream cannot place {replicas} replicas now: too few NATS servers are up and "
        f"joined (members down or not started, or a cluster of fewer than {replicas})",
        replicas=replicas,
        reason=why,
        retry_after=0.3,
    )


def unclustered_replicas(nc: NatsClient, replicas: int) -> ReplicasExceedClusterError | None:
    """The refusal :func:`placement_error` would make of ``replicas`` copies, told from the
    connected server's INFO, without placing anything: a standalone server (no cluster, no
    leaf node connection) sends no ``cluster``, and its own JetStream (``jetstream``) then
    refuses more than one replica (``_NOT_CLUSTERED``). For a standby, which places no
    stream until it leads; None when ``replicas`` is 1, the server names a cluster of its
    own, runs no JetStream itself (a leaf node whose JetStream requests its hub serves:
    the hub places the stream), or its INFO is not known: the placement then tells, as
    before. Refused only where the INFO is sure.

    A leaf node sends its own server name as ``cluster`` (nats-server 2.15, with or without
    a cluster block; seen with a hub of three and leaves in each JetStream mode,
    tests/integration/test_nats_leaf_replicas.py): from its INFO alone a leaf whose
    JetStream extends the hub's domain (``extension_hint: will_extend``, or the hub's
    system account over the leaf connection) looks like one whose JetStream is its own
    and in no cluster. That case is not refused but logged
    (``event_stream_replicas_unchecked``): the first placement, when this controller
    leads, answers. A cluster of fewer servers than ``replicas`` is not told here
    (``placement_error``: a client cannot count it)."""
    info = getattr(nc, "_server_info", None)  # nats-py keeps the last INFO, unexposed
    if replicas <= 1 or not isinstance(info, dict) or not info:
        return None
    if info.get("jetstream") is not True:
        return None
    cluster, name = info.get("cluster"), info.get("server_name")
    if cluster and cluster == name:
        # a leaf node's own name: extension or a JetStream of its own, the INFO cannot say
        _log.warning(
            "event_stream_replicas_unchecked",
            replicas=replicas,
            server=name,
            reason="a leaf node names itself as its cluster: the first placement will tell",
        )
        return None
    if cluster:
        return None
    return ReplicasExceedClusterError(
        f"{replicas} replicas asked of a NATS server in no cluster (a deployment of 1 server: "
        f"its INFO names no cluster)",
        replicas=replicas,
        cluster_size=1,
        reason=f"server {info.get('server_name', '?')} is in no cluster",
    )


async def close_nats(nc: NatsClient, timeout: float = 3.0) -> None:
    """Close ``nc``, giving up after ``timeout`` (plus :func:`within`'s grace) whatever
    nats-py does; never raises (a daemon's shutdown must go on), and leaves no task of the
    client running nor its socket open, even where nats-py's close stops midway
    (:func:`_release`)."""
    try:
        await within(nc.close(), timeout, "nats close")
    except Exception as exc:
        _log.debug("nats_close_failed", error=repr(exc))
    finally:
        await _release(nc, timeout)


async def _release(nc: NatsClient, timeout: float) -> None:
    """Stop what nats-py's ``close()`` leaves running when it raises midway, and wait (at
    most ``timeout``) until those tasks have ended.

    nats-py 2.16.0 writes the data still unsent before it stops the subscriptions and
    closes the socket; a client that was disconnected meanwhile (its login revoked: the
    server closed the connection and refuses each reconnect) raises ``BrokenPipeError``
    from that write, and its subscriptions' message tasks, its socket and its read, ping
    and flush tasks stay (seen after ``sailor certs revoke``:
    tests/integration/test_security_revoke.py). The client is closed by then (its status
    is set first), so a second ``close()`` does nothing. Its private fields are read with
    defaults: nats-py is pinned (pyproject.toml); after a close that completed, everything
    here is done already."""
    me = asyncio.current_task()
    left: list[asyncio.Future[Any]] = []
    subs: dict[Any, Any] = getattr(nc, "_subs", None) or {}
    for sub in list(subs.values()):
        with contextlib.suppress(Exception):
            sub._stop_processing()  # cancels its message task, ends its iterator
        for fut in list((getattr(sub, "_pending_next_msgs_calls", None) or {}).values()):
            fut.cancel()
        task = getattr(sub, "_wait_for_msgs_task", None)
        if task is not None:
            left.append(task)
    subs.clear()
    for name in ("_reading_task", "_ping_interval_task", "_flusher_task", "_reconnection_task"):
        task = getattr(nc, name, None)
        if isinstance(task, asyncio.Future) and task is not me and not task.done():
            task.cancel()
            left.append(task)
    transport = getattr(nc, "_transport", None)
    if transport is not None:
        with contextlib.suppress(Exception):
            transport.close()  # not wait_closed: it can hang (sailor.coordination.deadline)
    pending = {t for t in left if t is not me and not t.done()}
    if pending:
        await asyncio.wait(pending, timeout=timeout)


_MARK = "sailor events of job "
"""The start of the description this release gives a job's event stream, the job's name
after it: how a controller tells its own stream from another job's with the same subjects."""


def _mark(job: str) -> str:
    return _MARK + job


def _marked_job(description: str) -> str | None:
    """The job a stream's description names (``_mark``); None for a stream without one."""
    return description[len(_MARK) :] if description.startswith(_MARK) else None


class NatsEventBus:
    """``EventBus`` on a JetStream stream with one durable pull consumer."""

    def __init__(
        self,
        nc: NatsClient,
        keys: Keys,
        durable: str,
        op_timeout: float = 2.0,
        ack_wait: float = 30.0,
        source: str = "_",
        replicas: int = 1,
        max_bytes: int = EVENT_MAX_BYTES,
    ) -> None:
        self._nc = nc
        self._max_bytes = max_bytes
        self._limits_kept = ""  # why the existing stream's limits were left: warned once
        self._too_large_logged = False
        self._source = source
        self._keys = keys
        self._durable = safe_token(durable)
        self._timeout = op_timeout
        self._js = nc.jetstream(timeout=op_timeout)
        self._ack_wait = ack_wait
        self._replicas = replicas
        self._stream = keys.stream
        self._sub: Any = None

    async def ensure_stream(self) -> None:
        """Create the stream if missing (idempotent); ``replicas`` copies on a NATS cluster
        (3: the stream and its consumer survive the loss of one server).

        Placement refused: ``ReplicasExceedClusterError`` for replicas on a server in no
        cluster, which no server's return ends (:func:`placement_error`);
        ``StreamNotPlacedError`` (a ``TemporaryError``) for too few servers up and joined."""
        config = self._stream_config(self._stream)
        try:
            await self._js.add_stream(config)
        except nats.js.errors.APIError as exc:
            self._raise_unplaced(exc)
            refused = storage_error(
                exc.err_code, exc.description, self._stream, self._max_bytes, self._replicas
            )
            if refused is not None:
                # a server may judge the reservation before it finds the stream exists
                # (an older release's, without limits): that one is consumed as it is
                if await self._subjects_of(self._stream) is None:
                    raise refused from exc
            elif not isinstance(exc, nats.js.errors.BadRequestError):
                raise UnavailableError(
                    "jetstream unavailable", error=repr(exc), reason=exc.description
                ) from exc
            # it exists with another config (an older release's: no limits), or another
            # stream holds our subjects: update only a stream that is this job's
            await self._update_stream(await self._own_stream())
        except (TimeoutError, nats.errors.Error) as exc:
            raise UnavailableError("jetstream unavailable", error=repr(exc)) from exc

    def _stream_config(self, name: str) -> nats.js.api.StreamConfig:
        return nats.js.api.StreamConfig(
            name=name,
            subjects=[self._keys.event_subjects],
            storage=nats.js.api.StorageType.FILE,
            duplicate_window=DUPLICATE_WINDOW_S,
            max_age=24 * 3600.0,
            max_msg_size=EVENT_MAX_MSG_SIZE,
            max_msgs_per_subject=EVENT_MAX_MSGS_PER_SUBJECT,
            max_bytes=self._max_bytes,
            discard=nats.js.api.DiscardPolicy.OLD,
            num_replicas=self._replicas,
            description=_mark(self._keys.job),
        )

    async def _subjects_of(self, name: str) -> tuple[list[str], str] | None:
        """The subjects of stream ``name`` and its description (``_mark``: the job that
        made it, or none by an older release); None when there is none of that name."""
        try:
            info = await self._js.stream_info(name)
        except nats.js.errors.NotFoundError:
            return None
        except (TimeoutError, nats.errors.Error) as exc:
            raise UnavailableError("jetstream unavailable", error=repr(exc)) from exc
        return list(info.config.subjects or []), info.config.description or ""

    async def _own_stream(self) -> nats.js.api.StreamConfig:
        """The config to update the existing stream of this job to. The stream of our name
        must carry exactly this job's subjects: another job's (``x_y`` and ``X_Y`` shared a
        name before job names were checked) is never changed, nor a stream that holds our
        subjects under another name, except this job's under its old name
        (``Keys.legacy_stream``: a job with an upper-case letter, upgraded), which is
        adopted. Nor one whose subjects are ours but that another job marked (``a.b`` and
        ``a_b`` share subjects and stream name: ``_mark``); an unmarked one (an older
        release's) is taken, and marked by the update."""
        ours = [self._keys.event_subjects]
        found = await self._subjects_of(self._stream)
        if found is None and self._keys.legacy_stream != self._stream:
            legacy = await self._subjects_of(self._keys.legacy_stream)
            if legacy is not None and legacy[0] == ours:
                _log.info("event_stream_adopted", stream=self._keys.legacy_stream)
                self._stream = self._keys.legacy_stream
                found = legacy
        if found is not None and found[0] == ours:
            theirs = _marked_job(found[1])
            if theirs is not None and theirs != self._keys.job:
                raise StreamConflictError(
                    f"job {self._keys.job!r}: stream {self._stream!r} with its subjects "
                    f"{ours[0]!r} is job {theirs!r}'s (job names that differ only in '.' "
                    "and '_' share NATS subjects): left unchanged; rename one of the jobs",
                    stream=self._stream,
                    subjects=ours[0],
                    job=theirs,
                )
            return self._stream_config(self._stream)
        if found is None:
            raise StreamConflictError(
                f"job {self._keys.job!r}: its event subjects {ours[0]!r} belong to another "
                f"stream than {self._stream!r} (left unchanged); delete or rename that stream",
                stream=self._stream,
                subjects=ours[0],
            )
        raise StreamConflictError(
            f"job {self._keys.job!r}: stream {self._stream!r} exists with subjects "
            f"{found[0]}, not this job's {ours[0]!r} (another job's stream: left unchanged)",
            stream=self._stream,
            subjects=",".join(found[0]),
        )

    @property
    def stream(self) -> str:
        """The name of this job's event stream (``Keys.stream``, or the old name of an
        adopted one: ``_own_stream``)."""
        return self._stream

    async def _update_stream(self, config: nats.js.api.StreamConfig) -> None:
        """Update the existing stream to ``config``. Refused (its ``max_bytes`` does not
        fit the server's ``max_file_store``, or a change the server does not allow): the
        stream is consumed as it is, with a warning (once): a controller that read no
        events until an operator acted was worse than one whose stream keeps older limits.
        Only more replicas than the servers up can place is raised (and retried)."""
        try:
            await self._js.update_stream(config)
        except (nats.js.errors.NotFoundError, nats.js.errors.ServiceUnavailableError) as e:
            # gone since the add (a lost server took it along), or no meta leader yet
            raise UnavailableError("jetstream unavailable", error=repr(e)) from e
        except nats.js.errors.APIError as e:
            self._raise_unplaced(e)  # more replicas than before, too few servers for them
            refused = storage_error(
                e.err_code, e.description, config.name or "", self._max_bytes, self._replicas
            )
            why = str(refused) if refused is not None else f"{e.err_code}: {e.description}"
            if why != self._limits_kept:
                self._limits_kept = why
                _log.warning(
                    "event_stream_limits_kept",
                    stream=config.name,
                    reason=why[:600],
                    action="consuming the stream with the limits it has",
                )
        except (TimeoutError, nats.errors.Error) as e:
            raise UnavailableError("jetstream unavailable", error=repr(e)) from e

    def _raise_unplaced(self, exc: nats.js.errors.APIError) -> None:
        err = placement_error(exc.err_code, exc.description, self._replicas)
        if err is not None:
            raise err from exc

    async def publish(self, subject_kind: str, data: bytes, msg_id: str) -> bool:
        """Store ``data`` once (``msg_id``); False when it was a duplicate. An event above
        ``EVENT_MAX_MSG_SIZE`` raises ``EventTooLargeError`` without being sent (logged
        once per bus: ``event_too_large``): the stream refuses it every time."""
        if len(data) > EVENT_MAX_MSG_SIZE:
            if not self._too_large_logged:
                self._too_large_logged = True
                _log.error(
                    "event_too_large", kind=subject_kind, size=len(data), limit=EVENT_MAX_MSG_SIZE
                )
            raise EventTooLargeError(
                f"event of {len(data)} bytes above the stream's {EVENT_MAX_MSG_SIZE}",
                kind=subject_kind,
                msg_id=msg_id,
            )
        try:
            ack = await self._js.publish(
                self._keys.event_subject(subject_kind, self._source),
                data,
                timeout=self._timeout,
                headers={"Nats-Msg-Id": msg_id},
            )
        except nats.js.errors.NoStreamResponseError as exc:
            raise TemporaryError("no stream responded", error=repr(exc), retry_after=0.5) from exc
        except nats.js.errors.APIError as exc:
            if exc.err_code == _MESSAGE_TOO_LARGE:  # the stream's own limit, lower than ours
                raise EventTooLargeError(
                    "event refused by the stream as too large",
                    kind=subject_kind,
                    msg_id=msg_id,
                    reason=exc.description,
                ) from exc
            raise UnavailableError("event publish failed", error=repr(exc)) from exc
        except (TimeoutError, nats.errors.Error) as exc:
            raise UnavailableError("event publish failed", error=repr(exc)) from exc
        return not bool(ack.duplicate)

    async def _subscription(self) -> Any:
        if self._sub is None:
            config = nats.js.api.ConsumerConfig(
                durable_name=self._durable,
                ack_policy=nats.js.api.AckPolicy.EXPLICIT,
                ack_wait=self._ack_wait,
                max_ack_pending=20_000,
            )
            try:
                self._sub = await self._js.pull_subscribe(
                    self._keys.event_subjects,
                    durable=self._durable,
                    stream=self._stream,
                    config=config,
                )
            except (TimeoutError, nats.errors.Error) as exc:
                raise UnavailableError("consumer unavailable", error=repr(exc)) from exc
        return self._sub

    async def fetch(self, batch: int, timeout: float) -> list[Delivery]:
        sub = await self._subscription()
        try:
            msgs = await sub.fetch(batch, timeout=timeout)
        except TimeoutError:
            return []
        except nats.errors.Error as exc:
            if isinstance(exc, nats.errors.TimeoutError):
                return []
            raise UnavailableError("fetch failed", error=repr(exc)) from exc
        out: list[Delivery] = []
        for m in msgs:
            meta = m.metadata
            out.append(
                Delivery(
                    data=bytes(m.data),
                    msg_id=(m.headers or {}).get("Nats-Msg-Id", ""),
                    subject=m.subject,
                    redelivered=int(meta.num_delivered) - 1 if meta else 0,
                    ack=_acker(m),
                    nak=_naker(m),
                )
            )
        return out

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):  # bounded whatever nats-py does
                await within(self._sub.unsubscribe(), self._timeout, "nats unsubscribe")
            self._sub = None


def _acker(msg: Any) -> Any:
    async def ack() -> None:
        try:
            await msg.ack()
        except nats.errors.Error as exc:
            raise UnavailableError("ack failed", error=repr(exc)) from exc

    return ack


def _naker(msg: Any) -> Any:
    async def nak(delay: float) -> None:
        try:
            await msg.nak(delay=delay)
        except nats.errors.Error as exc:
            raise UnavailableError("nak failed", error=repr(exc)) from exc

    return nak


class NatsCommands:
    """``CommandChannel`` on NATS core request/reply."""

    def __init__(self, nc: NatsClient, keys: Keys) -> None:
        self._nc = nc
        self._keys = keys
        self._subs: list[Any] = []

    async def request(self, node_id: str, data: bytes, timeout: float) -> bytes:
        try:
            msg = await self._nc.request(self._keys.command_subject(node_id), data, timeout=timeout)
        except nats.errors.NoRespondersError as exc:
            raise UnavailableError("no agent listening", node=node_id) from exc
        except (TimeoutError, nats.errors.Error) as exc:
            raise UnavailableError("command not acked", node=node_id, error=repr(exc)) from exc
        return bytes(msg.data)

    async def serve(self, node_id: str, handler: CommandHandler) -> None:
        async def _cb(msg: Any) -> None:
            try:
                reply = await handler(bytes(msg.data))
            except PermanentError as exc:
                reply = str(exc).encode()
            with contextlib.suppress(nats.errors.Error):
                await msg.respond(reply)

        try:
            sub = await self._nc.subscribe(self._keys.command_subject(node_id), cb=_cb)
        except nats.errors.Error as exc:
            raise UnavailableError("subscribe failed", error=repr(exc)) from exc
        self._subs.append(sub)

    async def close(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
