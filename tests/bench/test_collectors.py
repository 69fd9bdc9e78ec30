"""Collectors: peak RSS with reset, CPU time, the cloud's Prometheus text, KV size, the gauge poller."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from bench.collectors import (
    GaugePoller,
    PeakRss,
    cpu_seconds,
    kv_bytes_per_token,
    machine_info,
    metric_delta,
    parse_prometheus,
    status_kib,
)

# a child that holds ~200 MiB, frees it, then waits for stdin to close
_ALLOC = """
import sys
block = bytearray(200 * 1024 * 1024)
for i in range(0, len(block), 4096):
    block[i] = 1
del block
print("freed", flush=True)
sys.stdin.read()
"""


def test_peak_rss_sees_a_freed_allocation_until_reset() -> None:
    """The child's high-water mark includes its freed 200 MiB; after a reset it does not (where
    the kernel refuses the reset, the documented fallback keeps the peak from process start)."""
    child = subprocess.Popen([sys.executable, "-c", _ALLOC], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"freed"
        assert status_kib(child.pid, "VmHWM") * 1024 > 190 * 1024**2
        rss = PeakRss(child.pid)  # resets on construction
        assert rss.current_bytes() < 100 * 1024**2
        if rss.resettable:
            assert rss.peak_bytes() < 100 * 1024**2
        else:
            assert rss.peak_bytes() > 190 * 1024**2
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)


def test_cpu_seconds_grow_while_a_process_spins() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<0.6: pass"])
    try:
        time.sleep(0.05)
        first = cpu_seconds(child.pid)
        time.sleep(0.4)
        second = cpu_seconds(child.pid)
        assert second > first
    finally:
        child.wait(10)


def test_parse_prometheus_keeps_labels_and_skips_comments() -> None:
    text = ("# HELP specsplit_cloud_rounds_total verify rounds\n# TYPE specsplit_cloud_rounds_total counter\n"
            "specsplit_cloud_rounds_total 12.0\n"
            'specsplit_cloud_position_checked_total{position="1"} 7.0\n'
            "specsplit_cloud_kv_bytes 1.5e+06\n")
    m = parse_prometheus(text)
    assert m["specsplit_cloud_rounds_total"] == 12.0
    assert m['specsplit_cloud_position_checked_total{position="1"}'] == 7.0
    assert m["specsplit_cloud_kv_bytes"] == 1.5e6
    assert len(m) == 3
    assert metric_delta({"a": 1.0}, {"a": 4.0}, "a") == 3.0
    assert metric_delta({}, {"a": 4.0}, "a") == 4.0


def test_kv_bytes_per_token_of_gpt2_and_gqa_configs() -> None:
    assert kv_bytes_per_token({"n_layer": 8, "n_embd": 256, "n_head": 8}) == 2 * 8 * 256 * 4
    gqa = {"num_hidden_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2}
    assert kv_bytes_per_token(gqa, dtype_bytes=2) == 2 * 4 * 2 * 64 * 2
    with pytest.raises(ValueError):
        kv_bytes_per_token({"n_layer": 2})


def test_gauge_poller_keeps_the_peak() -> None:
    values = iter([1.0, 5.0, 3.0] + [2.0] * 1000)

    def fetch(url: str) -> dict[str, float]:
        return {"g": next(values)}

    with GaugePoller("http://unused", "g", period_s=0.001, fetch=fetch) as poller:
        deadline = time.monotonic() + 5
        while poller.samples < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert poller.peak == 5.0


def test_machine_info_names_the_cpu_and_versions() -> None:
    info = machine_info(1, 1)
    assert info.cpus >= 1 and info.cpus_usable >= 1
    assert info.versions["torch"] != "-"
