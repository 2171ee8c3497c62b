"""Helpers of tests/test_serve_faults.py: poisoned sampling, a served process and its log, raw
HTTP clients that flood or upload faster than any library client."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

POISON = 666_000_666  # a request seeded with it has its sampling fail (see `poisoned_sampling`)
KEY = "sekrit-key"


@contextlib.contextmanager
def poisoned_sampling(engine):
    """torch.multinomial fails, as it does on a nan distribution (what temperature=1e-300 made
    before the door refused it), for every sequence whose generator was seeded with POISON.
    Records the running batch size each time it strikes."""
    real, struck = torch.multinomial, []

    def multinomial(probs, num_samples, *args, generator=None, **kw):
        if generator is not None and generator.initial_seed() == POISON:
            struck.append(engine.batch_size)
            probs = torch.full_like(probs, float("nan"))
        return real(probs, num_samples, *args, generator=generator, **kw)

    torch.multinomial = multinomial
    try:
        yield struck
    finally:
        torch.multinomial = real


def wait_idle(engine, seconds: float = 5.0) -> bool:
    """True once the engine holds no sequence (it releases a finished one just after its last event)."""
    deadline = time.monotonic() + seconds
    while not engine.idle() and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.idle()


@dataclass
class Proc:
    url: str
    proc: subprocess.Popen
    log: Path

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {KEY}"}

    def assert_clean_log(self) -> None:
        text = self.log.read_text(errors="replace")
        assert "Traceback" not in text and "Exception in ASGI" not in text, text[-3000:]

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024


def upload(url: str, headers: dict, body: bytes) -> tuple[bytes, float, int]:
    """(the response's first bytes, seconds until they came, body bytes sent by then): a client
    that sends as fast as the server takes while it watches for an early answer."""
    host, port = url.removeprefix("http://").split(":")
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    t0, sent = time.monotonic(), 0
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{head}\r\n"
                     .encode())
        sock.setblocking(False)
        while time.monotonic() - t0 < 30:
            try:
                data = sock.recv(1 << 12)
                return data, time.monotonic() - t0, sent
            except BlockingIOError:
                pass
            try:
                sent += sock.send(body[sent:sent + (1 << 20)])
            except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                time.sleep(0.001)
    raise AssertionError("no answer in 30 s")


def storm(url: str, paths: list[str], headers: dict) -> list[int]:
    """Statuses of GET `paths`, pipelined over one keep-alive connection: one thread writes every
    request while this one reads the responses (fast, and cheap for the client)."""
    host, port = url.removeprefix("http://").split(":")
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    requests = "".join(f"GET {p} HTTP/1.1\r\nHost: x\r\n{extra}\r\n" for p in paths).encode()
    statuses, buf = [], b""
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        writer = threading.Thread(target=sock.sendall, args=(requests,))
        writer.start()
        while len(statuses) < len(paths):
            data = sock.recv(1 << 16)
            assert data, "the server closed the connection"
            buf += data
            while True:  # whole responses: headers, then Content-Length bytes
                head, sep, rest = buf.partition(b"\r\n\r\n")
                if not sep:
                    break
                n = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
                if len(rest) < n:
                    break
                statuses.append(int(head.split(b" ", 2)[1]))
                buf = rest[n:]
        writer.join(10)
    return statuses
