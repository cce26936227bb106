"""Collectives that fail in one line: a lost or silent rank is named, never a raw gloo/NCCL error.

Every exchange between ranks (the agreement before calibration, the error flags after each
pass, the observer reductions) runs inside :func:`collective`. It leaves a marker in the
process group's store first (how many exchanges this rank has entered), so that when a
collective fails because a peer closed its connection (its process ended) or did not answer
within the process group's timeout, every surviving rank can say which rank did not arrive:
the ranks whose marker is behind its own. The error is a :class:`DistributedError` marked
:data:`EXCHANGED` (the group is unusable: nobody tries another collective).

:func:`exchange` gathers one byte string from every rank (two ``all_gather`` calls: lengths,
then the padded bytes), without pickle: peers send data, never objects.
"""

from __future__ import annotations

import contextlib
import os
import re

import torch

from quantkit._errors import DistributedError

__all__ = ["EXCHANGED", "PEER_LOST", "collective", "timeout_hint", "exchange", "comm_device", "store", "key",
           "missing_ranks", "clean"]

EXCHANGED = "quantkit_exchanged"  # set on an error every rank of the group raised (or learnt of) together
PEER_LOST = "quantkit_peer_lost"  # set (with EXCHANGED) on an error about a rank that is gone or silent
_ENTERED = [0]  # exchanges this process has entered (the marker it leaves in the store)
# what a user does about a peer that is only slow; the CLI names its own setting (timeout_hint)
_HINT = ["give init_process_group a longer timeout"]
# what a peer that is gone or silent looks like in gloo's and NCCL's errors
_GONE = re.compile(r"closed by peer|reset by peer|broken pipe|connection refused|no route to host|socket closed|"
                   r"NCCL communicator was aborted|remote process exited", re.I)
_SILENT = re.compile(r"timed out|timeout", re.I)
_WAITED_MS = re.compile(r"(?:waiting|after)\s+(\d+)\s*ms", re.I)


def _dist():
    import torch.distributed as dist

    return dist


def comm_device(group) -> torch.device:
    """Where the group's collectives take their tensors: the current CUDA device for NCCL."""
    dist = _dist()
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def store():
    """The default process group's key-value store (torchrun's agent store under torchrun), or None."""
    try:
        return _dist().distributed_c10d._get_default_store()
    except Exception:  # no store (an uninitialised or custom group): markers are left out
        return None


def key(*parts) -> str:
    """A store key of quantkit's, distinct per torchrun restart."""
    return "/".join(["quantkit", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), *map(str, parts)])


def clean(text: str, limit: int = 300) -> str:
    """One printable line of at most ``limit`` characters (a peer's text reaches a terminal)."""
    text = "".join(ch if ch.isprintable() else " " for ch in str(text))
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _default(group) -> bool:
    return group is None or group is _dist().group.WORLD


def _mark(rank: int) -> None:
    _ENTERED[0] += 1
    s = store()
    if s is not None:
        with contextlib.suppress(Exception):
            s.set(key("entered", rank), str(_ENTERED[0]))


def missing_ranks(rank: int, world: int) -> list[int]:
    """The ranks that did not enter the exchange this rank is in (their store marker is behind
    ours); with two ranks and no markers, the other one. Markers count the default group's
    exchanges only."""
    s, behind = store(), []
    if s is not None:
        for r in range(world):
            if r == rank:
                continue
            try:
                k = key("entered", r)
                n = int(s.get(k)) if s.check([k]) else 0
            except Exception:  # the store went with the rank that hosted it
                behind = []
                break
            if n < _ENTERED[0]:
                behind.append(r)
    if not behind and world == 2:
        behind = [1 - rank]
    return behind


def _who(rank: int, world: int, group) -> str:
    ranks = missing_ranks(rank, world) if _default(group) else ([1 - rank] if world == 2 else [])
    if not ranks:
        return f"another rank of {world}"
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {world}"


def _peer_failure(exc: BaseException) -> str | None:
    """Why a collective failed, when a peer is gone or silent; None for any other error."""
    dist = _dist()
    text = str(exc)
    if _GONE.search(text):
        return "its process ended or lost its connection; see that rank's own error or log"
    if _SILENT.search(text) or isinstance(exc, getattr(dist, "DistStoreError", ())):
        waited = _WAITED_MS.search(text)
        within = f"no answer within {int(waited.group(1)) / 1000:g} s" if waited else "no answer in time"
        return f"{within}; see whether that rank is stuck or stopped, or {_HINT[0]} if it is only slow"
    return None


@contextlib.contextmanager
def timeout_hint(text: str):
    """Within: errors about a silent rank end with ``text`` (how to allow it more time)."""
    before = _HINT[0]
    _HINT[0] = text
    try:
        yield
    finally:
        _HINT[0] = before


@contextlib.contextmanager
def collective(stage: str, group=None):
    """Within: one exchange between the ranks of ``group`` (``stage`` names it in errors). A peer
    that is gone or silent becomes one line naming it; other errors pass through unchanged.

    Raises:
        DistributedError: a peer closed its connection or did not answer (marked exchanged).
    """
    dist = _dist()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if _default(group):
        _mark(rank)
    try:
        yield
    except RuntimeError as exc:  # gloo and NCCL raise RuntimeError (or DistError, a subclass)
        why = _peer_failure(exc)
        if why is None:
            raise
        err = DistributedError(f"{_who(rank, world, group)} stopped answering at {stage} ({why}); every rank stops")
        setattr(err, EXCHANGED, True)
        setattr(err, PEER_LOST, True)
        raise err from None


def exchange(payload: bytes, *, stage: str, group=None) -> list[bytes]:
    """Every rank's ``payload``, in rank order (every rank of ``group`` must call it)."""
    dist = _dist()
    world = dist.get_world_size(group)
    device = comm_device(group)
    with collective(stage, group):
        size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
        sizes = [torch.zeros_like(size) for _ in range(world)]
        dist.all_gather(sizes, size, group=group)
        lengths = [int(s.item()) for s in sizes]
        longest = max(max(lengths), 1)
        mine = torch.zeros(longest, dtype=torch.uint8)
        if payload:
            mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        mine = mine.to(device)
        parts = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine, group=group)
    return [p[:n].cpu().numpy().tobytes() for p, n in zip(parts, lengths)]
