"""The acting side: the collector, inference from a policy snapshot and the numpy kernels
of every policy part. It imports no torch, so that a Ray runner or an external agent acts
without it (``tests/test_layers.py`` checks so in a fresh interpreter)."""
