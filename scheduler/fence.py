"""OP-Fence steps 1 and 2: cluster workers by bandwidth, order the clusters into a chain.

**Clustering** is single-linkage agglomeration on log-bandwidth, cut where bandwidth
drops sharply. Single linkage equals cutting the *maximum spanning tree* of the
bandwidth graph: a cluster is a set of workers joined by a chain of fast links. The tree
is built with Prim's algorithm on the (symmetrised, ``min(bw_ij, bw_ji)``) bandwidth
matrix — O(n²) with numpy, so 1,024 workers take milliseconds — and held in a
``networkx`` graph; the slowest tree edges of a cluster are cut when the next faster tree
edge is at least ``min_gap_ratio`` times faster, and the split recurses into the parts.
Equal links give one cluster; a lab on 10 Gbps, a site on 1 Gbps and a continent on
100 Mbps joined by 8 Mbps come apart into three.

**Ordering** chooses the chain of clusters that maximises the slowest link it uses
(then the sum of log-bandwidths, to prefer fast links overall); the link between two
clusters is their fastest worker pair. Exact by enumeration up to eight clusters,
greedy (widest next hop) beyond.
"""

from __future__ import annotations

import itertools
import logging
import math

import networkx as nx
import numpy as np

from scheduler.topology import Topology

logger = logging.getLogger(__name__)

#: A tree edge this many times slower than the next faster one separates clusters.
MIN_GAP_RATIO = 3.0
#: Up to this many clusters the chain order is found by enumeration.
EXACT_ORDER_LIMIT = 8


def symmetric_bandwidth(topology: Topology) -> np.ndarray:
    """``min(bw_ij, bw_ji)``: a link is only as fast as its slower direction."""
    bw = topology.bandwidth_matrix()
    sym = np.minimum(bw, bw.T)
    np.fill_diagonal(sym, np.inf)
    return sym


def maximum_spanning_tree(bandwidth: np.ndarray) -> nx.Graph:
    """Prim's algorithm on a dense matrix; edges carry ``bandwidth``."""
    n = bandwidth.shape[0]
    tree = nx.Graph()
    tree.add_nodes_from(range(n))
    if n <= 1:
        return tree
    in_tree = np.zeros(n, dtype=bool)
    in_tree[0] = True
    best = bandwidth[0].copy()
    parent = np.zeros(n, dtype=np.int64)
    best[0] = -np.inf
    for _ in range(n - 1):
        candidates = np.where(in_tree, -np.inf, best)
        j = int(np.argmax(candidates))
        tree.add_edge(int(parent[j]), j, bandwidth=float(bandwidth[parent[j], j]))
        in_tree[j] = True
        better = (bandwidth[j] > best) & ~in_tree
        best[better] = bandwidth[j][better]
        parent[better] = j
    return tree


def cluster_workers(topology: Topology, *, min_gap_ratio: float = MIN_GAP_RATIO) -> list[list[int]]:
    """Groups of worker indices joined by fast links, each sorted; groups in first-index order."""
    n = len(topology)
    if n == 0:
        return []
    tree = maximum_spanning_tree(symmetric_bandwidth(topology))
    clusters = _split(tree, set(range(n)), min_gap_ratio)
    return sorted((sorted(c) for c in clusters), key=lambda c: c[0])


def _split(tree: nx.Graph, nodes: set[int], min_gap_ratio: float) -> list[set[int]]:
    """Split off along the weakest tree edges when they are much slower than the rest.

    Scanning the cluster's tree edges from the slowest up, the first jump of at least
    ``min_gap_ratio`` between consecutive speeds separates the "between clusters" edges
    (all below the jump, cut) from the "inside clusters" ones; each part is then split the
    same way. A cluster whose edges have no such jump stays whole (jitter between equal
    links, or one link speed only).
    """
    sub = tree.subgraph(nodes)
    weights = sorted(d["bandwidth"] for _, _, d in sub.edges(data=True))
    threshold = None
    for slow, fast in zip(weights, weights[1:], strict=False):
        if slow <= 0 or fast / slow >= min_gap_ratio:
            threshold = slow
            break
    if threshold is None:
        return [nodes]
    kept = nx.Graph()
    kept.add_nodes_from(nodes)
    kept.add_edges_from((a, b) for a, b, d in sub.edges(data=True) if d["bandwidth"] > threshold)
    parts = [set(c) for c in nx.connected_components(kept)]
    # Workers left alone by the cut only had slow links; those slow links among themselves
    # are their fastest, so they form their own (slower) clusters: rejoin them.
    alone = {next(iter(p)) for p in parts if len(p) == 1}
    if len(alone) > 1:
        slow = nx.Graph()
        slow.add_nodes_from(alone)
        slow.add_edges_from((a, b) for a, b in sub.edges() if a in alone and b in alone)
        parts = [p for p in parts if len(p) > 1] + [set(c) for c in nx.connected_components(slow)]
    if len(parts) == 1:
        return parts
    out: list[set[int]] = []
    for part in parts:
        out.extend(_split(tree, part, min_gap_ratio))
    return out


def cluster_links(topology: Topology, clusters: list[list[int]]) -> np.ndarray:
    """Bandwidth between clusters: their fastest worker pair (bytes/s)."""
    bw = symmetric_bandwidth(topology)
    k = len(clusters)
    out = np.full((k, k), np.inf)
    for a in range(k):
        for b in range(k):
            if a != b:
                out[a, b] = bw[np.ix_(clusters[a], clusters[b])].max()
    return out


def order_clusters(topology: Topology, clusters: list[list[int]], *, start: int | None = None) -> list[int]:
    """Cluster indices in chain order, maximising the slowest inter-cluster link used.

    Args:
        start: force the chain to begin with this cluster (e.g. the one that holds the data).
    """
    k = len(clusters)
    if k <= 1:
        return list(range(k))
    links = cluster_links(topology, clusters)
    graph = nx.Graph()
    for a in range(k):
        for b in range(a + 1, k):
            graph.add_edge(a, b, bandwidth=float(links[a, b]))

    def score(chain: tuple[int, ...]) -> tuple[float, float]:
        hops = [graph[a][b]["bandwidth"] for a, b in zip(chain, chain[1:], strict=False)]
        return (min(hops), sum(math.log(h) for h in hops))

    if k <= EXACT_ORDER_LIMIT:
        chains = (
            c
            for c in itertools.permutations(range(k))
            if (start is None or c[0] == start) and (start is not None or c[0] < c[-1])
        )
        return list(max(chains, key=score))
    compute = [sum(topology.workers[w].effective_flops for w in c) for c in clusters]
    chain = [start if start is not None else int(np.argmax(compute))]
    left = set(range(k)) - set(chain)
    while left:
        nxt = max(left, key=lambda c: (graph[chain[-1]][c]["bandwidth"], compute[c]))
        chain.append(nxt)
        left.remove(nxt)
    return chain
