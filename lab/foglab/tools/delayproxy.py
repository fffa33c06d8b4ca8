"""A userspace delaying TCP proxy: per-link delay where the kernel has no netem.

Why: this build machine's kernel lacks sch_netem, yet the latency code must measure something
real. A proxy per node in front of the broker (or in front of a peer's echo server) forwards
bytes both ways after holding each chunk for half the configured RTT, so the round trip through
it takes the configured RTT on top of the real one. Order is preserved (one FIFO per direction,
delivery times never decrease), so MQTT runs through it unchanged.

    proxy = DelayProxy(("127.0.0.1", broker_port), rtt_ms=50).start()
    ... connect the agent to ("127.0.0.1", proxy.port) ...
    proxy.set_rtt(150)          # takes effect for chunks read from now on
    proxy.cut(); proxy.heal()   # a partition: nothing passes in between (see `cut`)
    proxy.stop()

Through the broker, node A behind a proxy of RTT a and node B behind one of RTT b see
RTT(A, B) = a + b (A -> broker -> B -> broker -> A crosses each proxy twice, half each time).
`ProxyBank` starts one per node from a {node: rtt_to_broker_ms} map; `pair_proxies` builds
per-(src, dst) proxies in front of echo servers so that a full matrix can be emulated.

Implementation: one asyncio event loop in one daemon thread for all connections of a proxy.
Jitter (optional) is drawn from a seeded generator and clipped so that order is kept.
"""

from __future__ import annotations

import asyncio
import random
import threading
from typing import Any, Dict, Mapping, Optional, Tuple

__all__ = ["DelayProxy", "ProxyBank", "pair_proxies"]

_EOF = b""


class DelayProxy:
    def __init__(self, target: Tuple[str, int], rtt_ms: float = 0.0, listen: Tuple[str, int] = ("127.0.0.1", 0),
                 jitter_ms: float = 0.0, seed: int = 0, chunk: int = 65536) -> None:
        if rtt_ms < 0 or jitter_ms < 0:
            raise ValueError(f"rtt_ms and jitter_ms must be >= 0, found {rtt_ms}, {jitter_ms}")
        self.target = target
        self.listen = listen
        self.rtt_ms = float(rtt_ms)
        self.jitter_ms = float(jitter_ms)
        self.chunk = chunk
        self._rnd = random.Random(seed)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._server: Optional[asyncio.AbstractServer] = None
        self._thread: Optional[threading.Thread] = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self.port = 0
        self.connections = 0
        self._open: Optional[asyncio.Event] = None  # cleared while cut (created in the loop thread)

    # ---- control (any thread) ----

    def start(self) -> "DelayProxy":
        self._thread = threading.Thread(target=self._run, name=f"delayproxy-{self.rtt_ms:g}ms", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error
        return self

    def set_rtt(self, rtt_ms: float, jitter_ms: Optional[float] = None) -> None:
        self.rtt_ms = float(rtt_ms)
        if jitter_ms is not None:
            self.jitter_ms = float(jitter_ms)

    def cut(self) -> None:
        """A network partition between the two sides: from now on every byte, both ways, and
        every new connection waits until `heal`. Nothing is dropped or reset by the proxy: as on
        a real network, the endpoints' own timers (MQTT keepalive) decide whether a connection
        survives; one they close ends at the other side only after `heal`."""
        self._call(lambda e: e.clear())

    def heal(self) -> None:
        """End the partition: held bytes and connections go on, in order."""
        self._call(lambda e: e.set())

    def _call(self, fn: Any) -> None:
        loop, ev = self._loop, self._open
        if loop is None or ev is None:
            raise RuntimeError("the proxy is not running")
        done = threading.Event()
        loop.call_soon_threadsafe(lambda: (fn(ev), done.set()))
        done.wait(5)

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5)
        self._loop = None

    def __enter__(self) -> "DelayProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- the loop thread ----

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        self._open = asyncio.Event()
        self._open.set()
        try:
            self._server = loop.run_until_complete(asyncio.start_server(self._handle, *self.listen))
            self.port = self._server.sockets[0].getsockname()[1]
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            self._server.close()
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

    def _one_way(self) -> float:
        d = self.rtt_ms / 2.0
        if self.jitter_ms:
            d = max(0.0, d + self._rnd.gauss(0.0, self.jitter_ms / 2.0))
        return d / 1000.0

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        assert self._open is not None
        await self._open.wait()  # cut: the connection attempt hangs, as behind a dead link
        try:
            t_reader, t_writer = await asyncio.open_connection(*self.target)
        except OSError:
            c_writer.close()
            return
        try:
            await asyncio.gather(self._pipe(c_reader, t_writer), self._pipe(t_reader, c_writer),
                                 return_exceptions=True)
        except asyncio.CancelledError:  # stop(): end quietly (asyncio logs a handler that raises)
            for w in (c_writer, t_writer):
                w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: "asyncio.Queue[Tuple[float, bytes]]" = asyncio.Queue()
        is_open = self._open
        assert is_open is not None

        async def pump_out() -> None:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                await is_open.wait()  # held while cut
                if data == _EOF:
                    try:
                        writer.write_eof()
                    except (OSError, RuntimeError):
                        pass
                    writer.close()
                    return
                writer.write(data)
                try:
                    await writer.drain()
                except (ConnectionError, OSError):
                    return

        out = asyncio.ensure_future(pump_out())
        last = 0.0
        try:
            while True:
                data = await reader.read(self.chunk)
                due = max(last, loop.time() + self._one_way())  # never reorder
                last = due
                queue.put_nowait((due, data))
                if data == _EOF:
                    break
        except (ConnectionError, OSError):
            queue.put_nowait((loop.time(), _EOF))
        await out


class ProxyBank:
    """One proxy per node in front of one target (the broker): {node: rtt_to_target_ms}."""

    def __init__(self, target: Tuple[str, int], rtt_ms: Mapping[str, float]) -> None:
        self.proxies: Dict[str, DelayProxy] = {n: DelayProxy(target, ms) for n, ms in rtt_ms.items()}

    def start(self) -> "ProxyBank":
        for p in self.proxies.values():
            p.start()
        return self

    def port(self, node: str) -> int:
        return self.proxies[node].port

    def stop(self) -> None:
        for p in self.proxies.values():
            p.stop()

    def __enter__(self) -> "ProxyBank":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def pair_proxies(targets: Mapping[str, Tuple[str, int]], matrix: Mapping[str, Mapping[str, float]]
                 ) -> Dict[Tuple[str, str], DelayProxy]:
    """A started proxy per (src, dst) in front of dst's endpoint with RTT matrix[src][dst]."""
    out: Dict[Tuple[str, str], DelayProxy] = {}
    for src, row in matrix.items():
        for dst, ms in row.items():
            if dst in targets and src != dst:
                out[(src, dst)] = DelayProxy(targets[dst], ms).start()
    return out
