"""MongoDB: every role this database plays, in one folder.

``connection`` (PyMongo's ``AsyncMongoClient``, collections, indexes, error translation) is
at the bottom; the stores (``store``, ``buckets``), the signal bus (change streams, else a
capped collection) and the stats store sit on it. Nothing here is imported until a MongoDB
backend is asked for by name, so ``aio_keuss`` works without PyMongo installed.
"""
