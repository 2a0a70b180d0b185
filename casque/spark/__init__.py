"""Spark jobs over a queue's stored history."""
