"""Redis: every role this database plays, in one folder.

``connection`` (client, Cluster, keys, Lua scripts, error translation) is at the bottom;
the stores (``list``, ``oq``, ``reliable``, ``buckets``), the signal bus and the stats
store sit on it. Nothing here is imported until a Redis backend is asked for by name, so
``aio_keuss`` works without redis-py installed.
"""
