"""A replica URL with `user:password@` is used to connect, and never shown: not in the proxy's log
(its settings line, replica events), `/metrics`, the admin API, the dashboard or call records,
where it reads `http://***@host:port`. The admin API finds a replica again by that shown URL
(the trainer drives replicas with the URLs `GET /admin/replicas` lists).

A real `rolltap-proxy` process at DEBUG, the fault replica, both databases.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from proxy.upstream import shown_url
from tests.support.fault_replica import FaultReplica
from tests.support.proxy_process import ProxyProcess
from tests.support.servers import free_port, serve_in_thread

SECRET = "s3cret-pw-4f1e"
ADMIN = {"authorization": "Bearer t"}


def test_shown_url_hides_only_the_userinfo() -> None:
    assert shown_url("http://u:pw@h:8000/x?q=1") == "http://***@h:8000/x?q=1"
    assert shown_url("https://only-user@h") == "https://***@h"
    assert shown_url("http://u:p@ss@h:1") == "http://***@h:1"  # the last @ ends the userinfo
    assert shown_url("http://h:8000") == "http://h:8000"
    assert shown_url("http://[::1") == "<unparsable replica URL>"


def test_replica_credentials_never_appear(db_url: str, tmp_path: Path) -> None:
    with serve_in_thread(FaultReplica()) as (replica, _):
        port = replica.rsplit(":", 1)[1]
        live = f"http://rolltap:{SECRET}@127.0.0.1:{port}"
        dead = f"http://rolltap:{SECRET}-dead@127.0.0.1:{free_port()}"  # nothing listens: probes fail
        proxy = ProxyProcess(tmp_path, db_url, [live, dead], free_port(), ROLLTAP_PROXY__ADMIN_TOKEN="t",
                             ROLLTAP_PROXY__LOG_LEVEL="debug")
        shown: list[str] = []
        try:
            proxy.start()
            with httpx.Client(base_url=proxy.url, timeout=30) as client:
                chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                assert client.post("/rollout/r/attempt/0/v1/chat/completions", json=chat).status_code == 200
                shown.append(client.get("/rollout/r/attempt/0").text)
                listed = client.get("/admin/replicas", headers=ADMIN)
                shown += [listed.text, client.get("/metrics").text]
                shown += [client.get(page, headers=ADMIN).text for page in ("/ui", "/ui/charts", "/ui/attempt/r/0")]
                urls = [r["url"] for r in listed.json()["data"]]
                assert urls == [f"http://***@127.0.0.1:{port}", shown_url(dead)]
                # Found again by the shown URL; answers show it too.
                drained = client.post("/admin/replicas/drain", json={"url": urls[1]}, headers=ADMIN)
                assert drained.status_code == 200 and drained.json()["url"] == urls[1], drained.text
                added = client.post("/admin/replicas", json={"url": f"http://a:{SECRET}@127.0.0.1:9"}, headers=ADMIN)
                assert added.status_code == 201, added.text
                again = client.post("/admin/replicas", json={"url": f"http://a:{SECRET}@127.0.0.1:9"}, headers=ADMIN)
                shown += [added.text, again.text]
                assert again.status_code == 409
                removed = client.delete("/admin/replicas", params={"url": "http://***@127.0.0.1:9"}, headers=ADMIN)
                assert removed.status_code == 200, removed.text
        finally:
            proxy.stop()
    log = proxy.log_path.read_text()
    assert "***@127.0.0.1" in log and "replica http://***@" in log  # the settings line and replica events
    for text in [*shown, log]:
        assert SECRET not in text
    assert f"http://***@127.0.0.1:{port}" in shown[0]  # the call record names its replica, shown
