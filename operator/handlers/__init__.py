"""kopf handlers: thin adapters that run a reconcile flow and report its outcome to Kubernetes."""
