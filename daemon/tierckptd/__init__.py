"""tierckptd: the per-node tierckpt daemon (local tier, peer replication, persistent drain)."""

__version__ = "0.1.0"
