"""Where pipeline stages of different device counts sit on the cluster (per-stage meshes
with device counts of their own, Alpa's inter-operator pass).

A stage's devices are one block of consecutive ranks. Its mesh's collectives are priced
as the translates of the group holding the mesh's device 0 (`DeviceMesh.placement`), which
is the block's own placement only when the block is aligned to the topology: either a
whole number of nodes starting at a node, or a power-of-two part of one node starting at
a multiple of its size. Those are Alpa's submesh shapes (Zheng et al., OSDI 2022, §5.2:
(1, 2^m) inside a node or (n, M) whole nodes), and any list of them that adds up to the
cluster can be laid out so (`stage_blocks`). One answer for the pricing, the search, the
plan builder and validate.
"""

from __future__ import annotations

from collections.abc import Sequence


def submesh_sizes(devices: int, per_node: int) -> list[int]:
    """The device counts a stage's block may take on `devices` devices of `per_node` per
    node, ascending: powers of two dividing a node, and whole numbers of nodes."""
    inside = [1 << k for k in range(per_node.bit_length()) if per_node % (1 << k) == 0]
    whole = [per_node * n for n in range(2, devices // per_node + 1)]
    return sorted({size for size in (*inside, *whole) if size <= devices})


def aligned(first: int, size: int, per_node: int) -> bool:
    """Whether a block of `size` ranks from `first` is one of the shapes above, aligned."""
    if size % per_node == 0:
        return first % per_node == 0
    return per_node % size == 0 and size & (size - 1) == 0 and first % size == 0


def stage_blocks(sizes: Sequence[int], per_node: int) -> list[range]:
    """Each stage's ranks, for stages of `sizes` devices: in stage order where every block
    lands aligned (the pipeline's sends then run between neighbouring blocks), else from
    the largest stage down (a power-of-two or whole-node block then always starts aligned:
    every earlier block is a multiple of its size), ties in stage order."""
    for order in (range(len(sizes)), sorted(range(len(sizes)), key=lambda k: -sizes[k])):
        blocks: list[range] = [range(0)] * len(sizes)
        first = 0
        for k in order:
            blocks[k] = range(first, first + sizes[k])
            first += sizes[k]
        if all(aligned(block.start, len(block), per_node) for block in blocks):
            return blocks
    raise ValueError(f"stage sizes {list(sizes)} are not submesh sizes of {per_node} "
                     "devices per node")


def stage_ranks(sizes: Sequence[int], per_node: int) -> list[range]:
    """Each stage's ranks: consecutive blocks where the stages hold as many devices (the
    pipeline axis outermost of one mesh), else their submeshes' (`stage_blocks`; raises
    ValueError where the counts are no submesh sizes)."""
    if len(set(sizes)) < 2:
        return [range(k * size, (k + 1) * size) for k, size in enumerate(sizes)]
    return stage_blocks(sizes, per_node)
