"""tierckptd: the per-node tierckpt daemon (local tier, peer replication, persistent drain).

Where things live:

- ``server`` (the Tierckpt gRPC service: validate, delegate to ``node``, translate proto) and
  ``rpc`` (the one exception-to-status mapping); ``main`` assembles everything.
- ``node``: saves through the commit protocol, catalog questions over all tiers (``views``),
  restore from the nearest tier (``restore``). ``repair``: a local copy reported corrupt is
  re-hashed before it is dropped, and replaced from a verified peer copy. ``datamgmt``: the
  operator verbs (rm, verify, persist), each a loop over the tiers.
- Three tiers, three packages that never import each other's modules: ``local/`` (the local
  dir: ``local.store.LocalStore`` for the save and restore paths, ``local.tier.LocalTier`` for
  the operator verbs), ``peer/`` and ``persistent/`` (each a ``tiers.RemoteTier`` facade in its
  ``tier.py``; the local tier's store and manifest are the one thing they share). ``tiers``: the
  contract with its call order. The remote tiers read the cluster only through ``cluster/``
  (ring rules in ``cluster.ring``, membership, catalog deltas).
- ``knobs`` (tuning constants, overridable with ``--knobs``), ``config`` (user configuration,
  frozen at the edge), ``backends/`` (object stores), ``metrics``, ``tls``.
- The shared kernel with the client is ``tierckpt.common`` (names, status, checksum, fileio) and
  ``tierckpt.errors``; importing them loads no client module.

Concurrency model (the whole daemon): one asyncio event loop (uvloop when installed) runs the
gRPC servers, the tiers' background tasks and all bookkeeping. Anything that may block — file
I/O in the local dir (open, write, fsync, rename, rmtree, hashing), object-store SDK calls,
bulk socket transfers — runs in a worker thread through :func:`tierckptd.offload.run_blocking`,
never on the loop. The local store guards its catalog with its own lock, so its methods are
safe from any thread; tiers keep their in-memory state on the loop and hand worker threads only
immutable inputs. Worker pools: the loop's default pool (file and store work), plus dedicated
pools owned by the peer tier (long-lived bulk connections) and the persistent tier (uploads and
downloads), passed as ``pool=`` so that a slow object store cannot starve local saves of
threads. The bulk server runs its own accept thread and one thread per connection.
"""

__version__ = "0.1.0"
