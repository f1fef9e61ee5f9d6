"""A shaped link inside this machine, for the cold-start benchmark: a network namespace joined
to the root namespace by a veth pair with `tc tbf` on both ends (the rate), and a delaying TCP
proxy on 127.0.0.1 in front of each server (the round-trip time):

    root namespace                                            namespace weenv-cs-XXXX
    client -> 127.0.0.1:P (DelayProxy, +RTT/2 each way) -> 10.214.N.1 ==veth== 10.214.N.2 server
                                                      tbf rate R each way

This kernel has no `sch_netem` (only tbf, htb, ingress, u32, bpf, mirred), so the delay
cannot be added by a qdisc; `DelayProxy` (a separate process, so its threads do not compete
with the benchmark's for the GIL) holds every chunk of bytes it forwards until half the
round trip has passed since it arrived, each way. The rate limit stays in the kernel. The
addresses exist only on this veth pair (a /30 of 10.214.0.0/16 that no interface or route
uses); servers in the namespace listen on 10.214.N.2 and the proxies on 127.0.0.1, so nothing
is reachable from outside the machine. `rx_bytes()` / `tx_bytes()` are the root end's
counters: bytes the clients received from / sent to the servers, every header included.

Must not: start the servers themselves (docker_peer.py and weenv_peer.py do, with
`prefix()`), or remove a namespace, link or process it did not create.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType

SUBNET = "10.214"


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def netshape_unavailable() -> str | None:
    """Why a shaped link cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return f"{tool} not installed (Debian package iproute2)"
    return None


class ShapedLink:
    """`with ShapedLink(rate_mbit=1000, rtt_ms=2) as link:` start servers with
    `link.prefix()`, reach them at `link.server_ip`; everything is removed at exit."""

    def __init__(self, rate_mbit: float = 1000.0, rtt_ms: float = 2.0) -> None:
        self.rate_mbit, self.rtt_ms = rate_mbit, rtt_ms
        tag = f"{os.getpid() % 0xFFFF:04x}"
        self.netns = f"weenv-cs-{tag}"
        self.host_dev, self.ns_dev = f"wcs{tag}h", f"wcs{tag}n"
        n = self._free_block()
        self.client_ip = f"{SUBNET}.{n // 64}.{(n % 64) * 4 + 1}"
        self.server_ip = f"{SUBNET}.{n // 64}.{(n % 64) * 4 + 2}"
        self._made: list[str] = []
        self._proxies: list[DelayProxy] = []

    @staticmethod
    def _free_block() -> int:
        """A /30 block number whose addresses no interface or route of this machine uses."""
        used = _ip("-4", "addr") + _ip("-4", "route", "show", "table", "all")
        for n in random.Random(os.getpid()).sample(range(64 * 200), 400):
            if f"{SUBNET}.{n // 64}." not in used:
                return n
        raise RuntimeError(f"no free /30 in {SUBNET}.0.0/16")

    @property
    def label(self) -> str:
        return f"{self.rate_mbit / 1000:g} Gbit/s, {self.rtt_ms:g} ms RTT"

    def proxy(self, port: int) -> DelayProxy:
        """A DelayProxy on 127.0.0.1 to `server_ip:port` (stop it, or `close()` does)."""
        proxy = DelayProxy(self.server_ip, port, self.rtt_ms / 2).start()
        self._proxies.append(proxy)
        return proxy

    def __enter__(self) -> ShapedLink:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        _ip("netns", "add", self.netns)
        self._made.append("netns")
        _ip("link", "add", self.host_dev, "type", "veth", "peer", "name", self.ns_dev)
        self._made.append("link")
        _ip("link", "set", self.ns_dev, "netns", self.netns)
        _ip("addr", "add", f"{self.client_ip}/30", "dev", self.host_dev)
        _ip("link", "set", self.host_dev, "up")
        ns = ["-n", self.netns]
        _ip(*ns, "addr", "add", f"{self.server_ip}/30", "dev", self.ns_dev)
        _ip(*ns, "link", "set", self.ns_dev, "up")
        _ip(*ns, "link", "set", "lo", "up")
        self.shape()

    def shape(self) -> None:
        """tbf on both ends: `rate` each way. The burst (1 MB, 8 ms at 1 Gbit/s) must hold
        the largest segment veth passes (64 KiB with GSO), or tbf drops it."""
        rate = f"{self.rate_mbit:g}mbit"
        for prefix, dev in (([], self.host_dev), (["ip", "netns", "exec", self.netns],
                                                  self.ns_dev)):
            subprocess.run([*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                            "rate", rate, "burst", "1mb", "latency", "50ms"],
                           check=True, capture_output=True)

    def prefix(self) -> list[str]:
        """The argv prefix that runs a command inside the namespace."""
        return ["ip", "netns", "exec", self.netns]

    def _counter(self, name: str) -> int:
        return int(Path(f"/sys/class/net/{self.host_dev}/statistics/{name}").read_text())

    def rx_bytes(self) -> int:
        """Bytes the root namespace received over the link (server -> clients)."""
        return self._counter("rx_bytes")

    def tx_bytes(self) -> int:
        """Bytes the root namespace sent over the link (clients -> servers)."""
        return self._counter("tx_bytes")

    def close(self) -> None:
        """Stop the proxies, remove the veth pair and the namespace (only what this object
        made)."""
        for proxy in self._proxies:
            proxy.stop()
        self._proxies.clear()
        if "link" in self._made:
            subprocess.run(["ip", "link", "del", self.host_dev], capture_output=True)
        if "netns" in self._made:
            subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)
        self._made.clear()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class DelayProxy:
    """`python netshape.py proxy PORT_FILE HOST PORT DELAY_MS` in a child process: a TCP
    proxy on 127.0.0.1:`port` (free, chosen by the child) to HOST:PORT that delays each
    direction by DELAY_MS."""

    def __init__(self, host: str, port: int, delay_ms: float) -> None:
        self.host, self.target_port, self.delay_ms = host, port, delay_ms
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> DelayProxy:
        read, write = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "proxy", str(write), self.host, str(self.target_port),
             repr(self.delay_ms)], pass_fds=(write,), stdin=subprocess.DEVNULL)
        os.close(write)
        with os.fdopen(read) as ready:
            line = ready.readline()
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError("the delay proxy did not start")
        self.port = int(line)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


def _pump(src: socket.socket, dst: socket.socket, delay: float) -> None:
    """Forward src -> dst, each chunk sent `delay` seconds after it was received."""
    chunks: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()

    def reader() -> None:
        try:
            while data := src.recv(1 << 18):
                chunks.put((time.monotonic() + delay, data))
        except OSError:
            pass
        chunks.put((0.0, b""))

    threading.Thread(target=reader, daemon=True).start()
    try:
        while True:
            due, data = chunks.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def _serve(ready_fd: int, host: str, port: int, delay: float) -> None:
    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            client = self.request
            try:
                upstream = socket.create_connection((host, port), timeout=30)
            except OSError:
                return
            upstream.settimeout(None)
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            back = threading.Thread(target=_pump, args=(upstream, client, delay), daemon=True)
            back.start()
            _pump(client, upstream, delay)
            back.join()
            upstream.close()

    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = True
        allow_reuse_address = True
        request_queue_size = 512

    server = Server(("127.0.0.1", 0), Handler)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    with os.fdopen(ready_fd, "w") as ready:
        ready.write(f"{server.server_address[1]}\n")
    server.serve_forever()


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "proxy":
    _serve(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5]) / 1000.0)
