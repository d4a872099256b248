"""Topology files and the Topology type: shipped files, link-rule specificity, errors, JSON."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fusion.errors import PlanError
from scheduler.topology import DEFAULT_FLOPS, Topology, WorkerSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
TOPOLOGIES = REPO_ROOT / "testbeds" / "topologies"
SHIPPED = ("lab-10g", "two-sites", "three-continents", "volunteers")

MBPS = 1e6 / 8  # bytes/s in one megabit/s


def mbps(t: Topology, a: str, b: str) -> float:
    return t.bandwidth_bytes_per_s[t.index(a)][t.index(b)] / MBPS


def ms(t: Topology, a: str, b: str) -> float:
    return t.latency_s[t.index(a)][t.index(b)] * 1e3


def toml(hosts: str, links: str = "") -> str:
    return hosts + "\n" + links


TWO_CLUSTERS = """
[[hosts]]
name = "a-1"
cluster = "A"
[[hosts]]
name = "a-2"
cluster = "A"
[[hosts]]
name = "b-1"
cluster = "B"
[[hosts]]
name = "b-2"
cluster = "B"
"""

BASE_LINKS = """
[[links]]
from = "A"
to = "A"
bandwidth_mbps = 1000
[[links]]
from = "B"
to = "B"
bandwidth_mbps = 1000
[[links]]
from = "A"
to = "B"
bandwidth_mbps = 100
latency_ms = 20
"""


def link(src: str, dst: str, bw: float = 50, lat: float | None = None) -> str:
    extra = "" if lat is None else f"latency_ms = {lat}\n"
    return f'[[links]]\nfrom = "{src}"\nto = "{dst}"\nbandwidth_mbps = {bw}\n{extra}'


# --- shipped files ------------------------------------------------------------------


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_file_parses_and_covers_every_pair(name: str) -> None:
    path = TOPOLOGIES / f"{name}.toml"
    assert path.read_text().startswith("#"), "each file opens with a comment saying what it models"
    t = Topology.load(path)
    bw, lat = t.bandwidth_matrix(), t.latency_matrix()
    n = len(t)
    assert bw.shape == lat.shape == (n, n)
    off = ~np.eye(n, dtype=bool)
    assert np.all(np.isinf(np.diag(bw))) and np.all(np.diag(lat) == 0.0)
    assert np.all(np.isfinite(bw[off])) and np.all(bw[off] >= 8 * MBPS)
    assert np.all(lat[off] >= 0.0)
    for w in t.workers:
        assert 1e11 <= w.flops <= 1e15
        assert w.memory_bytes is not None and w.memory_bytes % 2**30 == 0


def test_lab_10g() -> None:
    t = Topology.load(TOPOLOGIES / "lab-10g.toml")
    assert len(t) == 4 and list(t.clusters()) == ["lab"]
    bw = t.bandwidth_matrix()
    assert np.all(bw[~np.eye(4, dtype=bool)] == 10_000 * MBPS)
    assert ms(t, "lab-1", "lab-4") == pytest.approx(0.1)


def test_two_sites() -> None:
    t = Topology.load(TOPOLOGIES / "two-sites.toml")
    assert t.clusters() == {"site-a": [0, 1], "site-b": [2, 3]}
    for site in t.clusters().values():
        i, j = (t.names()[k] for k in site)
        assert mbps(t, i, j) == mbps(t, j, i) == 1000
        assert ms(t, i, j) == pytest.approx(0.5)
    for a in ("a-1", "a-2"):
        for b in ("b-1", "b-2"):
            assert mbps(t, a, b) == mbps(t, b, a) == 100
            assert ms(t, a, b) == ms(t, b, a) == pytest.approx(20)
    np.testing.assert_array_equal(t.bandwidth_matrix(), t.bandwidth_matrix().T)


def test_three_continents() -> None:
    t = Topology.load(TOPOLOGIES / "three-continents.toml")
    assert {k: len(v) for k, v in t.clusters().items()} == {"us": 2, "eu": 2, "asia": 2}
    assert mbps(t, "us-1", "us-2") == 10_000
    assert mbps(t, "eu-1", "eu-2") == 1000
    assert mbps(t, "asia-1", "asia-2") == 100
    assert (mbps(t, "us-1", "eu-2"), ms(t, "eu-2", "us-1")) == (100, pytest.approx(40))
    assert (mbps(t, "asia-1", "eu-1"), ms(t, "eu-1", "asia-2")) == (8, pytest.approx(120))
    assert (mbps(t, "asia-2", "us-2"), ms(t, "us-1", "asia-1")) == (8, pytest.approx(150))
    np.testing.assert_array_equal(t.bandwidth_matrix(), t.bandwidth_matrix().T)
    np.testing.assert_array_equal(t.latency_matrix(), t.latency_matrix().T)


def test_volunteers() -> None:
    t = Topology.load(TOPOLOGIES / "volunteers.toml")
    assert len(t) == 5
    assert t.clusters() == {w.name: [i] for i, w in enumerate(t.workers)}, "each host its own cluster"
    bw, lat = t.bandwidth_matrix() / MBPS, t.latency_matrix() * 1e3
    off = ~np.eye(5, dtype=bool)
    assert bw[off].min() == 8 and bw[off].max() == 100
    assert lat[off].min() >= 10 and lat[off].max() <= 60
    assert np.all(lat == lat.T)
    assert len({w.flops for w in t.workers}) >= 3
    assert all(4 * 2**30 <= w.memory_bytes <= 16 * 2**30 for w in t.workers if w.memory_bytes)
    # home-3's ADSL: slow upload, download as its peers allow.
    h3 = t.index("home-3")
    for j in range(5):
        if j != h3:
            assert bw[h3, j] == 8 and bw[j, h3] == 20
    others = [i for i in range(5) if i != h3]
    sub = bw[np.ix_(others, others)]
    np.testing.assert_array_equal(sub, sub.T)


# --- units and defaults ---------------------------------------------------------------


def test_units_and_defaults() -> None:
    t = Topology.from_toml(
        toml(
            '[[hosts]]\nname = "x"\ncluster = "c"\nflops = 2.0e12\nmemory_gb = 16\nslowdown = 2.0\n'
            '[[hosts]]\nname = "y"\n',
            link("x", "y", bw=100, lat=80),
        )
    )
    x, y = t.workers
    assert t.bandwidth_bytes_per_s[0][1] == 12.5e6
    assert t.latency_s[0][1] == pytest.approx(0.08)
    assert x.memory_bytes == 16 * 2**30 and x.effective_flops == 1.0e12
    assert (y.cluster, y.flops, y.memory_bytes, y.slowdown) == ("y", DEFAULT_FLOPS, None, 1.0)
    assert t.bandwidth_bytes_per_s[1][0] == 12.5e6, "links are symmetric"


def test_latency_defaults_to_zero() -> None:
    t = Topology.from_toml(toml('[[hosts]]\nname = "x"\n[[hosts]]\nname = "y"\n', link("x", "y")))
    assert t.latency_s[0][1] == t.latency_s[1][0] == 0.0


def test_single_host_needs_no_links() -> None:
    t = Topology.from_toml('[[hosts]]\nname = "solo"\n')
    assert len(t) == 1 and t.bandwidth_bytes_per_s == ((math.inf,),)


# --- specificity ------------------------------------------------------------------------


def test_cluster_rules_and_intra_cluster_links() -> None:
    t = Topology.from_toml(toml(TWO_CLUSTERS, BASE_LINKS))
    assert mbps(t, "a-1", "a-2") == mbps(t, "b-2", "b-1") == 1000
    assert mbps(t, "a-2", "b-1") == mbps(t, "b-1", "a-2") == 100
    assert ms(t, "b-2", "a-1") == pytest.approx(20)
    assert ms(t, "a-1", "a-2") == 0.0


def test_host_rule_beats_cluster_rule() -> None:
    t = Topology.from_toml(toml(TWO_CLUSTERS, BASE_LINKS + link("a-1", "b-1", bw=10)))
    assert mbps(t, "a-1", "b-1") == mbps(t, "b-1", "a-1") == 10
    assert mbps(t, "a-1", "b-2") == 100


def test_host_cluster_rule_beats_cluster_rule_and_loses_to_host_rule() -> None:
    t = Topology.from_toml(toml(TWO_CLUSTERS, BASE_LINKS + link("a-1", "B", bw=20) + link("a-1", "b-2", bw=5)))
    assert mbps(t, "a-1", "b-1") == mbps(t, "b-1", "a-1") == 20
    assert mbps(t, "a-1", "b-2") == mbps(t, "b-2", "a-1") == 5
    assert mbps(t, "a-2", "b-1") == 100


def test_host_rule_inside_a_cluster() -> None:
    t = Topology.from_toml(toml(TWO_CLUSTERS, BASE_LINKS + link("a-1", "a-2", bw=40)))
    assert mbps(t, "a-2", "a-1") == 40 and mbps(t, "b-1", "b-2") == 1000


def test_reverse_rule_overrides_symmetry() -> None:
    t = Topology.from_toml(toml(TWO_CLUSTERS, BASE_LINKS + link("B", "A", bw=30, lat=25)))
    assert mbps(t, "a-1", "b-1") == 100 and ms(t, "a-1", "b-1") == pytest.approx(20)
    assert mbps(t, "b-1", "a-1") == 30 and ms(t, "b-1", "a-1") == pytest.approx(25)


def test_more_specific_forward_rule_beats_exact_reverse_rule() -> None:
    # b-1 -> a-1 is covered exactly by B -> A (specificity 0) and, reversed, by a-1 -> b-1 (2).
    t = Topology.from_toml(toml(TWO_CLUSTERS, BASE_LINKS + link("B", "A", bw=30) + link("a-1", "b-1", bw=7)))
    assert mbps(t, "b-1", "a-1") == mbps(t, "a-1", "b-1") == 7
    assert mbps(t, "b-2", "a-1") == 30


def test_reverse_host_rule_overrides_host_rule() -> None:
    t = Topology.from_toml(toml(TWO_CLUSTERS, BASE_LINKS + link("a-1", "b-1", bw=50) + link("b-1", "a-1", bw=9)))
    assert (mbps(t, "a-1", "b-1"), mbps(t, "b-1", "a-1")) == (50, 9)


def test_host_alone_in_cluster_named_like_itself() -> None:
    hosts = '[[hosts]]\nname = "solo"\ncluster = "solo"\n' + TWO_CLUSTERS
    t = Topology.from_toml(toml(hosts, BASE_LINKS + link("solo", "A", bw=11) + link("B", "solo", bw=12)))
    assert mbps(t, "a-2", "solo") == 11 and mbps(t, "solo", "b-1") == 12


def test_equal_rules_that_disagree_are_a_conflict() -> None:
    with pytest.raises(PlanError, match=r"a-1 -> b-1.*host-to-host"):
        Topology.from_toml(toml(TWO_CLUSTERS, BASE_LINKS + link("a-1", "B", bw=20) + link("A", "b-1", bw=30)))
    t = Topology.from_toml(
        toml(TWO_CLUSTERS, BASE_LINKS + link("a-1", "B", bw=20) + link("A", "b-1", bw=30) + link("a-1", "b-1", bw=1))
    )
    assert mbps(t, "a-1", "b-1") == 1


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        (
            '[[hosts]]\nname = "x"\nflop = 3\n',
            r"hosts\[0\] \('x'\): unknown key\(s\) \['flop'\]; allowed: name, cluster",
        ),
        (
            toml('[[hosts]]\nname = "x"\n[[hosts]]\nname = "y"\n', link("x", "y") + "speed = 3\n"),
            r"links\[0\] \(x -> y\): unknown key\(s\) \['speed'\]",
        ),
        ('[[hosts]]\nname = "x"\n[[hosts]]\nname = "x"\n', r"duplicate host name\(s\) \['x'\]"),
        (
            toml('[[hosts]]\nname = "x"\n[[hosts]]\nname = "y"\n', link("x", "z")),
            r"to = 'z' is neither a host nor a cluster",
        ),
        (
            toml('[[hosts]]\nname = "x"\n[[hosts]]\nname = "y"\n', link("x", "y", bw=0)),
            r"links\[0\] \(x -> y\): bandwidth_mbps .* positive",
        ),
        (toml('[[hosts]]\nname = "x"\n[[hosts]]\nname = "y"\n', link("x", "y", bw=-5)), r"bandwidth_mbps"),
        (
            toml('[[hosts]]\nname = "x"\n[[hosts]]\nname = "y"\n', link("x", "y", lat=-1)),
            r"latency_ms must be a number >= 0",
        ),
        (
            toml('[[hosts]]\nname = "x"\n[[hosts]]\nname = "y"\n', '[[links]]\nfrom = "x"\nto = "y"\n'),
            r"bandwidth_mbps is required",
        ),
        (
            toml('[[hosts]]\nname = "x"\n[[hosts]]\nname = "y"\n', link("x", "y") + link("x", "y", bw=9)),
            r"links\[1\] \(x -> y\): duplicate of links\[0\]",
        ),
        (toml('[[hosts]]\nname = "x"\n[[hosts]]\nname = "y"\n', link("x", "x")), r"from host 'x' to itself"),
        ('[[hosts]]\nname = "x"\n[[hosts]]\nname = "y"\n', r"no link rule covers x -> y .*cluster-level"),
        (
            TWO_CLUSTERS + link("A", "A") + link("A", "B"),
            r"no link rule covers b-1 -> b-2 \(clusters 'B' and 'B'\).*\n.*\nfrom = \"B\"\nto = \"B\"",
        ),
        (
            '[[hosts]]\nname = "A"\n[[hosts]]\nname = "y"\ncluster = "A"\n',
            r"'A' is both a host and the cluster label of \['A', 'y'\]",
        ),
        (
            '[[hosts]]\nname = "x"\ncluster = "y"\n[[hosts]]\nname = "y"\n',
            r"'y' is both a host and the cluster label of \['x', 'y'\]",
        ),
        (
            '[[hosts]]\nname = "x"\ncluster = "y"\n[[hosts]]\nname = "y"\ncluster = "z"\n',
            r"'y' is both a host and the cluster label of \['x'\]",
        ),
        ('[[hosts]]\nname = "x"\nflops = 0\n', r"hosts\[0\] \('x'\).*flops must be a positive"),
        ('[[hosts]]\nname = "x"\nslowdown = 0.5\n', r"slowdown must be a finite number >= 1.0"),
        ('[[hosts]]\nname = "x"\nmemory_gb = -1\n', r"memory_gb must be positive"),
        ('[[hosts]]\nname = "x"\nflops = "fast"\n', r"flops must be a number"),
        ('[[hosts]]\ncluster = "c"\n', r"hosts\[0\]: 'name' is required"),
        ("", r"no hosts"),
        ('[[hosts]]\nname = "x"\n[network]\nmtu = 1500\n', r"unknown top-level key\(s\) \['network'\]"),
    ],
)
def test_invalid_topologies(text: str, pattern: str) -> None:
    with pytest.raises(PlanError, match=pattern) as info:
        Topology.from_toml(text, source="bad.toml")
    assert str(info.value).startswith("bad.toml: ")


def test_toml_syntax_error_names_file_and_line() -> None:
    with pytest.raises(PlanError, match=r"^bad.toml:3: invalid TOML"):
        Topology.from_toml('[[hosts]]\nname = "x"\nflops = = 3\n', source="bad.toml")


def test_load_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text('[[hosts]]\nname = "x"\n[[hosts]]\nname = "y"\n')
    with pytest.raises(PlanError, match=str(path)):
        Topology.load(path)
    with pytest.raises(PlanError, match="cannot read topology file"):
        Topology.load(tmp_path / "missing.toml")


def test_unknown_host_index() -> None:
    t = Topology.load(TOPOLOGIES / "two-sites.toml")
    with pytest.raises(PlanError, match=r"unknown host 'c-1'"):
        t.index("c-1")


def test_direct_construction_is_validated() -> None:
    w = (WorkerSpec(name="x", cluster="x"), WorkerSpec(name="y", cluster="y"))
    inf = math.inf
    ok = Topology(workers=w, bandwidth_bytes_per_s=[[inf, 1.0], [2.0, inf]], latency_s=[[0, 0.1], [0.2, 0]])
    assert ok.bandwidth_bytes_per_s == ((inf, 1.0), (2.0, inf)), "lists become tuples"
    hash(ok)
    with pytest.raises(PlanError, match=r"must be 2x2"):
        Topology(workers=w, bandwidth_bytes_per_s=[[inf]], latency_s=[[0, 0], [0, 0]])
    with pytest.raises(PlanError, match=r"link x -> y: bandwidth"):
        Topology(workers=w, bandwidth_bytes_per_s=[[inf, 0.0], [1.0, inf]], latency_s=[[0, 0], [0, 0]])
    with pytest.raises(PlanError, match=r"diagonal"):
        Topology(workers=w, bandwidth_bytes_per_s=[[1.0, 1.0], [1.0, inf]], latency_s=[[0, 0], [0, 0]])
    with pytest.raises(PlanError, match=r"duplicate worker name"):
        Topology(workers=(w[0], w[0]), bandwidth_bytes_per_s=[[inf, 1.0], [1.0, inf]], latency_s=[[0, 0], [0, 0]])
    with pytest.raises(PlanError, match=r"at least one worker"):
        Topology(workers=(), bandwidth_bytes_per_s=(), latency_s=())
    with pytest.raises(PlanError, match=r"memory_bytes"):
        WorkerSpec(name="x", cluster="x", memory_bytes=0)


# --- JSON, subset, transfer time, measurements ----------------------------------------------


@pytest.mark.parametrize("name", SHIPPED)
def test_json_round_trip(name: str) -> None:
    t = Topology.load(TOPOLOGIES / f"{name}.toml")
    text = t.to_json()
    doc = json.loads(text)
    assert doc["bandwidth_bytes_per_s"][0][0] is None, "inf is encoded as null"
    assert Topology.from_json(text) == t
    assert Topology.from_dict(t.to_dict()) == t
    unpaced = dataclasses.replace(t, paced_sends=False)
    assert Topology.from_dict(unpaced.to_dict()) == unpaced != t
    assert unpaced.subset(range(len(t))).paced_sends is False
    with pytest.raises(PlanError, match="paced_sends must be true or false"):
        Topology.from_dict(unpaced.to_dict() | {"paced_sends": "no"})


def test_from_json_rejects_bad_documents() -> None:
    with pytest.raises(PlanError, match="not valid JSON"):
        Topology.from_json("{")
    with pytest.raises(PlanError, match="not a valid topology document"):
        Topology.from_json('{"workers": []}')
    with pytest.raises(PlanError, match=r"unknown key\(s\) \['hosts'\]"):
        Topology.from_json('{"hosts": []}')


def test_subset() -> None:
    t = Topology.load(TOPOLOGIES / "three-continents.toml")
    idx = [t.index("asia-2"), t.index("us-1"), t.index("eu-1")]
    s = t.subset(idx)
    assert s.names() == ["asia-2", "us-1", "eu-1"]
    np.testing.assert_array_equal(s.bandwidth_matrix(), t.bandwidth_matrix()[np.ix_(idx, idx)])
    np.testing.assert_array_equal(s.latency_matrix(), t.latency_matrix()[np.ix_(idx, idx)])
    assert s.clusters() == {"asia": [0], "us": [1], "eu": [2]}
    with pytest.raises(PlanError, match="repeat"):
        t.subset([0, 0])
    with pytest.raises(PlanError, match="not worker indices"):
        t.subset([0, 6])


def test_transfer_s() -> None:
    t = Topology.load(TOPOLOGIES / "three-continents.toml")
    us, asia = t.index("us-1"), t.index("asia-1")
    assert t.transfer_s(us, asia, 1e6) == pytest.approx(0.150 + 1e6 / (8e6 / 8))
    assert t.transfer_s(us, us, 1e9) == 0.0
    assert t.transfer_s(us, asia, 0) == pytest.approx(0.150)


def test_matrices_are_float64_copies() -> None:
    t = Topology.load(TOPOLOGIES / "lab-10g.toml")
    bw = t.bandwidth_matrix()
    assert bw.dtype == np.float64 and t.latency_matrix().dtype == np.float64
    bw[0, 1] = 1.0
    assert t.bandwidth_matrix()[0, 1] == 10_000 * MBPS


def test_from_measurements() -> None:
    workers = [WorkerSpec(name=f"w{i}", cluster="c", flops=1e12 * (i + 1)) for i in range(3)]
    lat = np.full((3, 3), 0.01)
    bw = np.array([[0.0, 1e6, 2e6], [1e6, 0.0, 3e6], [2e6, 3e6, 0.0]])  # diagonal ignored
    t = Topology.from_measurements(workers, lat, bw)
    assert t.bandwidth_bytes_per_s[1][2] == 3e6 and t.bandwidth_bytes_per_s[1][1] == math.inf
    assert t.latency_s[2][2] == 0.0 and t.latency_s[0][2] == 0.01
    assert Topology.from_measurements(workers, lat.tolist(), bw.tolist()) == t
    with pytest.raises(PlanError, match=r"latency_s has shape \(2, 2\); 3 workers need \(3, 3\)"):
        Topology.from_measurements(workers, np.zeros((2, 2)), bw)
    with pytest.raises(PlanError, match=r"bandwidth_bytes_per_s has shape \(2, 3\)"):
        Topology.from_measurements(workers, lat, [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    with pytest.raises(PlanError, match=r"bandwidth_bytes_per_s must be a 3x3 matrix"):
        Topology.from_measurements(workers, lat, [[1.0, 2.0, 3.0], [1.0, 2.0]])
    with pytest.raises(PlanError, match=r"latency_s has shape \(3, 3\); 2 workers need \(2, 2\)"):
        Topology.from_measurements(workers[:2], lat, bw)
    bw_nan = bw.copy()
    bw_nan[0, 2] = np.nan
    with pytest.raises(PlanError, match=r"no measurement for w0 -> w2"):
        Topology.from_measurements(workers, lat, bw_nan)
    bw_neg = bw.copy()
    bw_neg[1, 0] = -1.0
    with pytest.raises(PlanError, match=r"link w1 -> w0: bandwidth must be positive"):
        Topology.from_measurements(workers, lat, bw_neg)


def test_import_does_not_import_torch() -> None:
    code = "import scheduler.topology, sys; assert 'torch' not in sys.modules, 'torch imported'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
