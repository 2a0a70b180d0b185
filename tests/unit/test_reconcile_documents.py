"""The documents `casque apply -f` reads: the custom resources' YAML, checked before anything runs."""

from __future__ import annotations

import pytest

from casque.cli.apply import read_documents
from casque.errors import InvalidSpec

GOOD = """
apiVersion: casque.io/v1alpha1
kind: Queue
metadata: {name: orders, namespace: shop}
spec: {shards: 2, retention: 1h}
---
# an empty document is skipped
---
apiVersion: casque.io/v1alpha1
kind: Subscriber
metadata: {name: billing}
spec: {queue: orders, startPosition: earliest}
---
apiVersion: casque.io/v1alpha1
kind: Queue
metadata: {name: defaults}
"""


def test_documents_are_read_in_order_with_namespaces() -> None:
    documents = read_documents(GOOD, "q.yaml")
    assert [(d.kind, d.namespace, d.name) for d in documents] == [
        ("Queue", "shop", "orders"),
        ("Subscriber", "default", "billing"),
        ("Queue", "default", "defaults"),
    ]
    assert documents[2].spec == {}
    assert [d.namespace for d in read_documents(GOOD, "q.yaml", namespace="dev")] == ["dev"] * 3


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: [", "q.yaml: not valid YAML at line 1, column 5: expected the node content, but found '<stream end>'"),
        ("", "q.yaml: no Queue or Subscriber documents"),
        ("- 1\n", "q.yaml: a document must be a mapping"),
        ("apiVersion: v1\nkind: Queue\nmetadata: {name: q}\n", "apiVersion must be casque.io/v1alpha1, not 'v1'"),
        ("apiVersion: casque.io/v1alpha1\nkind: Topic\nmetadata: {name: q}\n", "kind must be Queue or Subscriber"),
        ("apiVersion: casque.io/v1alpha1\nkind: Queue\nmetadata: {}\n", "metadata.name is missing"),
        ("apiVersion: casque.io/v1alpha1\nkind: Queue\nmetadata: {name: q}\nspec: [1]\n", "spec must be a mapping"),
        (
            "apiVersion: casque.io/v1alpha1\nkind: Queue\nmetadata: {name: q}\nspec: {shards: 0}\n",
            "q.yaml: Queue q: spec.shards: Input should be greater than or equal to 1",
        ),
        (
            "apiVersion: casque.io/v1alpha1\nkind: Queue\nmetadata: {name: Big_Q}\n",
            "q.yaml: Queue Big_Q: queue name 'Big_Q' must be a DNS label",
        ),
        (
            "apiVersion: casque.io/v1alpha1\nkind: Subscriber\nmetadata: {name: s}\nspec: {queue: q, deadLetterQueue: q}\n",
            "deadLetterQueue must be another queue",
        ),
    ],
)
def test_bad_documents_are_refused_with_one_readable_line(text: str, message: str) -> None:
    with pytest.raises(InvalidSpec) as refused:
        read_documents(text, "q.yaml")
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_bad_document_is_named_by_its_position() -> None:
    text = GOOD + "---\napiVersion: casque.io/v1alpha1\nkind: Queue\nmetadata: {name: q}\nspec: {retention: 10s}\n"
    with pytest.raises(InvalidSpec, match=r"^q.yaml#5: Queue q: spec.retention"):
        read_documents(text, "q.yaml")


def test_duplicates_are_refused() -> None:
    text = "apiVersion: casque.io/v1alpha1\nkind: Queue\nmetadata: {name: q}\n---\n" * 2
    with pytest.raises(InvalidSpec, match="appears twice"):
        read_documents(text, "q.yaml")
