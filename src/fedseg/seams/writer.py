"""The background checkpoint writer, and the transport as the round loop asks it while the writer copies.

:class:`CheckpointWriter` writes a staged checkpoint (:mod:`fedseg.seams.checkpoint`'s files and commit
protocol) from host copies, in a background thread; on the CPU it also takes the copies of the sites' state
itself, site after site, while the next round trains (:class:`SiteCopies`), and :class:`AfterCopies` asks a
site only once its copy is taken.
"""

from __future__ import annotations

import copy
import functools
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from fedseg.foundation.arrays import Arrays
from fedseg.foundation.messages import Reply, Task
from fedseg.seams.checkpoint import SITES, JsonDoc, commit_checkpoint, save_arrays, save_json
from fedseg.seams.transport import Traffic, Transport

__all__ = ["AfterCopies", "CheckpointWriter", "SiteCopies", "SiteState", "site_states"]


class SiteCopies:
    """The sites whose state a checkpoint in the background is still copying to host memory, in the order the
    writer copies them (the order the round loop asks them in).  Whoever changes a site's state — the next
    round's task, an evaluation — first waits for that site's copy (:meth:`wait`): the copies of the later
    sites overlap the training of the earlier ones.  A copy that failed opens every gate and is raised by
    :meth:`wait` (and by :meth:`CheckpointWriter.wait`)."""

    def __init__(self, names: Iterable[str]):
        self._done = {n: threading.Event() for n in names}
        self._error: BaseException | None = None

    def done(self, name: str) -> None:
        self._done[name].set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        for ev in self._done.values():
            ev.set()

    def pending(self) -> bool:
        return not all(ev.is_set() for ev in self._done.values())

    def wait(self, names: Iterable[str] | None = None) -> None:
        """Block until the copies of ``names`` (None: every site) are taken."""
        for n in self._done if names is None else names:
            ev = self._done.get(n)
            if ev is not None:
                ev.wait()
        if self._error is not None:
            raise self._error


SiteState = Callable[[], tuple[Arrays, dict[str, Any]]]
"""A site's live state (:meth:`fedseg.site.runtime.Site.state_arrays` with ``copy=False``), read when called."""


