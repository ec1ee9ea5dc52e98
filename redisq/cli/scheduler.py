"""`redisq scheduler`: deliver delayed messages as they fall due, as a process of its own."""

from __future__ import annotations

import time

import click

from redisq.cli.common import OK, connect, connection_options, warn
from redisq.cli.messages import StopRequest
from redisq.schedule.scheduler import Scheduler


@click.command("scheduler")
@click.option(
    "--topic",
    "topics",
    multiple=True,
    metavar="TOPIC",
    help="Deliver this topic's delayed messages (repeatable). Default: every topic of the "
    "namespace, including topics created later.",
)
@click.option(
    "--status-interval",
    type=click.FloatRange(min=0),
    default=0,
    help="Print the count of delivered messages to stderr every this many seconds (0: only "
    "at the end).",
)
@connection_options
def scheduler(topics: tuple[str, ...], status_interval: float) -> int:
    """Append delayed messages to their partitions when they are due, until SIGINT/SIGTERM.

    Consumers of a topic and producers that sent delayed messages to it run the same scheduler
    while they live; this command keeps delayed messages moving when neither runs. Any number
    may run: each partition is worked by one scheduler at a time (under a lease), and a due
    message is appended exactly once whoever appends it."""
    with connect() as broker:
        for topic in topics:
            broker.topic_config(topic, refresh=True)  # TopicNotFound (exit 3) before starting
        stop = StopRequest()
        with stop.installed():
            runner = Scheduler(broker, topics, all_topics=not topics)
            shown = ", ".join(topics) if topics else "every topic"
            warn(f"redisq scheduler: delivering delayed messages of {shown}; Ctrl-C stops")
            next_status = time.monotonic() + status_interval
            try:
                while not stop.event.wait(0.5):
                    if status_interval and time.monotonic() >= next_status:
                        next_status += status_interval
                        warn(f"redisq scheduler: {runner.delivered:,} delivered")
            finally:
                runner.close()
        warn(f"redisq scheduler: stopped; {runner.delivered:,} delayed messages delivered")
    return OK
