"""Settings of the local stack's servers that live for minutes (the test suite's), as against
the developer's stack and the backends' images, whose servers run for hours."""

# A JVM that lives for minutes spends more CPU on C2's compiling than C2's faster code gives
# back. One Cassandra node: 16 -> 10 s of CPU to start, 61 -> 33 s for its first 33,000
# requests, after which C1's code costs about a quarter more per request (a session's
# figures: tests/fixtures/stack.py).
C1_ONLY_FLAGS = ("-XX:TieredStopAtLevel=1",)
# The same as one string, for what takes JVM options as text (JAVA_TOOL_OPTIONS, Spark's
# defaultJavaOptions, the chart's javaToolOptions).
C1_ONLY_OPTIONS = " ".join(C1_ONLY_FLAGS)


def compiler_flags(short_lived: bool) -> list[str]:
    return list(C1_ONLY_FLAGS) if short_lived else []
