"""PostgreSQL: every role this database plays, in one folder.

``connection`` (pool, options, schema, advisory lock, migrations, error translation) is at
the bottom, with the SQL it loads from ``sql/`` (named statements, numbered migration
steps); the signal bus (LISTEN / NOTIFY) and the stats store sit on it; ``backend`` adds
them to the connection, and the stores (``store``, ``buckets``) build on that. Nothing here
is imported until a PostgreSQL backend is asked for by name, so ``aio_keuss`` works without
asyncpg installed.
"""
