"""Line assembly of worker output (pure logic; the launcher tests cover real workers)."""

from __future__ import annotations

import io

from nbaccel.launch._output import LineForwarder


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
    from nbaccel.launch._output import MAX_LINE

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