class CheckpointWriter:
    """Writes staged checkpoint files, then commits them (:func:`commit_checkpoint`), in order.

    :meth:`submit` takes ``{relative path: host arrays | JsonDoc}`` whose last entry is the
    commit record ``progress.json.next``; the files are written one after another and the
    checkpoint is committed.  With ``background`` this happens in one worker thread, so a
    round trains while the previous checkpoint is written; :meth:`wait` blocks until it is
    committed and re-raises a failed write.  The engine waits before it stages the next
    checkpoint and before the run returns, so at most one checkpoint is in flight and the
    commit protocol (staged ``.next`` files, then the record) is unchanged.
    """

    def __init__(self, background: bool = True):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedseg-checkpoint") if background else None
        self._pending: Future | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self.write_s = 0.0
        """Seconds spent writing (in the worker thread when in the background)."""

    def host_copy(self, group: str, arrays: Arrays) -> Arrays:
        """Copies of ``arrays`` in host buffers reused from one checkpoint to the next (pinned
        when the source is on a GPU, so the copies run without blocking until one final
        synchronization; see :meth:`copies_done`).  Reusing them saves allocating and
        page-faulting a checkpoint's worth of memory each time; they are free again once
        :meth:`wait` has returned, which every caller does before copying."""
        out: Arrays = {}
        for k, v in arrays.items():
            name = f"{group}/{k}"
            buf = self._buffers.get(name)
            if buf is None or buf.shape != v.shape or buf.dtype != v.dtype:
                buf = torch.empty(v.shape, dtype=v.dtype, pin_memory=v.is_cuda)
                self._buffers[name] = buf
            buf.copy_(v.detach(), non_blocking=v.is_cuda)
            out[k] = buf
        return out

    @staticmethod
    def copies_done() -> None:
        """Wait for non-blocking device-to-host copies of :meth:`host_copy` (no-op without CUDA)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def submit(
        self,
        folder: Path,
        files: dict[str, Arrays | JsonDoc],
        sites: Mapping[str, SiteState] | None = None,
        gate: SiteCopies | None = None,
    ) -> None:
        """Write ``files`` (their last entry the commit record) and commit them.  ``sites``: ``{name: its live
        state}`` of host (CPU) tensors, copied into host buffers by the writer, one site after the other, each
        opening its gate in ``gate`` once copied, then written to ``sites.next/<name>.safetensors`` + ``.json``
        before the commit record; the caller changes no site's state before its gate opens."""
        self.wait()
        if self._pool is None:
            self._write(folder, files, sites, gate)
        else:
            self._pending = self._pool.submit(self._write, folder, files, sites, gate)

    def _copy_sites(self, sites: Mapping[str, SiteState], gate: SiteCopies | None) -> dict[str, Arrays | JsonDoc]:
        out: dict[str, Arrays | JsonDoc] = {}
        try:
            for name, state in sites.items():
                arrays, meta = state()
                out[f"{SITES}.next/{name}.safetensors"] = self.host_copy(f"sites/{name}", arrays)
                out[f"{SITES}.next/{name}.json"] = JsonDoc(copy.deepcopy(meta))
                if gate is not None:
                    gate.done(name)
        except BaseException as e:
            if gate is not None:
                gate.fail(e)
            raise
        return out

    def _write(
        self,
        folder: Path,
        files: dict[str, Arrays | JsonDoc],
        sites: Mapping[str, SiteState] | None = None,
        gate: SiteCopies | None = None,
    ) -> None:
        t0 = time.perf_counter()
        if sites:
            *rest, record = files.items()
            files = {**dict(rest), **self._copy_sites(sites, gate), record[0]: record[1]}
        for rel, content in files.items():
            path = folder / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, JsonDoc):
                save_json(content.data, path)
            else:
                save_arrays(content, path)
        commit_checkpoint(folder)
        self.write_s += time.perf_counter() - t0

    def wait(self) -> None:
        """Block until the checkpoint in flight is committed (re-raises its error)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()


def _given(state: tuple[Arrays, dict[str, Any]]) -> tuple[Arrays, dict[str, Any]]:
    return state


class AfterCopies:
    """The transport as the server half and the engine ask it while the checkpoint writer copies the sites'
    state in the background (:class:`~fedseg.seams.checkpoint.SiteCopies`): a site is asked once its copy is
    taken.  Where the transport computes its sites one after another (in process, not vectorized) each site
    waits for its own copy only, so the copies of the later sites overlap the training of the earlier ones;
    otherwise (vectorized: every site of an ask at once) every copy is waited for first."""

    def __init__(self, inner: Transport):
        self.inner = inner
        self.sites: tuple[str, ...] = inner.sites
        self.traffic: Traffic = inner.traffic  # the same record: the engine takes it from either
        self.copies: SiteCopies | None = None

    def ask(self, tasks: dict[str, Task], optional: bool = False) -> dict[str, Reply]:
        copies = self.copies
        if copies is None or not copies.pending():
            return self.inner.ask(tasks, optional=optional)
        if getattr(self.inner, "vectorized", True) is not None:  # its sites computed together (or not known)
            copies.wait()
            return self.inner.ask(tasks, optional=optional)
        replies: dict[str, Reply] = {}
        for name, task in tasks.items():  # what the transport does itself: each site in turn
            copies.wait([name])
            replies.update(self.inner.ask({name: task}, optional=optional))
        return replies

    def save_sites(self, folder: Path) -> None:
        self.inner.save_sites(folder)

    def restore_sites(self, folder: Path) -> None:
        self.inner.restore_sites(folder)

    def close(self) -> None:
        self.inner.close()


def site_states(
    transport: Any, snapshot: Callable[[], dict[str, tuple[Arrays, dict[str, Any]]]], names: list[str] | None
) -> tuple[dict[str, SiteState], list[str]]:
    """Every site's state as the writer reads it, and the sites' names: the first time (``names`` None) from
    ``snapshot()`` (read now, which names the sites), then from each site when the writer comes to it (the
    in-process transport's ``site(name)``)."""
    site = getattr(transport, "site", None)
    if names is None or site is None:
        states = snapshot()
        return {name: functools.partial(_given, st) for name, st in states.items()}, list(states)
    return {name: functools.partial(site(name).state_arrays, copy=False) for name in names}, names
