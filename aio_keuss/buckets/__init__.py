"""The bucket engine, written once: many messages per stored record, leased by consumers.

A database provides only the storage contract (a handful of atomic primitives over whole
buckets); pushing, holding leased buckets in memory, and writing their state back live here.
"""
