"""Stop requests (SIGTERM, SIGINT): the run ends between steps, with a checkpoint, not in the middle of one.

    stop = StopRequest()     # installs the handlers; a signal now raises KeyboardInterrupt (start-up)
    stop.arm()               # from here on a signal is only noted ...
    ... stop.requested ...   # ... and read by whoever meets it (the rollout, the weight sync, the loop)
    stop.agreed()            # collective: every rank stops after the same step
    stop.arm(False)          # servers are gone: a signal ends the process at once again

Slurm signals every process of a job together, so a rollout server may die from the same signal that
asks the trainer to stop: the objects that talk to the servers (rollout/manager.py) turn a failure
*after* a stop request into an "interrupted" result, and any failure before one into an exception.
"""
from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class StopRequest:
    """SIGTERM/SIGINT: before arm() raise KeyboardInterrupt (unwinding stops the servers); after, note
    the request so the loop ends after the current step."""

    def __init__(self):
        self.signal_name: str | None = None
        """The signal that asked the run to stop (or "a signal on another rank"), None until one does."""
        self._armed = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signal_name = signal.Signals(signum).name
        if not self._armed:
            raise KeyboardInterrupt(self.signal_name)

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def arm(self, armed: bool = True) -> None:
        self._armed = armed

    def agreed(self) -> bool:
        """Collective over the default group: True on every rank when a stop was requested on any."""
        flag = torch.tensor([1 if self.requested else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and not self.requested:
            self.signal_name = "a signal on another rank"
        return bool(flag.item())
