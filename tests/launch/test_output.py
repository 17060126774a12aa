"""Line assembly of worker output (pure logic; the launcher tests cover real workers)."""

from __future__ import annotations

import io

from nbaccel.launch.cell._output import LineForwarder


def _forward(chunks: list[bytes], num_processes: int = 2) -> str:
    out = io.StringIO()
    forwarder = LineForwarder(out, io.StringIO(), num_processes=num_processes)
    for chunk in chunks:
        forwarder.feed(1, "stdout", chunk)
    forwarder.close(1, "stdout")
    return out.getvalue()


def test_lines_split_across_reads_are_written_whole_with_the_prefix():
    assert _forward([b"hel", b"lo\nwor", b"ld\n"]) == "[rank1] hello\n[rank1] world\n"


def test_a_progress_bars_final_redraw_keeps_the_prefix():
    text = _forward([b"\r 50%|##   |", b"\r100%|#####|\n"])
    # live redraws end in "\r"; the finished line must not start with "\r" after the prefix
    assert text.endswith("[rank1] 100%|#####|\n")
    assert "[rank1] \r" not in text


def test_unterminated_last_line_is_flushed_on_close_and_one_process_has_no_prefix():
    assert _forward([b"done\r100%"], num_processes=1).endswith("100%\n")
    assert _forward([b"\xc3", b"\xa9t\xc3\xa9\n"], num_processes=1) == "été\n"


def test_a_line_without_end_is_forwarded_in_bounded_pieces():
    from nbaccel.launch.cell._output import MAX_LINE

    out = io.StringIO()
    fwd = LineForwarder(out, out, num_processes=1)
    chunk = b"y" * (MAX_LINE // 4)
    for _ in range(10):  # 2.5 x MAX_LINE and never a newline
        fwd.feed(0, "stdout", chunk)
    assert len(fwd._buffers[(0, "stdout")]) <= MAX_LINE  # not the whole stream
    fwd.close(0, "stdout")
    assert out.getvalue().replace("\n", "") == "y" * (10 * MAX_LINE // 4)


class _CountingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.flushes = 0

    def flush(self) -> None:
        self.flushes += 1
        super().flush()


def test_close_flushes_only_a_stream_that_was_written_to():
    # in a notebook every flush is a round trip through the kernel's IO thread
    out, err = _CountingStream(), _CountingStream()
    forwarder = LineForwarder(out, err, num_processes=2)
    forwarder.feed(0, "stdout", b"hello\n")
    for rank in (0, 1):
        for stream in ("stdout", "stderr"):
            forwarder.close(rank, stream)
    assert (out.flushes, err.flushes) == (1, 0)
    assert out.getvalue() == "[rank0] hello\n"


def test_a_cxx_stack_dump_is_left_out_and_the_warning_and_next_lines_kept():
    # torch's "[W ... TCPStore.cpp] recvValueWithTimeout failed" carries ~15 lines of C++ stack
    # that tell a notebook user nothing; rank 1's own lines between them are not part of it
    out, err = io.StringIO(), io.StringIO()
    fwd = LineForwarder(out, err, num_processes=2)
    dump = (
        b"[W1126 TCPStore.cpp:125] recvValueWithTimeout failed\n"
        b"Exception raised from recvBytes at /pytorch/Utils.hpp:680 (most recent call first):\n"
        b"frame #0: c10::Error::Error() + 0x9 (0x7f in libc10.so)\nframe #1: <unknown> + "
    )
    fwd.feed(0, "stderr", dump)
    fwd.feed(1, "stderr", b"rank 1 says\n")  # another rank's stream: not in a dump
    fwd.feed(0, "stderr", b"0x1 (0x7f in libtorch.so)\n<omitting python frames>\n\nafter\n")
    assert err.getvalue().splitlines() == [
        "[rank0] [W1126 TCPStore.cpp:125] recvValueWithTimeout failed",
        "[rank1] rank 1 says",
        "[rank0] after",
    ]
