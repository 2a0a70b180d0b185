"""Errors of the Spark jobs. The CLI prints them as one line and exits nonzero."""

from __future__ import annotations

from casque.errors import CasqueError


class SparkJobError(CasqueError):
    """Base of the Spark jobs' own refusals."""

    code = "spark_error"


class InvalidRange(SparkJobError):
    """A range expression that does not parse, or names shards or times that cannot be."""

    code = "invalid_range"


class SparkUnavailable(SparkJobError):
    """PySpark, Java or the connector jars are missing, or the Spark session did not start."""

    code = "spark_unavailable"


class OutputExists(SparkJobError):
    """The output directory holds files already; jobs never overwrite a result silently."""

    code = "output_exists"
