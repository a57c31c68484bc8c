"""Who owns which prefix: chained block hashes, the consistent-hash ring, hot overrides.

Pure functions of a pool's membership (with its version): every router computes the same
owners from the same membership, and the fleet simulator runs the same code.
"""

from controlplane.ownership.blocks import block_hashes, prefix_key
from controlplane.ownership.membership import Membership
from controlplane.ownership.overrides import HotPrefix, HotPrefixOverride, HotPrefixTable
from controlplane.ownership.ring import DEFAULT_VNODES, OwnershipRing

__all__ = [
    "DEFAULT_VNODES",
    "HotPrefix",
    "HotPrefixOverride",
    "HotPrefixTable",
    "Membership",
    "OwnershipRing",
    "block_hashes",
    "prefix_key",
]
