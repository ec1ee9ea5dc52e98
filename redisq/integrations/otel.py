"""OpenTelemetry for redisq (extra ``[otel]``): spans and metrics named by the messaging semantic
conventions, trace context carried in message headers, in both APIs.

    from redisq.integrations.otel import RedisqInstrumentor

    RedisqInstrumentor().instrument()              # the global tracer and meter providers
    RedisqInstrumentor().instrument(tracer_provider=tp, meter_provider=mp)
    RedisqInstrumentor().uninstrument()

The instrumentor wraps the public methods of the producer, consumer and transaction classes of
``redisq`` and ``redisq.asyncio`` from outside (the OpenTelemetry contrib style); nothing in redisq
imports this module, and nothing of OpenTelemetry is imported until this module is.

Spans (``{operation} {destination}``, ``messaging.system = "redisq"``):
    send {topic}          PRODUCER   send, send_async, Transaction.send: the trace context is
                                     injected into the message's headers (``traceparent``)
    receive {topic}       CONSUMER   poll(): links to each message's producer context
    process {topic}       CONSUMER   each handler call of run(): a child of the producer's
                                     context, so the consumer continues the producer's trace
    settle {topic}        CLIENT     ack()
    commit transaction    INTERNAL   Transaction.commit / abort (``abort transaction``)
Metrics: messaging.client.sent.messages, messaging.client.consumed.messages,
messaging.client.operation.duration and messaging.process.duration (seconds).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from opentelemetry import context, propagate, trace
from opentelemetry.metrics import Meter, get_meter
from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.trace import Link, SpanKind, Status, StatusCode, Tracer

import redisq
import redisq.asyncio as rq_async

SYSTEM = "redisq"
INSTRUMENTATION = "redisq.integrations.otel"

# Attribute names (OpenTelemetry semantic conventions for messaging, v1.27 and later).
OPERATION_TYPE = "messaging.operation.type"
OPERATION_NAME = "messaging.operation.name"
DESTINATION = "messaging.destination.name"
PARTITION = "messaging.destination.partition.id"
MESSAGE_ID = "messaging.message.id"
BATCH_COUNT = "messaging.batch.message_count"
GROUP = "messaging.consumer.group.name"
OFFSET = "messaging.redisq.offset"
PRODUCER_ID = "redisq.producer.id"
EPOCH = "redisq.producer.epoch"
SEQUENCE = "redisq.sequence"
ATTEMPT = "redisq.attempt"
TRANSACTION_ID = "redisq.transaction.id"
ERROR_TYPE = "error.type"

# Set while an instrumented send runs: the sync send() calls send_async(), which must not make
# a second span (nor inject again).
_in_send: contextvars.ContextVar[bool] = contextvars.ContextVar("redisq_otel_send", default=False)


class _HeaderSetter(Setter[dict[str, Any]]):
    def set(self, carrier: dict[str, Any], key: str, value: str) -> None:
        carrier[key] = value


class _HeaderGetter(Getter[Mapping[str, Any]]):
    def get(self, carrier: Mapping[str, Any], key: str) -> list[str] | None:
        value = carrier.get(key)
        if value is None:
            return None
        return [value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)]

    def keys(self, carrier: Mapping[str, Any]) -> list[str]:
        return list(carrier)


_SETTER = _HeaderSetter()
_GETTER = _HeaderGetter()


class _Telemetry:
    """The tracer, the meter's instruments, and the span helpers every wrapper uses."""

    def __init__(self, tracer: Tracer, meter: Meter) -> None:
        self.tracer = tracer
        self.sent = meter.create_counter(
            "messaging.client.sent.messages", unit="{message}", description="Messages sent"
        )
        self.consumed = meter.create_counter(
            "messaging.client.consumed.messages", unit="{message}", description="Messages read"
        )
        self.operation_duration = meter.create_histogram(
            "messaging.client.operation.duration", unit="s", description="Send, receive, settle"
        )
        self.process_duration = meter.create_histogram(
            "messaging.process.duration", unit="s", description="Handler calls"
        )

    def record(self, histogram: Any, started: float, attributes: dict[str, Any]) -> None:
        histogram.record(time.monotonic() - started, attributes)


def _metric_attributes(operation: str, name: str, topic: str | None) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        OPERATION_TYPE: operation,
        OPERATION_NAME: name,
    }
    if topic is not None:
        attributes[DESTINATION] = topic
    return attributes


def _message_attributes(message: redisq.Message) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        PARTITION: str(message.partition),
        OFFSET: message.offset,
        ATTEMPT: message.attempt,
    }
    if message.message_id is not None:
        attributes[MESSAGE_ID] = message.message_id.decode("utf-8", "replace")
    if message.producer_id is not None:
        attributes[PRODUCER_ID] = message.producer_id
    if message.sequence is not None:
        attributes[SEQUENCE] = message.sequence
    return attributes


