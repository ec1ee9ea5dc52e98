"""Every Redis key redisq uses is named here, and nowhere else.

Two kinds of keys:

* Namespace keys (topic registry, topic metadata, named producers' registrations, group
  registries) share the hash tag ``{<ns>}``, so the scripts that touch several of them stay in
  one Redis Cluster slot.
* Partition keys (the stream, producer state, message-id dedup buckets, leases, a group's
  per-partition state) share the hash tag ``{<topic>:<partition>}``, so one script call can check
  and append atomically in one slot.

Lua scripts never build key names: every key they touch arrives in KEYS, built by this module.
"""

from __future__ import annotations

import re

from redisq.errors import InvalidName

MAX_NAME_CHARS = 200
MAX_NAMESPACE_CHARS = 64
# A dead-letter topic of a dead-letter topic (a group reading dead letters) always fits; deeper
# nesting fits while the whole name stays within this.
MAX_INTERNAL_TOPIC_CHARS = 1024
# User names never contain "~", so a name built around it cannot be any user topic, and the parts
# around it split back unambiguously.
DEAD_LETTER_MARK = "~dlq~"
UNRESOLVED_MARK = "~unresolved"

# fullmatch, never match with "$": "$" also matches before a trailing newline ("orders\n").
_NAMESPACE_RE = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_NAMESPACE_CHARS}}}")
_NAME_RE = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_NAME_CHARS}}}")
# "." and ".." read as directories wherever a name becomes a path (a PNG a command writes, an
# export, a URL of the console), as Kafka refuses them for topics.
_DOT_NAMES = frozenset({".", ".."})
_NAME_RULES = f"1-{MAX_NAME_CHARS} characters from A-Z a-z 0-9 . _ -, not . or .."


def _is_name(name: str) -> bool:
    return _NAME_RE.fullmatch(name) is not None and name not in _DOT_NAMES


def validate_namespace(namespace: object) -> str:
    if not isinstance(namespace, str) or not _NAMESPACE_RE.fullmatch(namespace):
        raise InvalidName(
            f"invalid namespace {namespace!r}: 1-{MAX_NAMESPACE_CHARS} characters from "
            "A-Z a-z 0-9 _ -"
        )
    return namespace


def validate_topic(topic: object) -> str:
    """A user topic (1-200 characters from A-Z a-z 0-9 . _ -, not . or ..), or an internal
    dead-letter topic as `dead_letter_topic` builds it, in exactly that form."""
    if isinstance(topic, str):
        if _is_name(topic):
            return topic
        if parse_dead_letter_topic(topic) is not None:
            return topic
        if parse_unresolved_topic(topic) is not None:
            return topic
    raise InvalidName(
        f"invalid topic name {topic!r}: {_NAME_RULES} "
        f"(or a dead-letter topic <topic>{DEAD_LETTER_MARK}<group>)"
    )


def validate_name(kind: str, name: object) -> str:
    """Producer names, group names and consumer names follow the user topic-name rules."""
    if not isinstance(name, str) or not _is_name(name):
        raise InvalidName(f"invalid {kind} name {name!r}: {_NAME_RULES}")
    return name


def dead_letter_topic(topic: str, group: str) -> str:
    """The dead-letter topic of group `group` on `topic`: ``<topic>~dlq~<group>``.

    This is the one function that builds it. "~" is a character no user name may contain, so
    the name cannot collide with a user topic or with the dead-letter topic of another (topic,
    group) pair (with "." as the separator, (pay.eu, billing) and (pay, eu.billing) shared
    one), and `parse_dead_letter_topic` splits it back. For every valid topic and group it is
    at most 405 characters, within its own limit (MAX_INTERNAL_TOPIC_CHARS); a group reading a
    dead-letter topic has one too (``orders~dlq~billing~dlq~fixer``).

    `redisq topic list` shows these next to the user topics; "~" sorts after every character of
    a user name, so ``orders~dlq~billing`` comes after ``orders`` and every ``orders.*``,
    ``orders-*`` and ``orders_*`` topic. No shell expands a "~" inside a word.
    """
    validate_topic(topic)
    validate_name("group", group)
    name = f"{topic}{DEAD_LETTER_MARK}{group}"
    if len(name) > MAX_INTERNAL_TOPIC_CHARS:
        raise InvalidName(
            f"the dead-letter topic of {topic[:60]!r}... and group {group!r} would be "
            f"{len(name)} characters, more than {MAX_INTERNAL_TOPIC_CHARS}: "
            "use failure_policy='block' for this group"
        )
    return name


