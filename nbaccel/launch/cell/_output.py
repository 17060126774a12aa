"""Forward the workers' stdout/stderr into the launching cell, one whole line at a time.

:class:`LineForwarder` cuts each worker's bytes into lines and writes every line with one
``write`` call, so ranks never interleave mid-line; carriage-return updates (progress bars)
pass as they arrive. When more than one process can print, lines get a prefix (default
``"[rank{rank}] "``, ``""`` disables it; ``str.format`` fields ``{rank}``, ``{local_rank}``,
``{node_rank}``, ``{world_size}`` or torchrun's ``${rank}``/``${local_rank}``/``${role_name}``).

Example:
    >>> import io
    >>> out = io.StringIO()
    >>> fwd = LineForwarder(out, out, num_processes=2)
    >>> fwd.feed(0, "stdout", b"hello\\nwor")
    >>> fwd.feed(1, "stdout", b"hi\\n")
    >>> fwd.feed(0, "stdout", b"ld\\n")
    >>> print(out.getvalue(), end="")
    [rank0] hello
    [rank1] hi
    [rank0] world
"""

from __future__ import annotations

import codecs
import contextlib
import re
import string
import threading
from collections.abc import Callable
from typing import Any, TextIO

DEFAULT_PREFIX = "[rank{rank}] "
#: A "line" longer than this (a worker printing without newlines) is forwarded in pieces
#: of this size, so the kernel never holds more than this per stream while waiting for "\n".
MAX_LINE = 1 << 20

#: ``output=`` may be a callable receiving ``(rank, stream, line)``; ``line`` has no newline.
LineCallback = Callable[[int, str, str], Any]


def format_prefix(
    template: str, rank: int, *, local_rank: int = 0, node_rank: int = 0, world_size: int = 1
) -> str:
    """Render a prefix template (``str.format`` or ``$``-style).

    Example:
        >>> format_prefix("[${role_name}${rank}]: ", 3)
        '[default3]: '
    """
    fields: dict[str, object] = {"rank": rank, "local_rank": local_rank, "node_rank": node_rank}
    fields.update(world_size=world_size, role_name="default")
    if "$" in template:
        return string.Template(template).safe_substitute(fields)
    try:
        return template.format(**fields)
    except (KeyError, IndexError, ValueError):
        return template


# torch's C++ warnings (a rank whose rendezvous store or peer went away: "TCPStore.cpp ...
# recvValueWithTimeout failed") carry a C++ stack of ~15 lines that tells a notebook user
# nothing; the warning line itself is kept, the stack that follows it is left out.
_CXX_STACK_START = re.compile(r"^Exception raised from \S+ at \S+ \(most recent call first\):$")
_CXX_STACK_LINE = re.compile(r"^(?:frame #\d+: .*|<omitting python frames>|\s*)$")


def _visible(line: str) -> str:
    """What a terminal shows of a finished line: the text after its last carriage return
    (a bar's last redraw, ``"\\r100%|...|\\n"``, would overwrite the prefix)."""
    return next((piece for piece in reversed(line.split("\r")) if piece), "")


