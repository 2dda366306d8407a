"""``flowtrain calibrate``, in layers that import one way (lowest first): ``settings`` and
``timing``; the measurements (``host``, ``engine_pieces``, ``ops``, then ``collectives`` on
forked ranks, ``probe``); the launched jobs (``job`` is the worker, ``jobs`` runs it); the pure
fits (``fits``, ``factors``, ``profile_fit``); and ``command`` (argparse, ``measure``, ``main``).

Nothing is imported here, so that a lower layer loads without the ones above it.
"""
