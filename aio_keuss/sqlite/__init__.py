"""SQLite: every role of the embedded database backend, in one folder.

``connection`` (options, the thread that owns the connection, schema migrations, error
translation) is at the bottom, with the SQL it loads from ``sql/``; the signal bus (a
table and ``PRAGMA data_version``), the stats store, the rate limiter and the result store
sit on it; ``store`` holds the queue
store and the backend that adds them. Only Python's standard ``sqlite3`` is needed.
"""
