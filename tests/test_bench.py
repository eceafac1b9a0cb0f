"""`neuronpy bench`: the metric definitions on hand-made timings, and quick runs on tiny-llama."""

from __future__ import annotations

import argparse
import json
import math
import sys

import pytest
import torch

from neuronpy.bench import cli, memory, metrics, report
from neuronpy.bench.config import BenchConfig, Progress, quick_config
from neuronpy.bench.lineup import Weights
from neuronpy.bench.records import Divergence, RequestRecord, Run
from neuronpy.bench.results import BenchResults
from neuronpy.bench.runner import run_bench
from neuronpy.bench.workloads import PromptSource, poisson_rate, w1, w2, w4
from tests.factories import fixture_dir, hf_model, tokenizer

# ---- metrics on hand-made timings ---------------------------------------------------------------


def test_percentile_interpolates_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert metrics.percentile(values, 0) == 1.0
    assert metrics.percentile(values, 100) == 4.0
    assert metrics.percentile(values, 50) == 2.5
    assert metrics.percentile(values, 99) == pytest.approx(3.97)
    assert metrics.percentile(values, 25) == pytest.approx(1.75)
    assert metrics.percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        metrics.percentile([], 50)


def test_request_record_ttft_tpot_itl_e2el() -> None:
    r = RequestRecord(sent=1.0, chunk_times=(1.5, 1.7, 2.0, 2.5), output_tokens=4)
    assert r.ttft == pytest.approx(0.5)
    assert r.e2el == pytest.approx(1.5)
    assert r.tpot == pytest.approx((1.5 - 0.5) / 3)
    assert r.itls == pytest.approx([0.2, 0.3, 0.5])
    # TPOT counts tokens, not chunks: 2 chunks carrying 5 tokens
    r2 = RequestRecord(sent=0.0, chunk_times=(0.1, 0.9), output_tokens=5)
    assert r2.tpot == pytest.approx(0.8 / 4)
    assert RequestRecord(sent=0.0, chunk_times=(0.3,), output_tokens=1).tpot is None


def test_summarize_pools_itl_and_averages_tpot_per_request() -> None:
    a = RequestRecord(sent=0.0, chunk_times=(0.1, 0.2, 0.4), output_tokens=3, prompt_tokens=5)
    b = RequestRecord(sent=0.5, chunk_times=(1.0, 1.3), output_tokens=2, prompt_tokens=7)
    one = RequestRecord(sent=0.0, chunk_times=(0.2,), output_tokens=1, prompt_tokens=1)
    bad = RequestRecord(sent=0.0, error="boom")
    s = metrics.summarize([a, b, one, bad])
    assert s.duration_s == pytest.approx(1.3)  # first send to last chunk
    assert (s.completed, s.failed, s.errors) == (3, 1, ("boom",))
    assert s.output_tokens == 6 and s.input_tokens == 13
    assert s.output_tok_s == pytest.approx(6 / 1.3)
    assert s.request_s == pytest.approx(3 / 1.3)
    # TTFT per request: 0.1, 0.5, 0.2 s
    assert s.ttft_ms.p50 == pytest.approx(200.0)
    assert s.ttft_ms.mean == pytest.approx(800 / 3)
    # TPOT over requests with 2+ tokens: a (0.4-0.1)/2 = 0.15, b 0.3/1 = 0.3
    assert s.tpot_ms.n == 2
    assert s.tpot_ms.mean == pytest.approx(225.0)
    # ITL pooled: 0.1, 0.2 (a) and 0.3 (b)
    assert s.itl_ms.n == 3
    assert s.itl_ms.p50 == pytest.approx(200.0)
    assert s.itl_ms.max == pytest.approx(300.0)
    assert s.itl_ms.p99 == pytest.approx(298.0)
    # E2EL: 0.4, 0.8, 0.2
    assert s.e2el_ms.p50 == pytest.approx(400.0)
    assert metrics.summarize([a], duration=2.0).output_tok_s == pytest.approx(1.5)
    # the results file's keys
    assert list(s.to_json()) == [
        "requests",
        "completed",
        "failed",
        "errors",
        "duration_s",
        "input_tokens",
        "output_tokens",
        "output_tok_s",
        "request_s",
        "ttft_ms",
        "tpot_ms",
        "itl_ms",
        "e2el_ms",
    ]
    assert s.to_json()["errors"] == ["boom"]
    assert list(s.to_json()["ttft_ms"]) == ["mean", "p50", "p90", "p99", "max", "n"]


