"""PostgreSQL: every role this database plays, in one folder.

``connection`` (pool, schema, advisory lock, migrations, error translation) is at the
bottom; the stores (``store``, ``buckets``), the signal bus (LISTEN / NOTIFY) and the stats
store sit on it. Nothing here is imported until a PostgreSQL backend is asked for by name,
so ``aio_keuss`` works without asyncpg installed.
"""
