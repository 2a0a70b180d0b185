"""Subscriber filters: a CEL expression over a message's attributes, key, priority and its
CloudEvents source, type and subject, checked when it is compiled.

CEL (the expression language of Kubernetes' CRD validation rules) is compiled by
cel-expr-python, the Python binding of the CEL project's own C++ implementation: it checks
types when an expression is compiled, so a misspelt variable, a comparison of a number with
a string or an expression that is not true or false is refused by the operator, with the
checker's message, before any message meets it. An expression is compiled once per
subscriber spec and evaluated per message (bench/bench_filter.py).

A message matches when the expression evaluates to true. Anything else does not match:
false, and an evaluation error, which in CEL is mostly a missing map key (reading
`attributes.region` of a message without that attribute), as in Pub/Sub, where a filter on
an absent attribute does not match. `has(attributes.region)` says it explicitly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from cel_expr_python import cel

# Longer expressions are refused (the CRD says the same): a filter is a predicate, not a program.
MAX_FILTER_LENGTH = 4096

_STRING = cel.Type.STRING
# The variables an expression may read; `type` is a CEL built-in, hence `eventType`.
VARIABLES: Mapping[str, Any] = {
    "attributes": cel.Type.Map(_STRING, _STRING),
    "key": _STRING,
    "priority": cel.Type.INT,
    "source": _STRING,
    "eventType": _STRING,
    "subject": _STRING,
}
_ENVIRONMENT = cel.NewEnv(variables=dict(VARIABLES))


class InvalidFilter(ValueError):
    """The expression does not compile, or is not a condition (true or false)."""


@dataclass(frozen=True)
class MessageFilter:
    expression: str
    _program: Any

    def matches(self, variables: Mapping[str, object]) -> bool:
        """Whether a message with these variables (every one of VARIABLES) matches."""
        value = self._program.eval(data=variables).value()
        return value is True


@lru_cache(maxsize=256)
def compile_filter(expression: str) -> MessageFilter:
    """The compiled filter, kept for the next call with the same expression (a consumer asks
    for its subscriber's at every message); InvalidFilter with the checker's message if it
    cannot be one."""
    return build_filter(expression)


def build_filter(expression: str) -> MessageFilter:
    """The compiled filter, compiled anew (compile_filter keeps them)."""
    if not expression.strip():
        raise InvalidFilter("a filter must not be empty")
    if len(expression) > MAX_FILTER_LENGTH:
        raise InvalidFilter(f"a filter is at most {MAX_FILTER_LENGTH} characters")
    try:
        program = _ENVIRONMENT.compile(expression)
    except RuntimeError as error:
        raise InvalidFilter(_checker_message(str(error))) from None
    returns = program.return_type()
    if returns != cel.Type.BOOL and returns != cel.Type.DYN:
        raise InvalidFilter(f"a filter must be a condition (true or false), not a value of type {returns.name().lower()}")
    return MessageFilter(expression, program)


def _checker_message(text: str) -> str:
    """The checker's first error in one line, without its status code and the source excerpt
    under it: `INVALID_ARGUMENT: ERROR: <input>:1:1: undeclared reference to 'x' (in container
    '')` and two more lines -> `1:1: undeclared reference to 'x'`."""
    first = text.strip().splitlines()[0] if text.strip() else "the expression does not compile"
    for prefix in ("INVALID_ARGUMENT:", "ERROR:", "<input>:"):
        first = first.strip().removeprefix(prefix)
    return first.replace(" (in container '')", "").removesuffix("[INVALID_ARGUMENT]").strip()
