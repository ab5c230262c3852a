"""Tests of this directory run against the content layout, the default; a test about the
per-shard layout (still written on request, and always read) says so with
``Rig(..., layout="per-shard")`` or ``--persistent-layout per-shard``."""