def test_scaling_efficiency_and_parity() -> None:
    assert metrics.scaling_efficiency(80.0, 8, 16.0) == pytest.approx(0.625)
    assert metrics.scaling_efficiency(80.0, 8, 0.0) is None
    same = RequestRecord(sent=0, chunk_times=(1,), token_ids=(1, 2, 3))
    other = RequestRecord(sent=0, chunk_times=(1,), token_ids=(1, 2, 9))
    p = metrics.parity([same, other], [same, same])
    assert p is not None
    assert (p.identical, p.total, p.identical_share) == (1, 2, 0.5)
    assert p.first_divergence == (Divergence(request=1, position=2),)
    assert p.to_json()["first_divergence"] == [{"request": 1, "position": 2}]
    texts = metrics.parity([RequestRecord(sent=0, text="abc")], [RequestRecord(sent=0, text="abd")])
    assert texts is not None and texts.compared == "text"
    assert texts.first_divergence == (Divergence(request=0, position=2),)
    assert metrics.parity([RequestRecord(sent=0)], [RequestRecord(sent=0)]) is None


def test_join_stall_takes_the_gaps_overlapping_the_join() -> None:
    decoders = [
        # the join window is [0.25, 0.8]: the join's send to its second token
        RequestRecord(sent=0, chunk_times=(0.0, 0.1, 0.2, 0.7, 0.8), tag="decode"),
        RequestRecord(sent=0, chunk_times=(0.0, 0.1, 0.2, 0.3, 0.9, 1.0), tag="decode"),
    ]
    join = RequestRecord(sent=0.25, chunk_times=(0.6, 0.8), output_tokens=2, tag="join")
    j = metrics.join_stall([*decoders, join])
    assert j is not None
    assert j.decoder_itl_p50_ms == pytest.approx(100.0)
    assert j.decoder_itl_max_during_join_ms == pytest.approx(600.0)
    assert j.stall_ratio == pytest.approx(6.0)
    assert j.join_ttft_ms == pytest.approx(350.0)
    # overlapping the window: 0.2-0.7, 0.7-0.8 and 0.2-0.3, 0.3-0.9; not 0.9-1.0
    assert j.gaps_during_join == 4
    assert j.decoders_outlived_join is True
    assert metrics.join_stall(decoders) is None


def test_engine_delta_split_and_batch() -> None:
    before = {"decode_steps": 10, "decoded_rows": 10, "max_batch_size": 1, "running": 0}
    before["timing"] = {"forward": 1.0, "sampling": 0.1}
    after = {"decode_steps": 30, "decoded_rows": 90, "max_batch_size": 4, "running": 0}
    after["timing"] = {"forward": 2.0, "sampling": 0.3}
    d = metrics.engine_delta(before, after, duration=2.0)
    assert d is not None
    assert d.decode_steps == 20 and d.decode_steps_per_s == pytest.approx(10.0)
    assert d.mean_batch_size == pytest.approx(4.0)
    assert d.time_s == pytest.approx({"forward": 1.0, "sampling": 0.2, "other": 0.8})
    assert d.time_share is not None and d.time_share["forward"] == pytest.approx(0.5)
    assert "max_batch_size" not in d.counters and "running" not in d.counters
    assert d.padding_waste is None
    assert set(d.to_json()) == {
        "counters",
        "decode_steps",
        "decode_steps_per_s",
        "mean_batch_size",
        "max_batch_size_so_far",
        "time_s",
        "time_share",
        "ms_per_step",
        "padding_waste",
    }
    # without a time split (a server without /stats timing): time_s null, no shares
    untimed = metrics.engine_delta({"decode_steps": 1}, {"decode_steps": 3}, duration=1.0)
    assert untimed is not None and untimed.time_s is None
    assert "time_share" not in untimed.to_json() and untimed.to_json()["time_s"] is None
    assert metrics.engine_delta(None, after, 1.0) is None


