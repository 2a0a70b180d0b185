"""Queue schemas: the JSON Schema a queue's JSON messages must match (`spec.schema`).

`keywords` says which JSON Schema (draft 2020-12) keywords a queue schema may use and
checks a schema against that; `validation` compiles a schema once per version and checks
messages against it; `compatibility` decides whether a new version accepts every message
the one before accepted.
"""
