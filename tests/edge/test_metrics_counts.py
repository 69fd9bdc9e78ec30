"""The edge's counts of the cloud's work (edge/metrics.py): a stream's tokens are calls and forwards of their own,
and rows per committed token is what the target ran for each token."""

from __future__ import annotations

from edge.metrics import EdgeMetrics


def test_a_stream_counts_one_call_per_token_it_streamed() -> None:
    """10 rounds (11 calls with the open) committed 40 tokens; one stream call then streamed 60: the cloud ran 70
    forwards for 100 tokens, not 12 calls."""
    m = EdgeMetrics(emitted=100, cloud_calls=12, verify_calls=10, accepted=30, streamed=60, stream_calls=1)
    assert m.tokens_per_call == 100 / (11 + 60)
    assert m.target_forwards == 70
    assert m.tokens_per_verify == 4.0
    assert m.tokens_per_forward == 100 / 70


def test_rows_per_token_is_the_targets_rows_over_the_tokens_they_committed() -> None:
    m = EdgeMetrics(emitted=40, verify_calls=10, accepted=30, target_rows=10 * (1 + 12))  # trees of 12 nodes
    assert m.rows_per_token == 130 / 40
    alone = EdgeMetrics(emitted=50, streamed=50, stream_calls=1, target_rows=50)
    assert alone.rows_per_token == 1.0 and alone.tokens_per_forward == 1.0
    d = m.to_dict()
    assert d["rows_per_token"] == m.rows_per_token and d["target_forwards"] == 10
