"""The connector's options: looked up case-insensitively, checked once on the driver."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from redisq.errors import InvalidConfig
from spark_connector.offsets import parse_offsets_spec

DEFAULT_FETCH_COUNT = 10_000

READ_OPTIONS = (
    "url",
    "namespace",
    "subscribe",
    "subscribePattern",
    "assign",
    "startingOffsets",
    "endingOffsets",
    "startingTimestamp",
    "endingTimestamp",
    "maxOffsetsPerTrigger",
    "minPartitions",
    "includeHeaders",
    "includeMetadata",
    "failOnDataLoss",
    "failOnMalformed",
    "fetchCount",
    "path",
    "checkpointLocation",
)


# -- options ----------------------------------------------------------------------------------
def option(options: Mapping[str, str], name: str, default: str | None = None) -> str | None:
    """Look an option up case-insensitively on the mapping Spark passed.

    Spark passes options case-insensitively; copying them with dict() lower-cases the keys, so
    a lookup by the camelCase name must go through here, never through a copy."""
    try:
        value = options.get(name)
    except Exception:  # pragma: no cover - any mapping will do
        value = None
    if value is None:
        lowered = name.lower()
        for key, candidate in options.items():
            if key.lower() == lowered:
                value = candidate
                break
    return default if value is None else value


def check_known(options: Mapping[str, str], known: Sequence[str], what: str) -> None:
    """A misspelt option would otherwise be ignored without a word."""
    allowed = {name.lower() for name in known}
    unknown = sorted(k for k in options if k.lower() not in allowed)
    if unknown:
        raise InvalidConfig(f"unknown {what} option(s) {unknown}; known: {', '.join(known)}")


def parse_bool(name: str, value: str | None, default: bool) -> bool:
    if value is None:
        return default
    lowered = str(value).strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise InvalidConfig(f"{name}={value!r}: expected true or false")


def parse_int(name: str, value: str | None, minimum: int) -> int | None:
    if value is None:
        return None
    try:
        number = int(str(value).strip())
    except ValueError:
        raise InvalidConfig(f"{name}={value!r}: expected an integer") from None
    if number < minimum:
        raise InvalidConfig(f"{name}={number} is out of range: {minimum} or more")
    return number


def resolve_url(options: Mapping[str, str]) -> str:
    """The url option, else REDIS_URL. Never the embedded server: executors run in other
    processes (or machines), and each would start a server of its own."""
    url = option(options, "url") or os.environ.get("REDIS_URL")
    if not url:
        raise InvalidConfig('the "url" option (or REDIS_URL) is required, e.g. redis://host:6379')
    return url


@dataclass(frozen=True)
class ReadOptions:
    """The reader's options, parsed and checked once, on the driver (picklable)."""

    url: str
    namespace: str = "rq"
    subscribe: tuple[str, ...] = ()
    subscribe_pattern: str | None = None
    assign: dict[str, tuple[int, ...]] | None = None
    starting_offsets: str | None = None
    ending_offsets: str | None = None
    starting_timestamp: int | None = None
    ending_timestamp: int | None = None
    max_offsets_per_trigger: int | None = None
    min_partitions: int | None = None
    include_headers: bool = False
    include_metadata: bool = False
    fail_on_data_loss: bool = True
    fail_on_malformed: bool = False
    fetch_count: int = DEFAULT_FETCH_COUNT

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> ReadOptions:
        check_known(options, READ_OPTIONS, "redisq read")
        subscribe = option(options, "subscribe")
        pattern = option(options, "subscribePattern")
        assign_text = option(options, "assign")
        chosen = [
            n
            for n, v in (
                ("subscribe", subscribe),
                ("subscribePattern", pattern),
                ("assign", assign_text),
            )
            if v
        ]
        if len(chosen) != 1:
            raise InvalidConfig(
                "give exactly one of the options subscribe, subscribePattern, assign "
                f"(got {chosen or 'none'})"
            )
        assign = None
        if assign_text:
            assign = parse_assign(assign_text)
        if pattern:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise InvalidConfig(f"subscribePattern={pattern!r}: {exc}") from None
        starting = option(options, "startingOffsets")
        ending = option(options, "endingOffsets")
        for name, text in (("startingOffsets", starting), ("endingOffsets", ending)):
            if text is not None:
                parse_offsets_spec(name, text)  # fail early, on the driver
        return cls(
            url=resolve_url(options),
            namespace=option(options, "namespace", "rq") or "rq",
            subscribe=tuple(t.strip() for t in subscribe.split(",") if t.strip())
            if subscribe
            else (),
            subscribe_pattern=pattern,
            assign=assign,
            starting_offsets=starting,
            ending_offsets=ending,
            starting_timestamp=parse_int(
                "startingTimestamp", option(options, "startingTimestamp"), 0
            ),
            ending_timestamp=parse_int("endingTimestamp", option(options, "endingTimestamp"), 0),
            max_offsets_per_trigger=parse_int(
                "maxOffsetsPerTrigger", option(options, "maxOffsetsPerTrigger"), 1
            ),
            min_partitions=parse_int("minPartitions", option(options, "minPartitions"), 1),
            include_headers=parse_bool("includeHeaders", option(options, "includeHeaders"), False),
            include_metadata=parse_bool(
                "includeMetadata", option(options, "includeMetadata"), False
            ),
            fail_on_data_loss=parse_bool("failOnDataLoss", option(options, "failOnDataLoss"), True),
            fail_on_malformed=parse_bool(
                "failOnMalformed", option(options, "failOnMalformed"), False
            ),
            fetch_count=parse_int("fetchCount", option(options, "fetchCount"), 1)
            or DEFAULT_FETCH_COUNT,
        )


def parse_assign(text: str) -> dict[str, tuple[int, ...]]:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidConfig(f'assign: not JSON like {{"orders": [0, 1]}}: {exc}') from None
    if not isinstance(raw, dict) or not all(
        isinstance(v, list) and all(isinstance(p, int) and not isinstance(p, bool) for p in v)
        for v in raw.values()
    ):
        raise InvalidConfig(f'assign={text!r}: expected JSON like {{"orders": [0, 1]}}')
    return {str(t): tuple(sorted(set(v))) for t, v in raw.items()}