def _extract(message: redisq.Message) -> context.Context:
    return propagate.extract(message.headers or {}, getter=_GETTER)


def _fail(span: trace.Span, error: BaseException, attributes: dict[str, Any]) -> None:
    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, str(error)))
    span.set_attribute(ERROR_TYPE, type(error).__qualname__)
    attributes[ERROR_TYPE] = type(error).__qualname__


# -- producing -------------------------------------------------------------------------------------
def _bind(signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    bound = signature.bind(*args, **kwargs)
    headers = dict(bound.arguments.get("headers") or {})
    return bound, headers


def _start_send(
    telemetry: _Telemetry, producer: Any, topic: str, bound: Any, headers: dict[str, Any]
) -> trace.Span:
    span = telemetry.tracer.start_span(f"send {topic}", kind=SpanKind.PRODUCER)
    span.set_attributes(
        {
            "messaging.system": SYSTEM,
            OPERATION_TYPE: "send",
            OPERATION_NAME: "send",
            DESTINATION: topic,
        }
    )
    message_id = bound.arguments.get("message_id")
    if message_id is not None:
        mid = message_id.decode() if isinstance(message_id, bytes) else str(message_id)
        span.set_attribute(MESSAGE_ID, mid)
    for name, attribute in (("producer_id", PRODUCER_ID), ("epoch", EPOCH)):
        try:
            value = getattr(producer, name, None)
        except Exception:  # not started yet: no identity to show
            value = None
        if isinstance(value, int):
            span.set_attribute(attribute, value)
    propagate.inject(headers, context=trace.set_span_in_context(span), setter=_SETTER)
    bound.arguments["headers"] = headers
    return span


def _end_send(
    telemetry: _Telemetry,
    span: trace.Span,
    started: float,
    topic: str,
    result: Any = None,
    error: BaseException | None = None,
) -> None:
    attributes = _metric_attributes("send", "send", topic)
    if error is not None:
        _fail(span, error, attributes)
    elif result is not None and hasattr(result, "partition"):
        span.set_attribute(PARTITION, str(result.partition))
        attributes[PARTITION] = str(result.partition)
        if result.offset is not None:
            span.set_attribute(OFFSET, result.offset)
        span.set_attribute("redisq.duplicate", bool(result.duplicate))
    telemetry.sent.add(1, attributes)
    telemetry.record(telemetry.operation_duration, started, attributes)
    span.end()


def _wrap_send(telemetry: _Telemetry, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)
    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def send_coroutine(*args: Any, **kwargs: Any) -> Any:
            if _in_send.get():
                return await original(*args, **kwargs)
            bound, headers = _bind(signature, args, kwargs)
            topic = bound.arguments["topic"]
            span = _start_send(telemetry, args[0], topic, bound, headers)
            started = time.monotonic()
            token = _in_send.set(True)
            try:
                result = await original(*bound.args, **bound.kwargs)
            except BaseException as error:
                _end_send(telemetry, span, started, topic, error=error)
                raise
            finally:
                _in_send.reset(token)
            _end_send(telemetry, span, started, topic, result)
            return result

        return send_coroutine

    @functools.wraps(original)
    def send(*args: Any, **kwargs: Any) -> Any:
        if _in_send.get():
            return original(*args, **kwargs)
        bound, headers = _bind(signature, args, kwargs)
        topic = bound.arguments["topic"]
        span = _start_send(telemetry, args[0], topic, bound, headers)
        started = time.monotonic()
        token = _in_send.set(True)
        try:
            result = original(*bound.args, **bound.kwargs)
        except BaseException as error:
            _end_send(telemetry, span, started, topic, error=error)
            raise
        finally:
            _in_send.reset(token)
        if hasattr(result, "add_done_callback"):  # send_async: the span ends with the future

            def done(future: Any) -> None:
                failure = future.exception()
                if failure is not None:
                    _end_send(telemetry, span, started, topic, error=failure)
                else:
                    _end_send(telemetry, span, started, topic, future.result())

            result.add_done_callback(done)
        else:  # Transaction.send: staged now, written at commit
            _end_send(telemetry, span, started, topic, result)
        return result

    return send


# -- consuming -------------------------------------------------------------------------------------
def _topics_of(messages: Iterable[redisq.Message]) -> str | None:
    topics = {m.topic for m in messages}
    return topics.pop() if len(topics) == 1 else None


def _start_process(
    telemetry: _Telemetry, consumer: Any, message: redisq.Message
) -> tuple[trace.Span, float]:
    span = telemetry.tracer.start_span(
        f"process {message.topic}", context=_extract(message), kind=SpanKind.CONSUMER
    )
    span.set_attributes(
        {
            "messaging.system": SYSTEM,
            OPERATION_TYPE: "process",
            OPERATION_NAME: "process",
            DESTINATION: message.topic,
            GROUP: str(getattr(consumer, "group", "")),
            **_message_attributes(message),
        }
    )
    return span, time.monotonic()


def _end_process(
    telemetry: _Telemetry,
    span: trace.Span,
    started: float,
    message: redisq.Message,
    error: BaseException | None = None,
) -> None:
    attributes = _metric_attributes("process", "process", message.topic)
    if error is not None:
        _fail(span, error, attributes)
    telemetry.consumed.add(1, attributes)
    telemetry.record(telemetry.process_duration, started, attributes)
    span.end()


def _traced_handler(telemetry: _Telemetry, consumer: Any, handler: Any) -> Any:
    """handler wrapped in a process span per call, of the same kind (a coroutine function stays
    one: the asyncio consumer runs a plain function in a thread)."""
    is_async = inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        type(handler).__call__
    )
    if is_async:

        async def process_coroutine(message: redisq.Message) -> Any:
            span, started = _start_process(telemetry, consumer, message)
            with trace.use_span(span, end_on_exit=False):
                try:
                    result = await handler(message)
                except BaseException as error:
                    _end_process(telemetry, span, started, message, error)
                    raise
            _end_process(telemetry, span, started, message)
            return result

        return process_coroutine

    def process(message: redisq.Message) -> Any:
        span, started = _start_process(telemetry, consumer, message)
        with trace.use_span(span, end_on_exit=False):
            try:
                result = handler(message)
            except BaseException as error:
                _end_process(telemetry, span, started, message, error)
                raise
        _end_process(telemetry, span, started, message)
        return result

    return process


