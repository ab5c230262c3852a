"""The local tier: a RAM disk or NVMe directory on this node, written by the trainers.

:class:`~.store.LocalStore` is the save and restore paths' facade over the pieces (listed in
:mod:`.store`); :class:`~.tier.LocalTier` is the tier as the operator verbs see it. Nothing in
this package imports the peer or persistent tier.
"""
