"""The Kubernetes names of casque's resources, written once for the operator, the CLI and the tests."""

from __future__ import annotations

GROUP = "casque.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

QUEUE_KIND = "Queue"
QUEUES = "queues"
SUBSCRIBER_KIND = "Subscriber"
SUBSCRIBERS = "subscribers"

# Held by every Queue and Subscriber the operator has seen, so that deleting one waits for
# its deletion policy to be carried out in Cassandra and ZooKeeper.
FINALIZER = f"{GROUP}/finalizer"
# kopf keeps its per-handler progress and the last handled spec in annotations with this prefix.
ANNOTATION_PREFIX = GROUP
