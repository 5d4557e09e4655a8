"""Messages between the leader and the rollout ranks over torch.distributed point to point.

One gloo group of every rank carries them (host tensors; gloo receives from any source,
NCCL does not). The leader sends a rollout rank a 4-integer *header* (``ORDER``,
``WEIGHTS``, ``STOP``) followed, for an order, by a pickled object; a rollout rank always
has a receive for the next header posted, so it can poll for one between engine steps
without blocking (``poll``; gloo's point-to-point work reports completion only through
``wait``, so a helper thread waits on the posted receive and sets an event). Results go the other way with non-blocking sends, so a rollout
rank keeps generating while the leader trains; the leader receives them from whichever
rollout rank finished (``recv_result``). Every wait is bounded by ``dist.timeout_s``: a
lost peer fails the run instead of hanging it.
"""

from __future__ import annotations

import pickle
import threading
from datetime import timedelta

import torch
import torch.distributed as td

ORDER, WEIGHTS, STOP = 1, 2, 3
_HEADER, _OBJ_SIZE, _OBJ, _RES_SIZE, _RES = 1, 2, 3, 4, 5


def _pack(obj) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                            dtype=torch.uint8)
    return torch.tensor([data.numel()], dtype=torch.int64), data


class Channel:
    """This rank's end of the control and data messages.

    Args:
        group: the gloo group of every rank (group rank == global rank).
        timeout_s: the longest any single wait may take.
    """

    def __init__(self, group, timeout_s: float):
        self.group, self.timeout = group, timedelta(seconds=timeout_s)
        self._header = torch.zeros(4, dtype=torch.int64)
        self._posted = None  # (event, box): the header's receive, waited on by a thread
        self._sends: list = []  # in-flight results: (works, tensors kept alive)

    # ---- leader -> rollout rank ----------------------------------------------------------
    def send_header(self, dst: int, kind: int, a: int = 0, b: int = 0, c: int = 0):
        td.send(torch.tensor([kind, a, b, c], dtype=torch.int64), dst, group=self.group,
                tag=_HEADER)

    def send_order(self, dst: int, obj):
        self.send_header(dst, ORDER)
        size, data = _pack(obj)
        td.send(size, dst, group=self.group, tag=_OBJ_SIZE)
        td.send(data, dst, group=self.group, tag=_OBJ)

    def post(self, src: int):
        """Post the receive of the next header from ``src`` (a rollout rank, once per
        header)."""
        if self._posted is not None:
            return
        work = td.irecv(self._header, src, group=self.group, tag=_HEADER)
        done, box = threading.Event(), {}

        def waiter():
            try:
                work.wait(self.timeout)
            except BaseException as e:  # re-raised on the rank's own thread by _take
                box["error"] = e
            done.set()
        threading.Thread(target=waiter, name="orbitrl-header", daemon=True).start()
        self._posted = (done, box)

    def poll(self, src: int) -> tuple | None:
        """The next header from ``src`` if it has arrived (never blocks)."""
        self.post(src)
        if not self._posted[0].is_set():
            return None
        return self._take()

    def wait(self, src: int) -> tuple:
        """The next header from ``src``, waiting up to the timeout."""
        self.post(src)
        return self._take()

    def _take(self) -> tuple:
        done, box = self._posted
        done.wait()
        self._posted = None
        if "error" in box:
            raise box["error"]
        return tuple(int(x) for x in self._header)

    def recv_order(self, src: int):
        size = torch.zeros(1, dtype=torch.int64)
        td.recv(size, src, group=self.group, tag=_OBJ_SIZE)
        data = torch.empty(int(size), dtype=torch.uint8)
        td.recv(data, src, group=self.group, tag=_OBJ)
        return pickle.loads(data.numpy().tobytes())

    # ---- rollout rank -> leader --------------------------------------------------------
    def send_result(self, dst: int, obj):
        """Non-blocking: the result is on its way when this returns."""
        size, data = _pack(obj)
        works = [td.isend(size, dst, group=self.group, tag=_RES_SIZE),
                 td.isend(data, dst, group=self.group, tag=_RES)]
        self._sends.append((works, (size, data)))
        while len(self._sends) > 64:  # long received by then; else this is backpressure
            for w in self._sends.pop(0)[0]:
                w.wait(self.timeout)

    def flush(self):
        """Wait until every result sent has been received."""
        for works, _ in self._sends:
            for w in works:
                w.wait(self.timeout)
        self._sends = []

    def recv_result(self) -> tuple[int, object]:
        """(sender rank, object): the next result from whichever rollout rank sent one."""
        size = torch.zeros(1, dtype=torch.int64)
        src = td.recv(size, None, group=self.group, tag=_RES_SIZE)
        data = torch.empty(int(size), dtype=torch.uint8)
        td.recv(data, src, group=self.group, tag=_RES)
        return src, pickle.loads(data.numpy().tobytes())
