"""The session's row factory: the driver's named rows, with one class per column list."""

from __future__ import annotations

from cassandra.query import named_tuple_factory

from casque.backends.cql import named_rows


def test_rows_have_the_names_and_values_the_drivers_factory_gives_them() -> None:
    columns = ["[applied]", "batch", "writer"]
    rows = [(False, 7, "w1"), (True, 8, "w2")]
    ours, theirs = named_rows(columns, rows), named_tuple_factory(columns, rows)
    assert ours == theirs
    assert [r._asdict() for r in ours] == [r._asdict() for r in theirs]
    assert ours[0].applied is False and ours[1].writer == "w2"


def test_one_row_class_serves_every_result_of_a_column_list() -> None:
    first = named_rows(["shard", "head"], [(0, 1)])
    second = named_rows(["shard", "head"], [(1, 2), (2, 3)])
    other = named_rows(["shard", "tail"], [(0, 1)])
    assert type(first[0]) is type(second[0]) is type(second[1])
    assert type(other[0]) is not type(first[0])
    assert other[0].tail == 1


def test_names_no_namedtuple_accepts_fall_back_to_positional_ones_as_the_drivers_do() -> None:
    columns = ["count", "1st", "count"]
    assert named_rows(columns, [(1, 2, 3)])[0]._fields == named_tuple_factory(columns, [(1, 2, 3)])[0]._fields


def test_a_result_without_rows_makes_no_class() -> None:
    assert named_rows(["never", "made"], []) == []
