"""Schema patterns (`pattern`, `patternProperties`) matched by RE2: in time linear in the text.

fastjsonschema compiles them with Python's `re`, a backtracking matcher: `^(a+)+$` against 35
a's and a "!" tries 2^35 ways to split the a's, minutes of the sidecar's one event loop, its
/readyz included, for one publish. RE2 (google-re2) never backtracks, so a check costs time in
proportion to the text whatever the pattern, and refuses the features that need backtracking
(back-references, lookarounds): a schema with one is refused when it is applied, naming the
pattern, instead of being slow later.

RE2 also reads `$` as JSON Schema (ECMA 262) does without the multiline flag, the end of the
text; Python's `$` matches before a final newline too, which fastjsonschema works around by
rewriting it. `Re2CodeGenerator` is fastjsonschema's draft-7 generator (which the 2020-12
keywords casque allows share, keywords.py) with each pattern's compiled form replaced by RE2's;
its generated code only calls `.search` on them, which RE2's objects have. The one place it
matched a pattern itself, whether `required` names a property `additionalProperties: false`
forbids, is judged here with RE2 before it would.

A schema applied before patterns were matched by RE2 may hold one RE2 refuses. It stays in
force: what is stored is read as it was accepted (`compiled(..., linear_only=False)`), and
only a new or changed schema must be linear (casque.engine.schema_versions). Such a pattern
is matched by the `regex` module, which backtracks as Python's `re` did but gives up after
BOUNDED_SEARCH_SECONDS: a search that takes longer refuses the message (PatternTimeout)
instead of holding the event loop.
"""

from __future__ import annotations

from typing import Any

import re2
import regex
from re2 import _re2
from fastjsonschema.draft07 import CodeGeneratorDraft07
from fastjsonschema.exceptions import JsonSchemaDefinitionException

# The longest one search of a pattern RE2 refuses may take (a stored schema's, see above).
BOUNDED_SEARCH_SECONDS = 0.05

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # the refusal says why; RE2 would also print it to stderr
_OPTIONS.never_capture = True  # a check asks only whether the pattern occurs
_UNANCHORED = _re2.RE2.Anchor.UNANCHORED


class Pattern:
    """A pattern compiled by RE2, searched as fastjsonschema's code searches (`.search`).

    It calls RE2's binding directly: re2.compile's `search` builds a match object through a
    generator, about 3 µs a call, where the question here (does it occur?) takes under 1 µs.
    Texts are encoded with `surrogatepass`, as JSON may escape a lone surrogate.
    """

    __slots__ = ("pattern", "_regexp")

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self._regexp = _re2.RE2(pattern.encode("utf-8", "surrogatepass"), _OPTIONS)
        if not self._regexp.ok():
            reason = self._regexp.error()
            raise NotLinear(
                f"pattern {pattern!r} is not one RE2 matches ({reason.decode(errors='replace')}): patterns are "
                "matched in linear time, without back-references or lookarounds (see docs/schemas.md)")

    def search(self, text: str) -> bool:
        data = text.encode("utf-8", "surrogatepass")
        found: bool = self._regexp.Match(_UNANCHORED, data, 0, len(data))[0][0] >= 0
        return found


class NotLinear(JsonSchemaDefinitionException):
    """RE2 cannot match the pattern (a back-reference, a lookaround): it is not matched in linear time."""


class PatternTimeout(Exception):
    """A bounded pattern's search took longer than BOUNDED_SEARCH_SECONDS."""

    def __init__(self, pattern: str) -> None:
        super().__init__(pattern)
        self.pattern = pattern


class BoundedPattern:
    """A pattern RE2 refuses, of a schema in force from before (see the module): searched by
    `regex`, each search given up after BOUNDED_SEARCH_SECONDS (PatternTimeout)."""

    __slots__ = ("pattern", "_regexp")

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        try:
            self._regexp = regex.compile(pattern)
        except regex.error as error:
            raise JsonSchemaDefinitionException(f"pattern {pattern!r} cannot be read: {error}") from error

    def search(self, text: str) -> bool:
        try:
            return self._regexp.search(text, timeout=BOUNDED_SEARCH_SECONDS) is not None
        except TimeoutError as error:
            raise PatternTimeout(self.pattern) from error


def compiled(pattern: str, linear_only: bool = True) -> Pattern | BoundedPattern:
    """`pattern` compiled by RE2. NotLinear naming it when RE2 cannot; or, when not
    `linear_only` (a schema in force), a BoundedPattern."""
    try:
        return Pattern(pattern)
    except NotLinear:
        if linear_only:
            raise
    return BoundedPattern(pattern)


class Re2CodeGenerator(CodeGeneratorDraft07):
    """fastjsonschema's draft-7 code generator with RE2 for every pattern (with `linear_only`
    false, a BoundedPattern for one RE2 refuses)."""

    linear_only = True

    def _here(self) -> dict[str, Any]:
        """The subschema being generated (fastjsonschema's generator is untyped)."""
        definition: dict[str, Any] = self._definition  # type: ignore[assignment]
        return definition

    def generate_pattern(self) -> None:
        pattern = self._here()["pattern"]
        if not isinstance(pattern, str):  # fastjsonschema would fail with a TypeError
            raise JsonSchemaDefinitionException(f"{self._variable_name}: pattern must be a string")
        matcher = compiled(pattern, self.linear_only)
        super().generate_pattern()  # type: ignore[no-untyped-call]
        self._compile_regexps[pattern] = matcher

    def generate_pattern_properties(self) -> None:
        regexes = {pattern: compiled(pattern, self.linear_only) for pattern in self._here()["patternProperties"]}
        super().generate_pattern_properties()  # type: ignore[no-untyped-call]
        self._compile_regexps.update(regexes)

    def generate_required(self) -> None:
        definition = self._here()
        names = definition["required"]
        if definition.get("additionalProperties", True) is not False or not isinstance(names, (list, tuple)):
            super().generate_required()  # type: ignore[no-untyped-call]
            return
        regexes = [compiled(p, self.linear_only) for p in definition.get("patternProperties", {})]
        declared = definition.get("properties", {})
        forbidden = [n for n in names if n not in declared and not any(r.search(n) for r in regexes)]
        if forbidden:
            raise JsonSchemaDefinitionException(f"{self._variable}: items {forbidden} are required but not allowed")
        # Judged: the parent's own judgement, with Python's re, is skipped by hiding the keyword.
        self._definition = {k: v for k, v in definition.items() if k != "additionalProperties"}
        try:
            super().generate_required()  # type: ignore[no-untyped-call]
        finally:
            self._definition = definition