def test_peak_rss_is_readable() -> None:
    memory.reset_peak_rss()
    assert memory.peak_rss_mb() > 0


# ---- workloads ---------------------------------------------------------------------------------


def test_workloads_are_deterministic_and_shared_across_k() -> None:
    source = PromptSource(360, special_ids=[0, 1, 2], seed=0)
    a, b = w1(source, 2, 16, 8), w1(source, 4, 16, 8)
    assert a.requests == b.requests[:2]  # prompt i is the same at every K
    assert all(len(r.prompt_ids) == 16 and r.max_tokens == 8 for r in b.requests)
    assert not {0, 1, 2} & {t for r in b.requests for t in r.prompt_ids}
    assert PromptSource(360, seed=1).prompt("W1:0", 16) != source.prompt("W1:0", 16)
    rate = poisson_rate(100.0, 0.5, (10, 30))
    assert rate == pytest.approx(2.5)
    staggered = w2(source, 6, rate, 0.5, (4, 8), (2, 4))
    arrivals = [r.arrival for r in staggered.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert staggered.requests == w2(source, 6, rate, 0.5, (4, 8), (2, 4)).requests
    join = w4(source, 7, 16, 32, 100)
    assert [r.tag for r in join.requests] == ["decode"] * 7 + ["join"]
    assert join.requests[-1].after_tokens == 8 and len(join.requests[-1].prompt_ids) == 100


# ---- quick runs on the tiny fixture --------------------------------------------------------------


def _weights() -> Weights:
    return Weights(hf_model("tiny-llama"), tokenizer("tiny-llama"), "tiny-llama")


SILENT = Progress(write=lambda line: None)


@pytest.fixture(scope="module")
def quick_results() -> BenchResults:
    config = quick_config(ks=(1, 2), prompt_len=16, output_len=8, peers=("hf-generate",))
    return run_bench(config, weights=_weights(), progress=SILENT, argv=["--quick"])


def test_quick_w1_in_process_with_a_peer(quick_results: BenchResults, tmp_path) -> None:
    """The results file as docs/benchmarks.md's readers know it: its keys and figures."""
    results = quick_results.to_json()
    assert set(results) == {"meta", "config", "systems", "workloads"}
    assert results["meta"]["model"] == "tiny-llama"
    assert set(results["systems"]) == {"neuronpy", "hf-generate"}
    points = results["workloads"]["W1"]["points"]
    assert [p["point"] for p in points] == ["K=1", "K=2"]
    for k, point in zip((1, 2), points, strict=True):
        assert set(point["results"]) == {"neuronpy", "hf-generate"}
        for name, r in point["results"].items():
            assert r["completed"] == k and r["failed"] == 0, name
            assert r["output_tokens"] == k * 8, name  # EOS ignored: every token counted
            assert r["input_tokens"] == k * 16
            assert r["output_tok_s"] > 0 and math.isfinite(r["output_tok_s"])
            for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
                d = r[key]
                assert 0 <= d["p50"] <= d["p99"] <= d["max"], (name, key)
            assert r["itl_ms"]["n"] >= 1
            assert r["ttft_ms"]["max"] <= r["e2el_ms"]["max"]
            assert r["memory"]["rss_peak_mb"] > 0
            assert r["repeats_output_tok_s"] == [r["output_tok_s"]]
            assert r["repeats_median_output_tok_s"] == r["output_tok_s"]
            assert "join" not in r and "error" not in r  # W4's, and a failed run's
        engine = point["results"]["neuronpy"]["engine"]
        assert engine["mean_batch_size"] == pytest.approx(k, rel=0.3)
        assert engine["decode_steps"] >= 7  # the first token comes from the prefill
        assert {"forward", "prefill", "rebatch", "sampling", "other"} <= set(engine["time_s"])
        assert point["results"]["hf-generate"]["engine"] is None
        assert point["results"]["hf-generate"]["step_profile"] is None
        assert point["ratios"]["neuronpy/hf-generate"] > 0
    efficiency = results["workloads"]["W1"]["scaling_efficiency"]
    assert efficiency["neuronpy"]["1"] == pytest.approx(1.0)
    assert efficiency["neuronpy"]["2"] > 0
    assert results["config"]["max_in_flight"] == 2 and results["config"]["ks"] == [1, 2]
    assert results["meta"]["command"] == "neuronpy bench --quick"
    assert "parity" not in points[0] and "speculation" not in points[0]  # no such peers ran
    # the same figures, typed
    typed = quick_results.workloads["W1"].points[1]
    assert typed.rate("neuronpy") == points[1]["results"]["neuronpy"]["output_tok_s"]
    assert typed.results["hf-generate"].step_profile is None
    # the outputs: table, JSON and plot
    table = report.format_report(quick_results)
    for text in (
        "W1 closed loop",
        "neuronpy",
        "hf-generate",
        "/hf-generate",
        "E(K)",
        "K=2",
    ):
        assert text in table
    path = report.write_json(quick_results, tmp_path / "out" / "bench.json")
    loaded = json.loads(path.read_text())
    assert loaded["workloads"]["W1"]["points"][1]["results"]["neuronpy"]["output_tokens"] == 16
    assert "_records" not in json.dumps(loaded) and "_info" not in json.dumps(loaded)


def test_w1_says_where_neuronpys_decode_steps_go() -> None:
    """A profiled run beside the measured one: ms per decode step by where it went, and the
    report's line for it."""
    config = quick_config(ks=(2,), prompt_len=16, output_len=160, peers=())
    results = run_bench(config, weights=_weights(), progress=SILENT)
    (point,) = results.workloads["W1"].points
    prof = point.results["neuronpy"].step_profile
    assert prof is not None and prof.decode_steps > 0
    assert prof.mean_batch_size == pytest.approx(2, rel=0.3)
    ms = prof.per_step_ms
    assert ms["linear"] > 0 and ms["attention"] > 0 and ms["step"] > 0
    parts = sum(ms[k] for k in ("linear", "attention", "other ops", "worker python"))
    assert parts + ms["worker idle"] == pytest.approx(ms["step"], rel=0.05)
    table = report.format_report(results)
    assert "K=2 neuronpy profiled: step" in table and "event loop CPU" in table


def test_plot_degrades_without_matplotlib(
    quick_results: BenchResults, tmp_path, monkeypatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    path, message = report.plot_throughput(quick_results, tmp_path / "plot.png")
    assert path is None and "matplotlib" in message
    assert not (tmp_path / "plot.png").exists()


def test_plot_writes_a_png(quick_results: BenchResults, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    path, _ = report.plot_throughput(quick_results, tmp_path / "plot.png")
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failing_peer_is_reported_not_fatal(monkeypatch) -> None:
    from neuronpy.bench.systems import hf_generate

    def broken(self, workload):
        raise RuntimeError("peer fell over")

    monkeypatch.setattr(hf_generate.HfGenerate, "run", broken)
    config = quick_config(ks=(1,), prompt_len=16, output_len=4, peers=("hf-generate",))
    results = run_bench(config, weights=_weights(), progress=SILENT)
    point = results.to_json()["workloads"]["W1"]["points"][0]
    assert point["results"]["neuronpy"]["output_tokens"] == 4
    failed = point["results"]["hf-generate"]
    assert "peer fell over" in failed["error"] and failed["wall_s"] >= 0
    assert failed["repeats_output_tok_s"] == [None]
    assert failed["repeats_median_output_tok_s"] is None
    assert "neuronpy/hf-generate" not in point["ratios"]
    assert "peer fell over" in report.format_report(results)


def test_quick_w1_over_http() -> None:
    config = quick_config(ks=(2,), prompt_len=16, output_len=8, peers=(), drive="http")
    results = run_bench(config, weights=_weights(), progress=SILENT)
    r = results.workloads["W1"].points[0].results["neuronpy"].run
    assert results.systems["neuronpy"]["drive"] == "http"
    assert results.systems["neuronpy"]["model"] == "tiny-llama"
    assert isinstance(r, Run) and (r.summary.completed, r.summary.output_tokens) == (2, 16)
    assert r.engine is not None and r.engine.mean_batch_size == pytest.approx(2, rel=0.3)
    assert all(rec.text for rec in r.records)  # kept for parity over HTTP


# ---- the command line ---------------------------------------------------------------------------


def test_cli_flags_build_the_config() -> None:
    parser = argparse.ArgumentParser(prog="neuronpy")
    cli.add_parser(parser.add_subparsers(dest="command"))
    peers = "hf-static,neuronpy-serial"
    args = parser.parse_args(["bench", "--quick", "--k", "1,4", "--peers", peers, "--repeats", "2"])
    config = cli.config_from_args(args)
    assert isinstance(config, BenchConfig)
    assert config.quick and config.ks == (1, 4) and config.repeats == 2
    assert config.peers == ("neuronpy-serial", "hf-static")  # in the table's order
    assert config.prompt_len == 32 and config.workloads == ("W1",)
    args = parser.parse_args(["bench", "--workloads", "all", "--url", "http://127.0.0.1:9"])
    config = cli.config_from_args(args)
    assert config.workloads == ("W1", "W2", "W3", "W4", "W5", "W6") and config.drive == "http"
    args = parser.parse_args(["bench", "--speculative", "ngram", "--num-speculative-tokens", "6"])
    config = cli.config_from_args(args)
    assert config.speculative == "ngram" and config.num_speculative_tokens == 6
    assert config.resolved_max_in_flight() == 16
    for bad in (["--k", "0"], ["--peers", "vllm"], ["--workloads", "W9"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", *bad])


@pytest.mark.parametrize("drive", ["engine", "http"])
def test_w5_runs_w1s_streams_constrained_beside_w1(drive: str) -> None:
    """W5: every request under a schema of its own, every token written (the schemas never
    complete), batched equal to serial, and its tokens/s set beside W1's at the same K."""
    config = quick_config(
        ks=(2,),
        prompt_len=16,
        output_len=12,
        peers=("neuronpy-serial", "hf-generate"),
        workloads=("W1", "W5"),
        drive=drive,
    )
    results = run_bench(config, weights=_weights(), progress=SILENT)
    (point,) = results.workloads["W5"].points
    assert set(point.results) == {"neuronpy", "neuronpy-serial"}  # hf has no constraints
    ours = point.results["neuronpy"].run
    assert isinstance(ours, Run) and ours.summary.output_tokens == 2 * 12
    assert point.parity is not None and point.parity.identical == point.parity.total == 2
    assert point.ratios["W5/W1"] > 0
    assert "constrained / unconstrained (W5 / W1)" in report.format_report(results)


def test_gpu_bench_runs_its_code_on_a_tiny_random_llama_on_the_cpu(tmp_path, capsys) -> None:
    """`python -m neuronpy.bench.gpu` measures on a GPU; `--shape tiny --device cpu` runs the
    same code: a random Llama, the roofline, W1 against generate_batch, the JSON."""
    from neuronpy.bench import gpu

    out = tmp_path / "gpu.json"
    argv = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--k", "1,2"]
    assert gpu.main([*argv, "--prompt-len", "8", "--output-len", "4", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    assert summary["roofline_tok_s"] > 0 and summary["k1_roofline_share"] > 0
    printed = capsys.readouterr().out
    assert "of the roofline" in printed and "generate_batch" in printed
    if not torch.cuda.is_available():
        assert gpu.main(["--device", "cuda"]) == 2  # says so, measures nothing


def test_w6_and_speculation_beside_neuronpy() -> None:
    """--speculative runs neuronpy-spec beside neuronpy on every point: greedy outputs are
    the same, its tokens/s is set over neuronpy's, its drafts' figures are reported; W6's
    prompts are the grounded chat requests in the model's template."""
    from neuronpy.bench.grounded import grounded_messages
    from neuronpy.bench.runner import grounded_prompts

    config = quick_config(
        ks=(2,), output_len=24, peers=(), workloads=("W1", "W6"), speculative="ngram"
    )
    results = run_bench(config, weights=_weights(), progress=SILENT)
    (point,) = results.workloads["W6"].points
    assert set(point.results) == {"neuronpy", "neuronpy-spec"}
    same = point.spec_parity
    assert same is not None and same.identical == same.total == 2
    assert point.ratios["spec/off"] > 0
    assert point.speculation is not None and point.speculation.draft_tokens > 0
    doc = results.to_json()["workloads"]["W6"]["points"][0]
    assert {"spec_parity", "speculation"} <= set(doc) and "parity" not in doc
    assert "speculative / not (neuronpy-spec / neuronpy)" in report.format_report(results)
    prompts = grounded_prompts(tokenizer("tiny-llama"), 2, max_len=512 - 24)
    assert point.params["prompt_len"] == max(len(p) for p in prompts) > 100
    assert grounded_messages(0) != grounded_messages(1) and grounded_messages(
        0
    ) == grounded_messages(0)


def test_versus_times_the_native_step_beside_transformers(capsys: pytest.CaptureFixture) -> None:
    """`python -m neuronpy.bench.versus` on a hybrid fixture: a row per batch size, both
    figures and their ratio (what they are is the benchmark's to say, not a test's)."""
    from neuronpy.bench import versus

    versus.main(["--model", str(fixture_dir("tiny-lfm2")), "--batch", "1,3", "--steps", "1"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["1", "3"]
    assert all(r[-1].endswith("x") and float(r[-1][:-1]) > 0 for r in rows)  # (never below 0)


def test_serving_measures_servers_one_at_a_time_side_by_side(tmp_path) -> None:
    """Two real `neuronpy serve` processes, each started by its command, measured by the same
    closed loop and ended (its whole process group) before the next starts; every request
    writes all its tokens and the table sets each server beside the first."""
    import socket

    from neuronpy.bench import serving

    def free_port() -> int:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return probe.getsockname()[1]

    model = fixture_dir("tiny-llama")
    servers = []
    for name, extra in (("in-process", "--engine-process off"), ("apart", "")):
        port = free_port()
        command = f"{sys.executable} -m neuronpy serve --model {model} --port {port}"
        command += f" --compile off --dtype float32 --max-in-flight 2 {extra}"
        servers.append(serving.Server.parse(f"{name}={port}={command}"))
    lineup = serving.run(
        servers,
        [1, 2],
        per_stream=2,
        prompt_len=8,
        output_len=5,
        vocab=300,
        log_dir=tmp_path,
        start_timeout=300,
        echo=lambda _: None,
    )
    assert [(p.server, p.k) for p in lineup.points] == [
        ("in-process", 1),
        ("in-process", 2),
        ("apart", 1),
        ("apart", 2),
    ]
    for point in lineup.points:
        assert point.summary.failed == 0
        assert point.summary.completed == 2 * point.k
        assert point.summary.output_tokens == 5 * 2 * point.k
    first, second = lineup.points[0], lineup.points[-1]
    assert first.stopped_s <= second.started_s  # never two servers at once
    for server in servers:  # each one ended with its group: nothing listens on its port
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", server.port)) != 0
    text = serving.table(lineup)
    assert "| K | round | in-process | apart | apart / in-process |" in text
    assert len(json.loads(json.dumps(serving.to_json(lineup), default=str))["points"]) == 4
    with pytest.raises(ValueError, match="NAME=PORT=COMMAND"):
        serving.Server.parse("no-port=neuronpy serve")
    broken = serving.Server.parse(f"broken={free_port()}={sys.executable} -c 'raise SystemExit(3)'")
    with pytest.raises(RuntimeError, match="broken exited"):
        serving.run([broken], [1], log_dir=tmp_path, echo=lambda _: None)
