"""bench/loadgen.py keeps the words of the errors that ended texts early, not only their count."""

from __future__ import annotations

from bench.loadgen import TextRun, first_errors


def test_the_first_distinct_errors_are_kept_in_the_order_the_texts_ran() -> None:
    def run(start: float, error: str | None) -> TextRun:
        return TextRun(0, 0, 0, start, start + 1.0, error=error)

    texts = [run(3.0, "ReadTimeout: "), run(1.0, "StatusCode.DEADLINE_EXCEEDED: Deadline Exceeded"),
             run(2.0, None), run(4.0, "ReadTimeout: "), run(5.0, "HTTP 429"), run(6.0, "HTTP 500")]
    assert first_errors(texts) == ["StatusCode.DEADLINE_EXCEEDED: Deadline Exceeded", "ReadTimeout: ", "HTTP 429"]
    assert first_errors([run(1.0, None)]) == []