def _wrap_run(telemetry: _Telemetry, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def run(self: Any, handler: Any, *args: Any, **kwargs: Any) -> Any:
        if not callable(handler):  # the consumer's own TypeError
            return original(self, handler, *args, **kwargs)
        return original(self, _traced_handler(telemetry, self, handler), *args, **kwargs)

    return run


def _receive_span(
    telemetry: _Telemetry, consumer: Any, messages: list[Any], started: float
) -> None:
    """One receive span per poll that gave messages, linked to each producer's context."""
    topic = _topics_of(messages)
    links = []
    for message in messages:
        span_context = trace.get_current_span(_extract(message)).get_span_context()
        if span_context.is_valid:
            links.append(Link(span_context))
    span = telemetry.tracer.start_span(
        f"receive {topic or 'multiple'}",
        kind=SpanKind.CONSUMER,
        links=links,
        start_time=time.time_ns() - int((time.monotonic() - started) * 1e9),
    )
    attributes = _metric_attributes("receive", "poll", topic)
    span.set_attributes(
        {**attributes, BATCH_COUNT: len(messages), GROUP: str(getattr(consumer, "group", ""))}
    )
    if len(messages) == 1:
        span.set_attributes(_message_attributes(messages[0]))
    telemetry.consumed.add(len(messages), attributes)
    telemetry.record(telemetry.operation_duration, started, attributes)
    span.end()


def _wrap_poll(telemetry: _Telemetry, original: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def poll_coroutine(self: Any, *args: Any, **kwargs: Any) -> Any:
            started = time.monotonic()
            messages = await original(self, *args, **kwargs)
            if messages:
                _receive_span(telemetry, self, messages, started)
            return messages

        return poll_coroutine

    @functools.wraps(original)
    def poll(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        messages = original(self, *args, **kwargs)
        if messages:
            _receive_span(telemetry, self, messages, started)
        return messages

    return poll


def _flatten(messages: tuple[Any, ...]) -> list[Any]:
    flat: list[Any] = []
    for item in messages:
        if isinstance(item, redisq.Message):
            flat.append(item)
        else:
            flat.extend(item)
    return flat


def _start_settle(
    telemetry: _Telemetry, consumer: Any, messages: list[Any]
) -> tuple[trace.Span, dict[str, Any]]:
    topic = _topics_of(messages)
    span = telemetry.tracer.start_span(f"settle {topic or 'multiple'}", kind=SpanKind.CLIENT)
    attributes = _metric_attributes("settle", "ack", topic)
    span.set_attributes(
        {**attributes, BATCH_COUNT: len(messages), GROUP: str(getattr(consumer, "group", ""))}
    )
    if len(messages) == 1:
        span.set_attributes(_message_attributes(messages[0]))
    return span, attributes


def _wrap_ack(telemetry: _Telemetry, original: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def ack_coroutine(self: Any, *messages: Any) -> Any:
            flat = _flatten(messages)
            span, attributes = _start_settle(telemetry, self, flat)
            started = time.monotonic()
            try:
                return await original(self, flat)
            except BaseException as error:
                _fail(span, error, attributes)
                raise
            finally:
                telemetry.record(telemetry.operation_duration, started, attributes)
                span.end()

        return ack_coroutine

    @functools.wraps(original)
    def ack(self: Any, *messages: Any) -> Any:
        flat = _flatten(messages)
        span, attributes = _start_settle(telemetry, self, flat)
        started = time.monotonic()
        try:
            return original(self, flat)
        except BaseException as error:
            _fail(span, error, attributes)
            raise
        finally:
            telemetry.record(telemetry.operation_duration, started, attributes)
            span.end()

    return ack


# -- transactions ----------------------------------------------------------------------------------
def _start_transaction(telemetry: _Telemetry, tx: Any, outcome: str) -> trace.Span:
    span = telemetry.tracer.start_span(f"{outcome} transaction", kind=SpanKind.INTERNAL)
    span.set_attributes({"messaging.system": SYSTEM, TRANSACTION_ID: str(tx.transaction_id)})
    producer = getattr(tx, "_producer", None)  # (read for the span only, when it is there)
    for name, attribute in (("producer_id", PRODUCER_ID), ("epoch", EPOCH)):
        value = getattr(producer, name, None) if producer is not None else None
        if isinstance(value, int):
            span.set_attribute(attribute, value)
    return span


def _wrap_transaction_end(
    telemetry: _Telemetry, original: Callable[..., Any], outcome: str
) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def end_coroutine(self: Any, *args: Any, **kwargs: Any) -> Any:
            span = _start_transaction(telemetry, self, outcome)
            with trace.use_span(span, end_on_exit=True):
                result = await original(self, *args, **kwargs)
                if isinstance(result, tuple):
                    span.set_attribute(BATCH_COUNT, len(result))
                return result

        return end_coroutine

    @functools.wraps(original)
    def end(self: Any, *args: Any, **kwargs: Any) -> Any:
        span = _start_transaction(telemetry, self, outcome)
        with trace.use_span(span, end_on_exit=True):
            result = original(self, *args, **kwargs)
            if isinstance(result, tuple):
                span.set_attribute(BATCH_COUNT, len(result))
            return result

    return end


# -- the instrumentor ------------------------------------------------------------------------------
def _targets() -> list[tuple[type, str, str]]:
    """(class, method, kind) of every method wrapped, both APIs."""
    targets: list[tuple[type, str, str]] = []
    for api in (redisq, rq_async):
        targets += [
            (api.Producer, "send", "send"),
            (api.Producer, "send_async", "send"),
            (api.Transaction, "send", "send"),
            (api.Transaction, "commit", "commit"),
            (api.Transaction, "abort", "abort"),
            (api.Consumer, "run", "run"),
            (api.Consumer, "poll", "poll"),
            (api.Consumer, "ack", "ack"),
        ]
    return targets


class RedisqInstrumentor:
    """Spans and metrics for every producer, consumer and transaction of both APIs, in this
    process, from instrument() until uninstrument()."""

    _originals: dict[tuple[type, str], Any] = {}

    def instrument(self, tracer_provider: Any = None, meter_provider: Any = None) -> None:
        if RedisqInstrumentor._originals:
            return  # already instrumented (as the contrib instrumentors, once per process)
        version = getattr(redisq, "__version__", "")
        telemetry = _Telemetry(
            trace.get_tracer(INSTRUMENTATION, version, tracer_provider),
            get_meter(INSTRUMENTATION, version, meter_provider),
        )
        wrappers: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
            "send": functools.partial(_wrap_send, telemetry),
            "run": functools.partial(_wrap_run, telemetry),
            "poll": functools.partial(_wrap_poll, telemetry),
            "ack": functools.partial(_wrap_ack, telemetry),
            "commit": lambda f: _wrap_transaction_end(telemetry, f, "commit"),
            "abort": lambda f: _wrap_transaction_end(telemetry, f, "abort"),
        }
        for cls, name, kind in _targets():
            # The class that defines it (Consumer.poll is the Poller base's): wrapped there,
            # once; a method missing is a bug here, not something to skip without a word.
            owner = next(c for c in cls.__mro__ if name in c.__dict__)
            if (owner, name) in RedisqInstrumentor._originals:
                continue
            original = owner.__dict__[name]
            RedisqInstrumentor._originals[(owner, name)] = original
            setattr(owner, name, wrappers[kind](original))

    def uninstrument(self) -> None:
        for (cls, name), original in RedisqInstrumentor._originals.items():
            setattr(cls, name, original)
        RedisqInstrumentor._originals = {}

    @property
    def is_instrumented(self) -> bool:
        return bool(RedisqInstrumentor._originals)
