"""Plug-ins that put redisq under the frameworks Python users already run, each behind an extra:

    redisq.integrations.kombu     a Kombu transport, so Celery runs on redisq   ([celery])
    redisq.integrations.taskiq    a taskiq broker on redisq.asyncio              ([taskiq])
    redisq.integrations.otel      OpenTelemetry spans and metrics               ([otel])

This package imports nothing: each module is imported by the framework that uses it, and each
uses redisq's public API only (nothing in redisq imports them).
"""
