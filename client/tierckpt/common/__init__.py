"""The kernel that the client (``tierckpt``) and the daemon (``tierckptd``) share on purpose.

Both sides must agree on these rules byte for byte, so they live in one place:

- :mod:`.names`: what a job, step, rank, shard and node id may be (DESIGN.md, Identity).
- :mod:`.status`: the one mapping between :class:`tierckpt.TierckptError` subclasses and gRPC
  status codes, both directions.
- :mod:`.checksum`: the one shard checksum (xxh3-64, 16 hex digits).
- :mod:`.fileio`: full ``pwrite``, checksum of a file, and the temp-write / fsync / rename steps
  of the commit protocol.

It is importable by the daemon and by integrations, but it is not part of the user API
(``tierckpt.__all__``); it may change with the wire contract.
"""
