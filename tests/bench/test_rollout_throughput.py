"""Server groups and path targets of bench.rollout_throughput (the layouts of docs/gpu-results.md "At scale")."""

import pytest

from bench.rollout_throughput import _server_spec, _slug, _target
from bench.throughput_report import baselines

GROUPS = {"a": ["http://h:1"], "c": ["http://h:2", "http://h:3", "http://h:4"]}


def test_server_spec_reads_count_and_api_servers() -> None:
    assert _server_spec("a=1x4") == ("a", (1, 4))
    assert _server_spec("c=3") == ("c", (3, 1))
    for bad in ("c", "=3", "c=x4", "c=3xx"):
        with pytest.raises(SystemExit):
            _server_spec(bad)


def test_target_picks_a_group_or_its_first_servers() -> None:
    assert _target("direct@a", GROUPS) == ("direct", ["http://h:1"])
    assert _target("proxy_on@c:1", GROUPS) == ("proxy_on", ["http://h:2"])
    assert _target("proxy_on@c", GROUPS) == ("proxy_on", GROUPS["c"])
    assert _target("direct", GROUPS) == ("direct", ["http://h:1", *GROUPS["c"]])
    with pytest.raises(SystemExit):
        _target("direct@b", GROUPS)


def test_rollout_ids_and_baselines_of_grouped_paths() -> None:
    assert _slug("proxy_on@c:1") == "proxy_on-c-1"
    paths = ["direct@a", "direct@c", "direct_same_ask", "proxy_on@c:1", "proxy_on@c"]
    assert baselines(paths) == ["direct@a", "direct@c", "direct_same_ask"]
