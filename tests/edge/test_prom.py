"""The OpenAI server's Prometheus registry: what each histogram observes, and the text passes
`promtool check metrics`."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from edge.metrics import EdgeMetrics, RoundRecord
from edge.prom import EdgePrometheus
from tests.ops.tools import promtool


def values(prom: EdgePrometheus) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(prom.render().decode()) for s in fam.samples}


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_token_clock_observes_first_token_from_arrival_then_gaps_between_tokens() -> None:
    prom, clock = EdgePrometheus.create(), Clock()
    tc = prom.token_clock(100.0, clock)
    for t in (100.3, 100.3, 100.5, 101.5):  # first token 0.3 s after arrival; gaps 0, 0.2, 1.0
        clock.t = t
        tc.tick()
    clock.t = 102.0
    tc.finished()
    assert tc.ttft_s is not None and abs(tc.ttft_s - 0.3) < 1e-9
    v = values(prom)
    p = "specsplit_edge_"
    assert v[(p + "time_to_first_token_seconds_count", ())] == 1
    assert abs(v[(p + "time_to_first_token_seconds_sum", ())] - 0.3) < 1e-9
    assert v[(p + "inter_token_latency_seconds_count", ())] == 3
    assert abs(v[(p + "inter_token_latency_seconds_sum", ())] - 1.2) < 1e-9
    assert v[(p + "inter_token_latency_seconds_bucket", (("le", "0.001"),))] == 1  # the two tokens of one round
    assert v[(p + "request_duration_seconds_sum", ())] == 2.0


def test_record_observes_rounds_and_the_generations_acceptance() -> None:
    prom = EdgePrometheus.create()
    rounds = [RoundRecord(0, k=4, accepted_len=4, next_kind="bonus", decided_by="cloud", committed=5, rtt_ms=20),
              RoundRecord(1, k=4, accepted_len=1, next_kind="correction", decided_by="cloud", committed=2, rtt_ms=40),
              RoundRecord(2, k=3, accepted_len=3, next_kind="local", decided_by="gate", committed=3)]
    m = EdgeMetrics(drafted=8, accepted=5, rounds=3, rtt_ms=60)
    prom.record(m, rounds=rounds)
    prom.record(EdgeMetrics())  # a generation that drafted nothing has no acceptance to observe
    v = values(prom)
    p = "specsplit_edge_"
    assert v[(p + "verify_round_trip_seconds_count", ())] == 2  # the gated round never went to the cloud
    assert abs(v[(p + "verify_round_trip_seconds_sum", ())] - 0.06) < 1e-9
    assert v[(p + "tokens_per_round_count", ())] == 3 and v[(p + "tokens_per_round_sum", ())] == 10
    assert v[(p + "acceptance_ratio_count", ())] == 1 and v[(p + "acceptance_ratio_sum", ())] == 5 / 8
    assert v[(p + "drafted_tokens_total", ())] == 8 and v[(p + "accepted_tokens_total", ())] == 5


def test_edge_metrics_pass_promtool_check_metrics() -> None:
    prom = EdgePrometheus.create()
    prom.record(EdgeMetrics(drafted=4, accepted=2, rounds=1, by_origin={"accepted": 2, "correction": 1}),
                rounds=[RoundRecord(0, 4, 2, "correction", "cloud", 3, rtt_ms=10)])
    prom.generations.labels("chat", "stop").inc()
    prom.errors.labels("invalid_request_error").inc()
    prom.responses.labels("200").inc()
    text = prom.render()
    assert b"process_cpu_seconds_total" in text
    out = promtool("check", "metrics", stdin=text)
    assert out.returncode == 0, out.stdout + out.stderr


def test_record_counts_tokens_by_way_and_the_switches() -> None:
    prom = EdgePrometheus.create()
    prom.record(EdgeMetrics(emitted=50, rounds=6, streamed=32, stream_calls=2, switches=3))
    prom.record(EdgeMetrics(emitted=9))  # cloud_only: neither way
    v = values(prom)
    p = "specsplit_edge_"
    assert v[(p + "way_tokens_total", (("way", "speculated"),))] == 18
    assert v[(p + "way_tokens_total", (("way", "streamed"),))] == 32
    assert v[(p + "stream_calls_total", ())] == 2 and v[(p + "way_switches_total", ())] == 3


def test_record_counts_bytes_by_direction_and_the_opens_and_states() -> None:
    prom = EdgePrometheus.create()
    prom.record(EdgeMetrics(bytes_up=400, bytes_down=9000, open_bytes_down=5000, feature_bytes=1160,
                            open_feature_bytes=3712))
    prom.record(EdgeMetrics(bytes_up=100, bytes_down=300, open_bytes_down=200))
    v = values(prom)
    p = "specsplit_edge_"
    assert v[(p + "wire_bytes_total", (("direction", "up"),))] == 500
    assert v[(p + "wire_bytes_total", (("direction", "down"),))] == 9300
    assert v[(p + "open_bytes_total", ())] == 5200
    assert v[(p + "state_bytes_total", (("answer", "verify"),))] == 1160
    assert v[(p + "state_bytes_total", (("answer", "open"),))] == 3712
