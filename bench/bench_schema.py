"""CPU per message of a queue schema check: fastjsonschema against jsonschema.

A queue's schema (`spec.schema`) is compiled once per schema version and every JSON message
published to the queue is checked against it (casque.dataschema). This measures what one
check costs in CPU (process time, so other load on the machine inflates it little), for
valid messages (what a healthy producer sends) and invalid ones (the check must also find
and render the failing path and rule), with each library compiled once, as the sidecar
does. No backend is needed.

    .venv/bin/python bench/bench_schema.py [--messages N] [--runs 3] [--json] [--smoke]

The payload is parsed once up front: both libraries check the same Python value, and the
JSON parse (the same for both) is reported on its own row for scale. It takes bench/all.py's
--cassandra and --zookeeper and ignores them.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from typing import Any

import fastjsonschema
import jsonschema
from benchlib import Figure, run_in_process

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["orderId", "customer", "lines", "total"],
    "properties": {
        "orderId": {"type": "string", "pattern": "^o-[0-9]{6}$"},
        "customer": {
            "type": "object",
            "required": ["id"],
            "properties": {"id": {"type": "integer", "minimum": 1}, "email": {"type": "string", "maxLength": 254}},
        },
        "lines": {
            "type": "array",
            "minItems": 1,
            "maxItems": 100,
            "items": {
                "type": "object",
                "required": ["sku", "quantity"],
                "properties": {
                    "sku": {"type": "string", "minLength": 1, "maxLength": 32},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 1000},
                },
            },
        },
        "total": {"type": "number", "minimum": 0},
        "currency": {"enum": ["EUR", "USD", "GBP"]},
        "note": {"type": ["string", "null"]},
    },
}


def valid_message(rng: random.Random) -> dict[str, Any]:
    return {
        "orderId": f"o-{rng.randrange(10**6):06d}",
        "customer": {"id": rng.randrange(1, 10**6), "email": "someone@example.com"},
        "lines": [{"sku": f"sku-{rng.randrange(1000)}", "quantity": rng.randrange(1, 10)}
                  for _ in range(rng.randrange(1, 6))],
        "total": round(rng.uniform(1, 500), 2),
        "currency": rng.choice(["EUR", "USD", "GBP"]),
        "note": None,
    }


def invalid_message(rng: random.Random) -> dict[str, Any]:
    message = valid_message(rng)
    message["lines"][-1]["quantity"] = 0  # fails deep inside: lines/N/quantity minimum
    return message


def jsonschema_check(schema: dict[str, Any]) -> Callable[[Any], str | None]:
    validator = jsonschema.Draft202012Validator(schema)

    def check(value: Any) -> str | None:
        error = next(validator.iter_errors(value), None)
        return None if error is None else f"{error.json_path}: {error.validator}"

    return check


def fastjsonschema_check(schema: dict[str, Any]) -> Callable[[Any], str | None]:
    validate = fastjsonschema.compile(schema)

    def check(value: Any) -> str | None:
        try:
            validate(value)
        except fastjsonschema.JsonSchemaValueException as error:
            return f"{error.name}: {error.rule}"
        return None

    return check


def cpu_per_call(check: Callable[[Any], object], values: list[Any]) -> float:
    """Process CPU µs per call of `check` over `values`."""
    start = time.process_time()
    for value in values:
        check(value)
    return (time.process_time() - start) / len(values) * 1e6


def compile_ms(make: Callable[[dict[str, Any]], object]) -> float:
    start = time.process_time()
    make(SCHEMA)
    return (time.process_time() - start) * 1e3


FIGURES = [
    Figure("fast_valid", "fastjsonschema, CPU per valid message", "µs"),
    Figure("fast_invalid", "  per invalid message (error found and rendered)", "µs"),
    Figure("fast_compile", "  compile, once per schema version", "ms"),
    Figure("js_valid", "jsonschema, CPU per valid message", "µs"),
    Figure("js_invalid", "  per invalid message (error found and rendered)", "µs"),
    Figure("js_compile", "  compile, once per schema version", "ms"),
    Figure("ratio_valid", "jsonschema / fastjsonschema, valid messages", "x"),
    Figure("json_parse", "JSON parse of the same payloads (context)", "µs"),
]


def once(messages: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    valid = [valid_message(rng) for _ in range(messages)]
    invalid = [invalid_message(rng) for _ in range(messages)]
    raw = [json.dumps(v).encode() for v in valid]
    figures = {"fast_compile": compile_ms(fastjsonschema_check), "js_compile": compile_ms(jsonschema_check)}
    for prefix, check in (("fast", fastjsonschema_check(SCHEMA)), ("js", jsonschema_check(SCHEMA))):
        assert all(check(v) is None for v in valid[:20]) and all(check(v) for v in invalid[:20]), prefix
        figures[f"{prefix}_valid"] = cpu_per_call(check, valid)
        figures[f"{prefix}_invalid"] = cpu_per_call(check, invalid)
    figures["json_parse"] = cpu_per_call(json.loads, raw)
    figures["ratio_valid"] = figures["js_valid"] / figures["fast_valid"]
    return figures


def main() -> None:
    run_in_process("schema", (__doc__ or "").splitlines()[0], lambda messages, run: once(messages, seed=run), FIGURES)

if __name__ == "__main__":
    main()