class LineForwarder:
    """Thread-safe line assembler and writer for every worker's stdout/stderr: lines go to
    ``stdout``/``stderr`` or ``callback(rank, stream, line)``, prefixed by ``template``
    (None: :data:`DEFAULT_PREFIX`; none for ``num_processes=1``) filled from ``rank_info``
    (global rank -> local_rank, node_rank, world_size)."""

    def __init__(
        self,
        stdout: TextIO | None,
        stderr: TextIO | None,
        template: str | None = None,
        *,
        callback: LineCallback | None = None,
        rank_info: dict[int, tuple[int, int, int]] | None = None,
        num_processes: int = 1,
    ) -> None:
        self._streams = {"stdout": stdout, "stderr": stderr}
        self._template = (
            "" if num_processes < 2 else DEFAULT_PREFIX if template is None else template
        )
        self._callback = callback
        self._rank_info = rank_info or {}
        self._buffers: dict[tuple[int, str], str] = {}
        self._decoders: dict[tuple[int, str], Any] = {}
        self._unflushed: set[str] = set()  # streams written to since their last flush
        self._redrawing: set[tuple[int, str]] = set()  # (rank, stream) drawing a bar in place
        self._cxx_stack: set[tuple[int, str]] = set()  # (rank, stream) in a C++ stack dump
        self._lock = threading.Lock()

    def _prefix(self, rank: int) -> str:
        if not self._template:
            return ""
        local, node, world = self._rank_info.get(rank, (rank, 0, 1))
        return format_prefix(
            self._template, rank, local_rank=local, node_rank=node, world_size=world
        )

    def _emit(self, rank: int, stream: str, text: str, end: str, redrawn: bool = False) -> None:
        if self._callback is not None:
            with contextlib.suppress(Exception):  # a broken display must not break the run
                self._callback(rank, stream, text)
            return
        if (target := self._streams.get(stream)) is None:
            return
        redraw = getattr(target, "redraw", None)  # a cell stream draws progress bars in place
        if redraw is not None and (redrawn or end == "\r" or (rank, stream) in self._redrawing):
            if end == "\r":  # the next whole line is the bar's last state
                self._redrawing.add((rank, stream))
            else:
                self._redrawing.discard((rank, stream))
            with contextlib.suppress(Exception):
                redraw(rank, f"{self._prefix(rank)}{text}", end != "\r")
            return
        with contextlib.suppress(Exception):
            target.write(f"{self._prefix(rank)}{text}{end}")
            self._unflushed.add(stream)
            if end == "\r":
                target.flush()
                self._unflushed.discard(stream)

    def feed(self, rank: int, stream: str, data: bytes) -> None:
        """Add raw bytes read from ``rank``'s ``stream`` ("stdout" or "stderr")."""
        key = (rank, stream)
        with self._lock:
            decoder = self._decoders.setdefault(
                key, codecs.getincrementaldecoder("utf-8")(errors="replace")
            )
            buffer = self._buffers.get(key, "") + decoder.decode(data)
            *lines, rest = buffer.split("\n")
            dump = self._cxx_stack  # a C++ stack dump's lines (see _CXX_STACK_START) are left out
            for line in lines:
                if _CXX_STACK_START.match(line) or (key in dump and _CXX_STACK_LINE.match(line)):
                    dump.add(key)
                    continue
                dump.discard(key)
                self._emit(rank, stream, _visible(line), "\n", "\r" in line)
            if "\r" in rest:  # progress bars redraw the line with "\r": show them live
                done, rest = rest.rsplit("\r", 1)
                for piece in filter(None, done.split("\r")):
                    self._emit(rank, stream, piece, "\r")
            while len(rest) > MAX_LINE:  # no newline in sight: memory stays bounded
                self._emit(rank, stream, rest[:MAX_LINE], "\n")
                rest = rest[MAX_LINE:]
            self._buffers[key] = rest

    def note(self, rank: int, text: str) -> None:
        """A message of the launcher's own (a hang report), on the stderr side: written
        whole and unprefixed, or handed to the callback line by line as ``rank``'s."""
        with self._lock:
            if self._callback is not None:
                for line in text.rstrip("\n").split("\n"):
                    self._emit(rank, "stderr", line, "\n")
                return
            if (target := self._streams.get("stderr")) is not None:
                with contextlib.suppress(Exception):
                    target.write(text if text.endswith("\n") else text + "\n")
                    target.flush()

    def close(self, rank: int, stream: str) -> None:
        """End of ``rank``'s ``stream``: write any unterminated last line."""
        key = (rank, stream)
        with self._lock:
            decoder = self._decoders.pop(key, None)
            rest = self._buffers.pop(key, "") + (decoder.decode(b"", final=True) if decoder else "")
            if rest:
                self._emit(rank, stream, _visible(rest), "\n")
            # only what this forwarder wrote: a notebook stream's flush is a round trip
            # through the kernel's IO thread (~1 ms), once per rank and stream otherwise
            dirty = stream in self._unflushed
            self._unflushed.discard(stream)
        if self._callback is None and dirty and (target := self._streams.get(stream)) is not None:
            with contextlib.suppress(Exception):
                target.flush()


__all__ = ["DEFAULT_PREFIX", "LineCallback", "LineForwarder", "format_prefix"]
