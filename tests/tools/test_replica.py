"""`tools/replica.py`: which front ends of a vLLM server answered, read from its access log."""

from __future__ import annotations

from pathlib import Path

from tools.replica import VllmReplica

# Access log lines as vLLM 0.27 writes them: with one API server the process is `APIServer`, with
# `--api-server-count N` each line names its process `ApiServer_<k>`.
ONE = '(APIServer pid=5) INFO:     127.0.0.1:40000 - "POST /v1/completions HTTP/1.1" 200 OK\n'
SEVERAL = ('(ApiServer_0 pid=7) INFO:     127.0.0.1:40001 - "POST /v1/chat/completions HTTP/1.1" 200 OK\n'
           '(ApiServer_1 pid=8) INFO:     127.0.0.1:40002 - "GET /health HTTP/1.1" 200 OK\n'
           '(ApiServer_1 pid=8) INFO:     127.0.0.1:40003 - "POST /v1/chat/completions HTTP/1.1" 200 OK\n')


def test_front_ends_served_since_an_offset(tmp_path: Path) -> None:
    replica = VllmReplica("unused-model", log_path=tmp_path / "replica.log")
    replica.log_path.write_text(ONE)
    assert replica.front_ends_served(0, "completions") == {"server"}
    assert replica.front_ends_served(0, "chat/completions") == set()  # another route
    offset = replica.log_size()
    assert replica.front_ends_served(offset, "completions") == set()  # nothing since
    several = VllmReplica("unused-model", log_path=tmp_path / "several.log", api_servers=2)
    several.log_path.write_text(ONE)
    offset = several.log_size()
    with open(several.log_path, "a") as log:
        log.write(SEVERAL)
        # Two processes' writes interleaved: a line cut from its process name names no front end.
        log.write('(ApiServer_0 pid=7) INFO:     (ApiServer_1 pid=8) INFO: 127.0.0.1:40004 - "GET /health HTTP/1.1"\n'
                  '127.0.0.1:40005 - "POST /v1/chat/completions HTTP/1.1" 200 OK\n')
    assert several.front_ends_served(offset, "chat/completions") == {"ApiServer_0", "ApiServer_1"}
    assert several.front_ends_served(offset, "completions") == set()  # a health probe is no answer
