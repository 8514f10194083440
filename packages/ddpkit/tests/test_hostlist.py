"""SLURM node-list parsing without scontrol."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddpkit import expand_hostlist, first_host, parse_tasks_per_node


@pytest.mark.parametrize(
    ("expr", "hosts"),
    [
        ("gpu[001-004,007],cpu3", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu007", "cpu3"]),
        ("rack[1-2]-gpu[01-02]", ["rack1-gpu01", "rack1-gpu02", "rack2-gpu01", "rack2-gpu02"]),
        ("node-[1-3],login1", ["node-1", "node-2", "node-3", "login1"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),  # no padding: widths grow
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),  # padding from the low end
        ("a[9-10]b", ["a9b", "a10b"]),
        ("single", ["single"]),
        ("x[3]", ["x3"]),
        ("gpu[1-2] cpu[1,3]", ["gpu1", "gpu2", "cpu1", "cpu3"]),  # whitespace separates too
        ("nid[00001-00002],nid00009", ["nid00001", "nid00002", "nid00009"]),
        ("c[1-2],c1", ["c1", "c2", "c1"]),  # order and duplicates kept, like scontrol
        ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
        ("", []),
        ("   ", []),
    ],
)
def test_expand(expr: str, hosts: list[str]) -> None:
    assert expand_hostlist(expr) == hosts
    if hosts:
        assert first_host(expr) == hosts[0]


@pytest.mark.parametrize(
    ("expr", "named"),
    [
        ("gpu[1-3", "unclosed '['"),
        ("gpu1-3]", "unmatched ']'"),
        ("gpu[]", "empty brackets"),
        ("gpu[a-c]", "'a-c'"),
        ("gpu[1-2,x]", "'x'"),
        ("gpu[5-3]", "'5-3'"),
        ("gpu[1,,2]", "''"),
        ("gpu[1-2-3]", "'1-2-3'"),
        ("a,,b", "empty host name"),
        ("a,", "empty host name"),
        ("g[1[2]]", "nested '['"),
        ("n[1-99999999]", "more than"),
        ("n[1-1001]m[1-1000]", "1,001,000 hosts"),
    ],
)
def test_malformed_parts_are_named(expr: str, named: str) -> None:
    with pytest.raises(ValueError) as e:
        expand_hostlist(expr)
    assert named in str(e.value)
    assert "\n" not in str(e.value)


def test_first_host_checks_the_whole_list_but_expands_only_the_first() -> None:
    assert first_host("a[1-1000]b[1-1000]c[1-1000]") == "a1b1c1"  # 1e9 hosts, not expanded
    with pytest.raises(ValueError, match="'x'"):
        first_host("gpu[1-2],cpu[x]")
    with pytest.raises(ValueError, match="empty"):
        first_host("")


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prefix=st.from_regex(r"[a-z][a-z0-9-]{0,6}", fullmatch=True),
    lo=st.integers(0, 500),
    count=st.integers(1, 20),
    width=st.integers(1, 5),
)
def test_range_expansion_property(prefix: str, lo: int, count: int, width: int) -> None:
    lo_text = f"{lo:0{width}d}"
    hosts = expand_hostlist(f"{prefix}[{lo_text}-{lo + count - 1}]")
    assert len(hosts) == count
    assert hosts[0] == prefix + lo_text
    assert [int(h[len(prefix) :]) for h in hosts] == list(range(lo, lo + count))
    assert all(len(h) - len(prefix) >= len(lo_text) for h in hosts)


@pytest.mark.parametrize(
    ("expr", "counts"),
    [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,2,3", [1, 2, 3]), ("8(x2)", [8, 8])],
)
def test_tasks_per_node(expr: str, counts: list[int]) -> None:
    assert parse_tasks_per_node(expr) == counts


@pytest.mark.parametrize("expr", ["", "2(x)", "x", "2(3)", "2,,1", "-1"])
def test_tasks_per_node_malformed(expr: str) -> None:
    with pytest.raises(ValueError, match="expected counts like"):
        parse_tasks_per_node(expr)
