"""OpenTelemetry (redisq.integrations.otel) with the SDK's in-memory exporters: span names and
kinds, semantic-convention attributes, the producer's trace continued by the consumer through
the message headers, transaction spans and metrics, in the thread API and the asyncio API."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

import redisq
import redisq.asyncio as rq
from redisq.integrations.otel import RedisqInstrumentor


class Telemetry:
    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        self.metrics = InMemoryMetricReader()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.meter_provider = MeterProvider(metric_readers=[self.metrics])

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.spans.get_finished_spans() if s.name == name]

    def metric_points(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        data = self.metrics.get_metrics_data()
        assert data is not None
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        value = getattr(point, "value", None)
                        if value is None:
                            value = point.count  # a histogram: how many were recorded
                        totals[metric.name] = totals.get(metric.name, 0) + value
        return totals


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    setup = Telemetry()
    instrumentor = RedisqInstrumentor()
    instrumentor.instrument(
        tracer_provider=setup.tracer_provider, meter_provider=setup.meter_provider
    )
    try:
        yield setup
    finally:
        instrumentor.uninstrument()


def check_send_then_process(telemetry: Telemetry, topic: str, message_id: str | None) -> None:
    """The send and process spans of one message; a message id (idempotence="message_id") is
    messaging.message.id, a sequence producer's message carries redisq.sequence instead."""
    (send,) = telemetry.named(f"send {topic}")
    (process,) = telemetry.named(f"process {topic}")
    assert send.kind is SpanKind.PRODUCER and process.kind is SpanKind.CONSUMER
    assert send.attributes["messaging.system"] == "redisq"
    assert send.attributes["messaging.operation.type"] == "send"
    assert send.attributes["messaging.destination.name"] == topic
    assert send.attributes["messaging.destination.partition.id"] == "0"
    assert send.attributes.get("messaging.message.id") == message_id
    assert isinstance(send.attributes["redisq.producer.id"], int)
    assert isinstance(send.attributes["redisq.producer.epoch"], int)
    # The consumer continues the producer's trace: the process span is the send span's child.
    assert process.context.trace_id == send.context.trace_id
    assert process.parent is not None and process.parent.span_id == send.context.span_id
    assert process.attributes["messaging.operation.type"] == "process"
    assert process.attributes.get("messaging.message.id") == message_id
    assert process.attributes["messaging.consumer.group.name"] == "g"
    if message_id is None:
        assert isinstance(process.attributes["redisq.sequence"], int)
    else:
        assert "redisq.sequence" not in process.attributes


def test_thread_api_spans_and_metrics(
    redis_url: str, integration_namespace: str, telemetry: Telemetry
) -> None:
    broker = redisq.connect(redis_url, namespace=integration_namespace)
    try:
        broker.create_topic("traced", 1)
        broker.create_topic("polled", 1)
        with broker.producer() as producer:  # sequence mode: sequence numbers
            producer.send("traced", b"v", key="k")
            producer.send_async("polled", b"w", headers={"mine": "kept"}).result(10)
        with broker.consumer("traced", group="g") as consumer:
            consumer.run(lambda message: None, idle_timeout=1.0, max_messages=1)
        check_send_then_process(telemetry, "traced", None)

        with broker.consumer("polled", group="g") as consumer:
            messages = []
            while not messages:
                messages = consumer.poll(timeout=5.0)
            assert messages[0].headers["mine"] == b"kept"  # the user's headers stay
            consumer.ack(messages)
        (send,) = telemetry.named("send polled")
        (receive,) = telemetry.named("receive polled")
        (settle,) = telemetry.named("settle polled")
        assert receive.kind is SpanKind.CONSUMER and settle.kind is SpanKind.CLIENT
        assert [link.context.span_id for link in receive.links] == [send.context.span_id]
        assert settle.attributes["messaging.operation.type"] == "settle"

        with broker.producer(name="tx", transactional=True) as producer:
            with producer.transaction() as tx:
                tx.send("traced", b"in a transaction", key="k")
        (commit,) = telemetry.named("commit transaction")
        assert commit.attributes["redisq.transaction.id"] == tx.transaction_id
        assert commit.attributes["messaging.batch.message_count"] == 1
        assert len(telemetry.named("send traced")) == 2  # the transaction's send too
    finally:
        broker.close()
    points = telemetry.metric_points()
    assert points["messaging.client.sent.messages"] == 3
    assert points["messaging.client.consumed.messages"] == 2  # one processed, one received
    assert points["messaging.process.duration"] == 1
    assert points["messaging.client.operation.duration"] >= 4  # 3 sends, a receive, a settle


def test_asyncio_api_spans(
    redis_url: str, integration_namespace: str, telemetry: Telemetry
) -> None:
    async def main() -> None:
        broker = await rq.connect(redis_url, namespace=integration_namespace)
        try:
            await broker.create_topic("traced", 1)
            async with broker.producer(idempotence="message_id") as producer:
                await producer.send("traced", b"v", key="k", message_id="m-1")

            async def handler(message: rq.Message) -> None:
                return None

            async with broker.consumer("traced", group="g") as consumer:
                await consumer.run(handler, idle_timeout=1.0, max_messages=1)
        finally:
            await broker.close()

    asyncio.run(main())
    check_send_then_process(telemetry, "traced", "m-1")


def test_uninstrument_restores_the_methods(telemetry: Telemetry) -> None:
    instrumented = redisq.Producer.send
    RedisqInstrumentor().uninstrument()
    assert redisq.Producer.send is not instrumented
    assert redisq.Producer.send.__module__.startswith("redisq.produce")
