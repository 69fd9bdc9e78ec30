"""How a session began (edge/policy/stream.py `start`) is reported where a person reads a generation: a row of the
CLI's summary table and the OpenAI server's `specsplit` object; and --ca-cert's help says what it needs."""

from __future__ import annotations

from typing import Any

from edge.cli import build_parser
from edge.report import summary_table
from edge.server.openai_engine import Finished
from tests.edge.fake_cloud import FakeCloud

PROMPT = [5, 6, 7, 8, 9, 10]
# a verify of k costs about k + 1 steps: a session with no pooled acceptance streams from its first token
ROW_BOUND = {"base_ms": 1.0, "row_ms": 50.0, "forwards": 200}


def row(table: str, name: str) -> str:
    return next(line[len(name):].strip() for line in table.splitlines() if line.startswith(name))


def test_the_summary_table_says_how_the_session_began(make_client: Any, fake_cloud: FakeCloud) -> None:
    fake_cloud.open_forward_cost = ROW_BOUND
    client, _ = make_client(temperature=0, max_new_tokens=12, stop_at_eos=False)
    got = client.generate(PROMPT)
    assert (got.metrics.start_way, got.metrics.start_reason) == ("stream", "cloud_costs")
    began = row(summary_table(got), "session began")
    assert began == f"stream (cloud_costs): {got.metrics.start_note}" and "steps a token speculating" in began

    fake_cloud.open_forward_cost = None  # the cloud says no cost: rounds first, and the table says why
    plain, _ = make_client(temperature=0, max_new_tokens=12, stop_at_eos=False)
    assert row(summary_table(plain.generate(PROMPT)), "session began").startswith("speculate (no_cost_figures): ")
    alone, _ = make_client(temperature=0, max_new_tokens=12, stop_at_eos=False, mode="cloud_only")
    assert row(summary_table(alone.generate(PROMPT)), "session began") == "-"  # no speculate-or-stream choice


def test_the_openai_answer_says_how_the_session_began(make_client: Any, fake_cloud: FakeCloud) -> None:
    fake_cloud.open_forward_cost = ROW_BOUND
    client, _ = make_client(temperature=0, max_new_tokens=12, stop_at_eos=False)
    m = client.generate(PROMPT).metrics
    ext = Finished("length", "", len(PROMPT), 12, m).specsplit()
    assert (ext["start_way"], ext["start_reason"]) == ("stream", "cloud_costs")


def test_ca_cert_help_says_it_needs_tls() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name in ("generate", "serve"):
        help_ = next(a.help for a in commands[name]._actions if a.dest == "ca_cert") or ""
        assert "https://" in help_ and "--grpc-tls" in help_
