"""Circuit breaker per dependency, so an outage costs one fast failure instead of a timeout per request.

A timeout is not like the other outages. A refused connection or an INTERNAL says the dependency
failed; a call that ran past the router's own per-call deadline may only have been expensive (a
reranked search with a large top_k), and counting those made one tenant's heavy searches open the
retriever's breaker, turning RAG off for every tenant. So a timeout counts toward the threshold only
when nothing shows the dependency is up: no call to it was answered since the timed-out one began
and, where the caller gives one, a cheap liveness probe is not answered either (docs/reliability.md).
A dependency that answers nothing (hung, blackholed) still opens the breaker after the threshold.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import redis.exceptions
from prometheus_client import Gauge

from services.common import errors

log = logging.getLogger("llmmesh.router.breaker")

T = TypeVar("T")

BREAKER_STATE = Gauge(
    "llmmesh_router_breaker_state",
    "Circuit breaker state per dependency: 0 closed, 1 half-open, 2 open.",
    ["dependency"],
)

# Status codes that mean the dependency itself is unwell; anything else (NOT_FOUND,
# PERMISSION_DENIED, a quota's RESOURCE_EXHAUSTED, …) is a real answer and proves it is up.
OUTAGE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
    }
)


class BreakerState(enum.IntEnum):
    """Closed lets calls through, open refuses them, half-open lets one probe through."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


def is_timeout(exc: BaseException) -> bool:
    """True when ``exc`` says the call ran out of time: slow, which need not mean down."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    return isinstance(exc, errors.DeadlineExceeded | TimeoutError | redis.exceptions.TimeoutError)


def is_outage(exc: BaseException) -> bool:
    """True when ``exc`` says the dependency could not answer (as opposed to answering no)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code() in OUTAGE_CODES
    if isinstance(exc, errors.DependencyUnavailable | errors.DeadlineExceeded):
        return True
    return isinstance(
        exc,
        ConnectionError
        | TimeoutError
        | OSError
        | redis.exceptions.ConnectionError
        | redis.exceptions.TimeoutError,
    )


