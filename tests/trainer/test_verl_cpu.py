"""`trainer.verl_cpu.gloo_interface`: the interface gloo binds to on a Ray worker."""

from __future__ import annotations

from trainer.verl_cpu import gloo_interface


def test_gloo_interface_is_the_one_that_reaches_the_master() -> None:
    import ray

    assert gloo_interface("127.0.0.1") == "lo"
    node_ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]  # the address Ray gives this host, as verl's MASTER_ADDR would be
    if node_ip != "127.0.0.1":
        assert gloo_interface(node_ip) not in (None, "lo")
    assert gloo_interface("::1") is None  # IPv6: gloo's choice is left as it is
