"""The error hierarchy of casque. Adapters map these to HTTP codes, CR conditions and exit codes."""

from __future__ import annotations

from collections.abc import Sequence


class CasqueError(Exception):
    """Base of every error casque raises on purpose."""

    code = "internal"


class StackError(CasqueError):
    """The local stack could not be installed, started or reached."""

    code = "stack_error"


class InvalidSpec(CasqueError):
    """A queue or subscriber definition breaks a rule (name, shards, retention, ...)."""

    code = "invalid_spec"


class BackendUnavailable(CasqueError):
    """Cassandra or ZooKeeper did not answer in time; the caller may retry."""

    code = "backend_unavailable"


class WriteOutcomeUnknown(BackendUnavailable):
    """Cassandra could not say whether a write was applied (a timeout, CAS_WRITE_UNKNOWN)."""

    code = "write_outcome_unknown"


class PublishOutcomeUnknown(BackendUnavailable):
    """A publish may or may not have been written and the backend could not settle which in
    time: retry it with the same id, which finds it if it was."""

    code = "publish_outcome_unknown"


class PartiallyPublished(BackendUnavailable):
    """A publish call of which part was written and part not: its messages spanned shards or
    batches (keys, priority levels, over a batch's bytes) and a backend failed some of them.
    `outcomes[i]` is message i's: where it was written, or the error that kept it out."""

    code = "partially_published"

    def __init__(self, outcomes: Sequence[object]) -> None:
        self.outcomes = list(outcomes)
        failed = [index for index, _ in self.failures()]
        shown = ", ".join(f"messages[{index}]" for index in failed[:10])
        if len(failed) > 10:
            shown += f" and {len(failed) - 10} more"
        super().__init__(
            f"{len(self.outcomes) - len(failed)} of {len(self.outcomes)} messages were written; {shown} "
            "were not: send only those again (or the whole call, if every message has an id or producer key)"
        )

    def failures(self) -> list[tuple[int, BaseException]]:
        return [(index, outcome) for index, outcome in enumerate(self.outcomes) if isinstance(outcome, BaseException)]


class QueueNotFound(CasqueError):
    code = "queue_not_found"


class SubscriberNotFound(CasqueError):
    code = "subscriber_not_found"


class MessageNotFound(CasqueError):
    """No message of the queue has the id (casque.engine.history)."""

    code = "message_not_found"


class UntraceableId(CasqueError):
    """An id that carries no time to find its message by: made before ids did, or not a message id."""

    code = "untraceable_id"


class InvalidChange(InvalidSpec):
    """An update that would break existing data, such as fewer shards."""

    code = "invalid_change"


class StaleReceipt(CasqueError):
    """The receipt is not the message's current delivery: it expired, was redelivered or moved."""

    code = "stale_receipt"


class MessageTooLarge(CasqueError):
    code = "message_too_large"


class PositionOutOfRange(CasqueError):
    """A seek target older than retention or beyond the head."""

    code = "position_out_of_range"


class LeaseLost(StaleReceipt):
    """The consumer lost its lease on the message's shard: another member may deliver it."""

    code = "lease_lost"


class AccessDenied(CasqueError):
    """A backend refused these credentials the operation: e.g. a namespace's ZooKeeper
    identity used on another namespace's znodes. Retrying with the same credentials cannot help."""

    code = "access_denied"


class QuotaExceeded(CasqueError):
    """A queue would take its namespace past a limit set by the platform team."""

    code = "quota_exceeded"


class InvalidSettings(CasqueError):
    """The process's own settings cannot work: e.g. a TLS file that does not exist or does
    not hold what its setting says."""

    code = "invalid_settings"


class TlsRefused(CasqueError):
    """A TLS handshake with a backend failed: a certificate the other side does not trust
    (a missing or wrong CA, a name that does not match, no client certificate where one is
    required) or one side speaking plaintext. Retrying cannot help until the settings change."""

    code = "tls_refused"


class SchemaViolation(CasqueError):
    """A message's data does not match its queue's schema (casque.dataschema).

    `path` is a JSON pointer into the data ("" for the whole), `rule` the schema keyword
    that failed (`required`, `maximum`, ...), `version` the schema version checked against.
    """

    code = "schema_violation"

    def __init__(self, message: str, *, path: str, rule: str, version: int) -> None:
        super().__init__(message)
        self.path = path
        self.rule = rule
        self.version = version


class DataTooDeep(SchemaViolation):
    """Data nested deeper than a schema check goes (casque.dataschema.validation.MAX_DATA_DEPTH):
    refused unchecked, since checking it would cost a stack frame or more per level."""

    code = "data_too_deep"


class IncompatibleSchema(InvalidChange):
    """A new queue schema that would refuse messages the one in force accepts."""

    code = "incompatible_schema"


class NewerFormat(CasqueError):
    """A stored record written by a later version of casque, in a format this one cannot read:
    refused rather than misread. Retrying cannot help until this process is upgraded."""

    code = "newer_format"
    # Refusals this process made, whichever reader met the record: a sidecar exports the count.
    refusals = 0

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        NewerFormat.refusals += 1
