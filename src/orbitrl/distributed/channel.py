"""Messages between the leader and the rollout ranks over torch.distributed point to point.

One gloo group of every rank carries them (host tensors; gloo receives from any source,
NCCL does not). The leader sends a rollout rank a 4-integer *header* (``ORDER``,
``WEIGHTS``, ``STOP``, ``FINISH``, ``BEAT``) followed, for an order, by a pickled object. A
rollout rank receives headers (and orders) on a thread of its own into an inbox, so the
leader's sends never wait on the rollout rank's engine, and the rank's loop takes them
between engine steps without blocking (``poll``) or waits for one (``wait``). Results go the
other way with non-blocking sends, so a rollout rank keeps generating while the leader
trains; the leader receives them from whichever rollout rank finished (``recv_result``).

Liveness, not idleness, bounds every wait (``dist.timeout_s``): a rollout rank may sit idle
for longer than that while the leader trains a slow step, evaluates or checkpoints, so the
leader *beats* (a ``BEAT`` header every quarter of the timeout, from a thread, for as long
as its process lives; its own waits are bounded, so a leader stuck in a collective fails and
exits). A rollout rank beats back (a ``BEAT`` result) only while its loop makes progress
(``tick``), so one stuck inside an engine step stops beating. A dead peer closes its
connections and the wait fails at once; a hung one is silent and the wait fails after
``dist.timeout_s``.
"""

from __future__ import annotations

import pickle
import queue
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as td

ORDER, WEIGHTS, STOP, FINISH, BEAT = 1, 2, 3, 4, 5
_HEADER, _OBJ_SIZE, _OBJ, _RES_SIZE, _RES = 1, 2, 3, 4, 5
_BEAT_RESULT = {"beat": True}
_BYE = {"bye": True}


def _pack(obj) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                            dtype=torch.uint8)
    return torch.tensor([data.numel()], dtype=torch.int64), data