def parse_dead_letter_topic(name: str) -> tuple[str, str] | None:
    """(topic, group) of a dead-letter topic built by `dead_letter_topic`, else None (a user
    topic, or not a valid name). The topic may itself be a dead-letter topic."""
    if DEAD_LETTER_MARK not in name or len(name) > MAX_INTERNAL_TOPIC_CHARS:
        return None
    topic, _, group = name.rpartition(DEAD_LETTER_MARK)
    if not _is_name(group):
        return None
    parts = topic.split(DEAD_LETTER_MARK)
    if not all(_is_name(part) for part in parts):
        return None
    return topic, group


def unresolved_topic(group: str) -> str:
    """Where check-back puts the half messages of transactional group `group` that it gave up
    on: ``<group>~unresolved`` (kept, listed by `redisq transactions`)."""
    return f"{validate_name('transactional group', group)}{UNRESOLVED_MARK}"


def parse_unresolved_topic(name: str) -> str | None:
    """The transactional group of an unresolved-transactions topic, else None."""
    group = name.removesuffix(UNRESOLVED_MARK)
    if group == name or not _is_name(group):
        return None
    return group


class KeySpace:
    """Builds the key names of one namespace."""

    def __init__(self, namespace: str = "rq") -> None:
        self.namespace = validate_namespace(namespace)
        self._global = f"{namespace}:{{{namespace}}}"

    # -- namespace keys (hash tag {<ns>}) ------------------------------------------------
    def topics(self) -> str:
        """SET of topic names."""
        return f"{self._global}:topics"

    def topic_meta(self, topic: str) -> str:
        """HASH of a topic's metadata (partitions, retention, dedup window, ...)."""
        return f"{self._global}:topic:{topic}"

    def named_producer(self, name: str) -> str:
        """HASH {pid, epoch} of a named producer."""
        return f"{self._global}:producer:{name}"

    def named_producer_topics(self, name: str) -> str:
        """SET of the topics a named producer has written to, fenced on the next start."""
        return f"{self._global}:producer:{name}:topics"

    def console_series(self, series: str) -> str:
        """ZSET sample time (ms) -> "<ms>:<value>": one series of the web console's charts
        (a topic's appended count, a group's lag per partition), trimmed to its newest points,
        so the charts survive a console restart."""
        return f"{self._global}:console:{series}"

    def pattern(self) -> str:
        """SCAN pattern of every key of the namespace."""
        return f"{self.namespace}:*"

    # -- partition keys (hash tag {<topic>:<partition>}) -----------------------------------
    def _partition(self, topic: str, partition: int) -> str:
        return f"{self.namespace}:{{{topic}:{partition}}}"

    def log(self, topic: str, partition: int) -> str:
        """STREAM: the partition itself; stream IDs are the offsets."""
        return f"{self._partition(topic, partition)}:log"

    def producer_state(self, topic: str, partition: int, producer_id: int) -> str:
        """HASH per (partition, PID): epoch, next sequence, window of recent batches."""
        return f"{self._partition(topic, partition)}:pid:{producer_id}"

    def counts(self, topic: str, partition: int) -> str:
        """HASH of a partition of batch entries (DESIGN §14.6): m, the messages, and e, the
        entries redisq appended to it (each batch entry's c is m before it)."""
        return f"{self._partition(topic, partition)}:count"

    def dedup_bucket(self, topic: str, partition: int, bucket: int) -> str:
        """HASH message id -> stream ID: bucket 0 or 1 of the ring of time slices of the dedup
        window (the slice number it holds is its field "")."""
        return f"{self._partition(topic, partition)}:dedup:{bucket}"

    def tx_mark(self, topic: str, partition: int, mark: str) -> str:
        """STRING: the stream ID a committed transaction's batch was rolled forward at (mark:
        transaction id, ":", batch index); a repeated roll-forward finds it and writes nothing.
        Kept until the transaction is carried out, then for protocol.transactions.MARK_GRACE_MS."""
        return f"{self._partition(topic, partition)}:txmark:{mark}"

    def partition_pattern(self, topic: str, partition: int) -> str:
        """SCAN pattern of every key of one partition."""
        return f"{self._partition(topic, partition)}:*"

    # -- consumer groups ---------------------------------------------------------------------
    def groups(self, topic: str) -> str:
        """SET of the consumer group names of a topic (hash tag {<ns>})."""
        return f"{self._global}:groups:{topic}"

    def group_meta(self, topic: str, group: str) -> str:
        """HASH of a group's settings: mode, start, start_id, created_ms, policy (tag {<ns>})."""
        return f"{self._global}:group:{topic}:{group}"

    def group_members(self, topic: str, group: str) -> str:
        """ZSET member name -> server time (ms) of its last heartbeat (tag {<ns>})."""
        return f"{self._global}:group:{topic}:{group}:members"

    def lease(self, topic: str, partition: int, group: str) -> str:
        """STRING "<token>:<member>:<granted_ms>" (PX ttl): a group's lease on a partition."""
        return f"{self._partition(topic, partition)}:lease:{group}"

    def lease_fence(self, topic: str, partition: int, group: str) -> str:
        """INCR counter of fencing tokens, bumped on every lease grant; never expires."""
        return f"{self._partition(topic, partition)}:fence:{group}"

    def group_partition_state(self, topic: str, partition: int, group: str) -> str:
        """HASH per (group, partition): dead_letters count, blocked offset/error/attempts."""
        return f"{self._partition(topic, partition)}:gstate:{group}"

    def parked_keys(self, topic: str, partition: int, group: str) -> str:
        """HASH message key -> offset of the dead-lettered message that parked it."""
        return f"{self._partition(topic, partition)}:parked:{group}"

    def scheduled(self, topic: str, partition: int) -> str:
        """ZSET scheduled message id -> due time (ms, the server's clock): delayed messages."""
        return f"{self._partition(topic, partition)}:schedule"

    def scheduled_messages(self, topic: str, partition: int) -> str:
        """HASH scheduled message id -> the message (its RESP-encoded arguments and layout)."""
        return f"{self._partition(topic, partition)}:scheduled"

    def scheduled_delivered(self, topic: str, partition: int) -> str:
        """ZSET scheduled message id -> until when (ms) a re-sent copy must still be refused:
        delivered ids whose sender may still retry (a delay shorter than its delivery timeout)."""
        return f"{self._partition(topic, partition)}:delivered"

    def schedule_abandoned(self, topic: str, partition: int) -> str:
        """ZSET nonce of a delayed batch its sender gave up on -> until when (ms) a late copy of
        it is refused (schedule.lua)."""
        return f"{self._partition(topic, partition)}:abandoned"

    def scheduler_lease(self, topic: str, partition: int) -> str:
        """STRING lease (token, PX ttl) of the client that delivers this partition's schedule."""
        return f"{self._partition(topic, partition)}:schedlease"

    # -- transactions (hash tag {~tx:<id>}: "~" never starts a topic name) ----------------------
    def _transaction(self, tx_id: str) -> str:
        return f"{self.namespace}:{{~tx:{tx_id}}}"

    def transaction(self, tx_id: str) -> str:
        """HASH: a transaction's record (state, producer, epoch, deadline, checks, input acks)."""
        return f"{self._transaction(tx_id)}:record"

    def transaction_messages(self, tx_id: str) -> str:
        """LIST: the transaction's staged batches, in send order (invisible to consumers)."""
        return f"{self._transaction(tx_id)}:messages"

    def transactions(self) -> str:
        """ZSET transaction id -> when to look at it next (ms): open and committed ones not yet
        rolled forward; the sweeper and the check-back read it (tag {<ns>})."""
        return f"{self._global}:transactions"

    def transaction_group(self, group: str) -> str:
        """ZSET transaction id -> next check-back (ms) of a transactional producer group."""
        return f"{self._global}:txgroup:{group}"

    def transaction_sweeper(self) -> str:
        """STRING lease of the client that sweeps the registry (expired and unfinished ones)."""
        return f"{self._global}:txsweep"

    def transaction_checker(self, group: str) -> str:
        """STRING lease of the member of a transactional group that runs the check-back."""
        return f"{self._global}:txcheck:{group}"

    def held_messages(self, topic: str, partition: int, group: str) -> str:
        """HASH offset -> message key: messages held back behind a parked key (orderly groups
        commit a position, so a held message is remembered here until its key is released)."""
        return f"{self._partition(topic, partition)}:held:{group}"

    def settled_messages(self, topic: str, partition: int, group: str) -> str:
        """HASH batch entry ID -> bitmap of its settled messages (bit i: message i), for the
        entries of a concurrent group still pending with part of them settled (DESIGN §14.8)."""
        return f"{self._partition(topic, partition)}:settled:{group}"

    def idempotency(self, topic: str, partition: int, scope: str, ident: str) -> str:
        """STRING "processing:<token>" or "done" of one message for one idempotent handler."""
        return f"{self._partition(topic, partition)}:idem:{scope}:{ident}"
