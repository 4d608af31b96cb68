"""Where a window's keys go: each key's owner, the order that groups keys by owner, the counts.

A window's unique keys are routed once, when the window is built (in the prefetch thread),
and the Routing travels with the window: warm, pull and push (hvctr.storage.exchange) send
along it instead of hashing owners and sorting again on every call.

    routing = route(keys, bucket_owner, world_size)   # keys: unique, the window's order
    routing.keys_by_owner   # keys[order]: what an alltoall sends, rank 0's keys first
    routing.splits          # how many of them go to each rank

``order`` is the stable argsort of the owners, so within one owner keys keep the window's
order: exactly what the exchange computed per call before, hence the same messages and the
same summation orders at the owners.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hvctr.formats import owner_of


@dataclass(frozen=True)
class Routing:
    """One set of unique keys, routed to their owners (see the module docstring)."""

    keys: np.ndarray  # uint64 [U], unique, in the caller's order (a window's: sorted)
    owner: np.ndarray  # int32 [U]: owning rank of each key
    order: np.ndarray  # int64 [U]: stable argsort of owner (groups keys by owner)
    splits: list[int]  # [world size]: keys per owner rank, in rank order
    keys_by_owner: np.ndarray  # uint64 [U]: keys[order]
    in_order: bool = False  # keys are grouped by owner already: order is the identity

    @property
    def world_size(self) -> int:
        return len(self.splits)

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    def grouped(self) -> "Routing":
        """The same keys in owner order (``keys_by_owner``; within an owner, this routing's
        order): its order is the identity, so an alltoall sends and receives rows in the keys'
        own order, and what a pull receives is the working set itself, with no scatter. The
        messages are the same as this routing's."""
        if self.in_order:
            return self
        return Routing(keys=self.keys_by_owner, owner=self.owner[self.order],
                       order=np.arange(len(self), dtype=np.int64), splits=self.splits,
                       keys_by_owner=self.keys_by_owner, in_order=True)

    def subset(self, positions: np.ndarray) -> "Routing":
        """The routing of ``keys[positions]`` (positions increasing, distinct), without hashing
        owners again; itself when the positions are all of its keys."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.shape[0] == len(self):  # distinct and increasing: 0 .. U-1
            return self
        return _grouped(self.keys[positions], self.owner[positions], self.world_size)


def route(keys: np.ndarray, bucket_owner: np.ndarray, world_size: int) -> Routing:
    """The Routing of ``keys`` (1-D uint64, unique: not checked here) under a bucket table."""
    owner = owner_of(keys, bucket_owner).astype(np.int32)
    return _grouped(keys, owner, world_size)


def _grouped(keys: np.ndarray, owner: np.ndarray, world_size: int) -> Routing:
    # A stable sort of small integers: numpy sorts 16-bit values by radix, in one linear pass.
    narrow = owner.astype(np.int16) if world_size <= np.iinfo(np.int16).max else owner
    order = np.argsort(narrow, kind="stable").astype(np.int64, copy=False)
    splits = np.bincount(owner, minlength=world_size).tolist()
    return Routing(keys=keys, owner=owner, order=order, splits=splits, keys_by_owner=keys[order])