class Channel:
    """This rank's end of the control and data messages.

    Args:
        group: the gloo group of every rank (group rank == global rank).
        timeout_s: the longest a peer may stay silent (no message, no beat).
    """

    def __init__(self, group, timeout_s: float):
        self.group, self.timeout_s = group, float(timeout_s)
        self.timeout = timedelta(seconds=timeout_s)
        self._lock = threading.Lock()  # sends from the loop and from the beat thread
        self._sends: list = []  # in-flight results: (works, tensors kept alive)
        self._inbox: queue.Queue = queue.Queue()  # (header, order or None) or an exception
        self._stop = threading.Event()
        self._ticks = 0  # the loop's progress (a rollout rank beats only while it moves)
        self._last_sent = time.monotonic()

    # ---- threads ---------------------------------------------------------------------
    def _thread(self, target, name: str):
        threading.Thread(target=target, name=name, daemon=True).start()

    def beat_to(self, ranks: list[int]):
        """Leader: a BEAT header to each of ``ranks`` every quarter of the timeout."""
        def loop():
            while not self._stop.wait(self.timeout_s / 4):
                try:
                    for r in ranks:
                        self.send_header(r, BEAT)
                except Exception:  # the loop's own waits report a lost peer
                    return
        self._thread(loop, "orbitrl-beat")

    def beat_back(self, dst: int):
        """Rollout rank: a BEAT result to ``dst`` every quarter of the timeout in which the
        loop ticked (or has not started: the engine is still being built) and nothing else
        was sent."""
        def loop():
            seen = -1
            while not self._stop.wait(self.timeout_s / 4):
                quiet = time.monotonic() - self._last_sent >= self.timeout_s / 4
                if (self._ticks != seen or self._ticks == 0) and quiet:
                    try:
                        self.send_result(dst, _BEAT_RESULT)
                    except Exception:
                        return
                seen = self._ticks
        self._thread(loop, "orbitrl-beat")

    def listen(self, src: int):
        """Rollout rank: receive ``src``'s headers (and orders) into the inbox until FINISH;
        a header wait past the timeout (no beat) or a lost connection goes in as an error."""
        def loop():
            hdr = torch.zeros(4, dtype=torch.int64)
            try:
                while True:
                    td.irecv(hdr, src, group=self.group, tag=_HEADER).wait(self.timeout)
                    msg = tuple(int(x) for x in hdr)
                    if msg[0] == BEAT:
                        continue
                    self._inbox.put((msg, self._recv_order(src) if msg[0] == ORDER else None))
                    if msg[0] == FINISH:
                        return
            except BaseException as e:  # re-raised on the rank's own thread by _take
                self._inbox.put(e)
        self._thread(loop, "orbitrl-listen")

    def tick(self):
        """The rank's loop made progress (see ``beat_back``)."""
        self._ticks += 1

    def close(self):
        self._stop.set()

    # ---- leader -> rollout rank ----------------------------------------------------------
    def send_header(self, dst: int, kind: int, a: int = 0, b: int = 0, c: int = 0):
        msg = torch.tensor([kind, a, b, c], dtype=torch.int64)
        with self._lock:
            td.send(msg, dst, group=self.group, tag=_HEADER)

    def send_order(self, dst: int, obj):
        size, data = _pack(obj)
        with self._lock:  # (the header's receiver takes the order next)
            td.send(torch.tensor([ORDER, 0, 0, 0], dtype=torch.int64), dst, group=self.group,
                    tag=_HEADER)
            td.send(size, dst, group=self.group, tag=_OBJ_SIZE)
            td.send(data, dst, group=self.group, tag=_OBJ)

    def poll(self) -> tuple | None:
        """Rollout rank: the next (header, order or None) if one has arrived (never
        blocks)."""
        self.tick()
        try:
            return self._take(self._inbox.get_nowait())
        except queue.Empty:
            return None

    def wait(self) -> tuple:
        """Rollout rank: the next (header, order or None); the listener bounds the wait."""
        while True:
            self.tick()
            try:
                return self._take(self._inbox.get(timeout=min(1.0, self.timeout_s / 8)))
            except queue.Empty:
                continue

    @staticmethod
    def _take(item) -> tuple:
        if isinstance(item, BaseException):
            raise item
        return item

    def _recv_order(self, src: int):
        size = torch.zeros(1, dtype=torch.int64)
        td.recv(size, src, group=self.group, tag=_OBJ_SIZE)
        data = torch.empty(int(size), dtype=torch.uint8)
        td.recv(data, src, group=self.group, tag=_OBJ)
        return pickle.loads(data.numpy().tobytes())

    # ---- rollout rank -> leader --------------------------------------------------------
    def send_result(self, dst: int, obj):
        """Non-blocking: the result is on its way when this returns."""
        size, data = _pack(obj)
        with self._lock:
            works = [td.isend(size, dst, group=self.group, tag=_RES_SIZE),
                     td.isend(data, dst, group=self.group, tag=_RES)]
            self._sends.append((works, (size, data)))
            self._last_sent = time.monotonic()
            old = self._sends[:-64] if len(self._sends) > 64 else []
            self._sends = self._sends[len(old):]
        for works, _ in old:  # long received by then; else this is backpressure
            for w in works:
                w.wait(self.timeout)

    def goodbye(self, dst: int):
        """Rollout rank: stop beating, send the last result (BYE) and wait until the leader
        has received everything sent."""
        self.close()
        self.send_result(dst, _BYE)
        with self._lock:
            sends, self._sends = self._sends, []
        for works, _ in sends:
            for w in works:
                w.wait(self.timeout)

    def recv_result(self) -> tuple[int, object]:
        """(sender rank, object): the next result from whichever rollout rank sent one
        (beats skipped; BYE comes back as None)."""
        while True:
            size = torch.zeros(1, dtype=torch.int64)
            src = td.recv(size, None, group=self.group, tag=_RES_SIZE)
            data = torch.empty(int(size), dtype=torch.uint8)
            td.recv(data, src, group=self.group, tag=_RES)
            obj = pickle.loads(data.numpy().tobytes())
            if obj == _BEAT_RESULT:
                continue
            return src, (None if obj == _BYE else obj)