class CircuitBreaker:
    """Opens after ``failure_threshold`` consecutive outages; probes again after ``reset_timeout_s``.

    A timeout is an outage only while the dependency shows no sign of life (the module's docstring).
    """

    def __init__(
        self,
        name: str,
        failure_threshold: int = 5,
        reset_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError("failure_threshold: must be >= 1")
        if reset_timeout_s <= 0:
            raise ValueError("reset_timeout_s: must be > 0")
        self.name = name
        self.failure_threshold = failure_threshold
        self.reset_timeout_s = reset_timeout_s
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probe_in_flight = False
        # Answers (successes and real refusals) so far: a timed-out call that began before the
        # latest answer was slow while the dependency answered others, so it does not count.
        # A count, not a time: two calls in the same clock tick still order.
        self._answers = 0
        # The liveness probe in flight, shared by every timeout that needs one (a burst of heavy
        # calls timing out together sends one probe, not one each).
        self._liveness: asyncio.Future[bool] | None = None
        BREAKER_STATE.labels(name).set(0)

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.reset_timeout_s:
            self._set(BreakerState.HALF_OPEN)
        return self._state

    @property
    def retry_after_s(self) -> float:
        """Seconds until an open breaker lets a probe through (0 when not open)."""
        if self.state is not BreakerState.OPEN:
            return 0.0
        return max(0.0, self.reset_timeout_s - (self._clock() - self._opened_at))

    def allow(self) -> bool:
        """Whether a call may go out now; in half-open only one probe at a time does."""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.HALF_OPEN and not self._probe_in_flight:
            self._probe_in_flight = True
            return True
        return False

    def record_success(self) -> None:
        self._answers += 1
        self._failures = 0
        self._probe_in_flight = False
        if self._state is not BreakerState.CLOSED:
            log.info("circuit %s closed: dependency answered again", self.name)
        self._set(BreakerState.CLOSED)

    def record_failure(self, cause: BaseException | None = None) -> None:
        self._probe_in_flight = False
        self._failures += 1
        # A failed probe reopens at once; a closed breaker waits for the threshold.
        if self._state is BreakerState.HALF_OPEN or self._failures >= self.failure_threshold:
            if self._state is not BreakerState.OPEN:
                # The whole cause, for operators (callers are told only its kind: ``_describe``).
                last = f"; last: {type(cause).__name__}: {cause}" if cause is not None else ""
                log.warning("circuit %s open after %d failures%s", self.name, self._failures, last)
            self._opened_at = self._clock()
            self._set(BreakerState.OPEN)

    async def call(
        self,
        coro_factory: Callable[[], Awaitable[T]],
        liveness_probe: Callable[[], Awaitable[object]] | None = None,
    ) -> T:
        """Run one call through the breaker; outages become ``DependencyUnavailable``.

        ``liveness_probe`` makes a cheap call to the same dependency (the cheapest request of the
        same kind, under the caller's own deadline): run when this call timed out and no other call
        was answered meanwhile, its answer shows the timeout was this call's cost, not an outage.
        """
        if not self.allow():
            raise errors.DependencyUnavailable(
                f"{self.name} unavailable (circuit open, next try in {self.retry_after_s:.1f}s)"
            )
        answers_before = self._answers
        try:
            result = await coro_factory()
        except BaseException as exc:
            if is_outage(exc):
                if is_timeout(exc) and await self._alive_since(answers_before, liveness_probe):
                    # Slow, not down: this turn goes without the dependency (the caller degrades),
                    # the others keep it. In half-open the dependency just proved it answers: the
                    # probe answered (record_success), so the breaker is closed now.
                    self._probe_in_flight = False
                    raise errors.DependencyUnavailable(
                        f"{self.name} unavailable: {_describe(exc)}"
                        " (slow for this call; it answers others: not counted as an outage)"
                    ) from exc
                self.record_failure(exc)
                raise errors.DependencyUnavailable(f"{self.name} unavailable: {_describe(exc)}") from exc
            # Cancellation or a real answer ("not found"): the dependency is not to blame.
            self._probe_in_flight = False
            if isinstance(exc, Exception):
                self.record_success()
            raise
        self.record_success()
        return result

    async def _alive_since(
        self, answers_before: int, liveness_probe: Callable[[], Awaitable[object]] | None
    ) -> bool:
        """Whether the dependency answered anything since ``answers_before`` was read, asking it
        with ``liveness_probe`` when nothing else did."""
        if self._answers > answers_before:
            return True
        if liveness_probe is None:
            return False
        liveness = self._liveness
        # A new probe unless one is in flight (on this loop: a breaker may outlive a loop in tests).
        if liveness is None or liveness.done() or liveness.get_loop() is not asyncio.get_running_loop():
            liveness = self._liveness = asyncio.ensure_future(self._probe_liveness(liveness_probe))
        # Shielded: a caller that goes away (its turn cancelled) must not cancel the probe that
        # other timed-out calls are waiting on. Another call answered while the probe ran is as good.
        return await asyncio.shield(liveness) or self._answers > answers_before

    async def _probe_liveness(self, liveness_probe: Callable[[], Awaitable[object]]) -> bool:
        try:
            await liveness_probe()
        except Exception as exc:
            if is_outage(exc):
                return False
            # A real refusal ("not found") is an answer too: the dependency is up.
        self.record_success()
        return True

    def _set(self, state: BreakerState) -> None:
        self._state = state
        BREAKER_STATE.labels(self.name).set(int(state))


def _describe(exc: BaseException) -> str:
    """The outage as the caller is told it (its message reaches clients: degraded reasons,
    statuses). A gRPC peer's status is its own, already fit for them; a Redis or socket
    client's text names internal addresses ("Error 111 connecting to 10.0.0.5:6379"), so only
    its kind is said, and the whole of it logged."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if str(exc):
        log.debug("outage: %s: %s", type(exc).__name__, exc)
    return type(exc).__name__
