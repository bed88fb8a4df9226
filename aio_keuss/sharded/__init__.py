"""The sharded model (after IgnisMQ), written once: a queue over shards, each a magazine of
records with load and fire pointers, swept and shoveled by one elected leader.

A database provides only the storage contract (:mod:`.storage`); routing, the consumers'
rotation over ready shards, deadletter, sizes and the leader's loop live here.
"""
