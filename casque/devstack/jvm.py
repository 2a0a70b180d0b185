"""JVM settings that the local stack's servers share."""

# The compiler flags of a server that lives for minutes, as the test suite's do: C2's
# compiling costs such a JVM more CPU than its faster code gives back. One Cassandra node:
# 16 -> 10 s of CPU to start, 61 -> 33 s for its first 33,000 requests, after which C1's code
# costs about a quarter more per request (a session's figures: tests/fixtures/stack.py).
C1_ONLY_FLAGS = ("-XX:TieredStopAtLevel=1",)


def compiler_flags(c1_only: bool) -> list[str]:
    return list(C1_ONLY_FLAGS) if c1_only else []
