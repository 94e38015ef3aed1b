"""The benchmark scripts keep working: ``--record``'s markdown, and tiny runs of each script.

Speed is never asserted here (benchmarks/RESULTS.md holds the measured numbers); these tests
check that each script runs its contenders, parses their logs and prints its tables.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import record  # noqa: E402


def test_record_fences_log_lines_and_appends_a_dated_section(tmp_path):
    text = "# run 1: 12 ms\n# run 2: 13 ms\n\n| a | b |\n|---|---|\n| 1 | 2 |\n# end\n"
    assert record.to_markdown(text) == [
        "```text", "# run 1: 12 ms", "# run 2: 13 ms", "```", "", "| a | b |", "|---|---|",
        "| 1 | 2 |", "```text", "# end", "```"]
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n")
    record.append_section("Peers", "python benchmarks/x.py --fast", text, str(results))
    written = results.read_text()
    assert written.startswith("# Benchmark results\n\n### Peers: 20")
    assert "Command: `python benchmarks/x.py --fast`" in written
    assert f"{os.cpu_count()} cores" in written
    assert written.rstrip().endswith("# end\n```")


def test_recording_appends_only_after_a_clean_run(tmp_path, capsys):
    results = tmp_path / "RESULTS.md"
    with record.recording(True, "Clean", str(results)):
        print("| x |")
    assert "| x |" in capsys.readouterr().out  # still printed
    assert "### Clean: " in results.read_text() and "| x |" in results.read_text()
    with pytest.raises(RuntimeError):
        with record.recording(True, "Broken", str(results)):
            print("| partial |")
            raise RuntimeError("contender failed")
    assert "Broken" not in results.read_text()
    with record.recording(False, "Off", str(results)):
        print("| off |")
    assert "Off" not in results.read_text()


def _run(args, timeout):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
def test_bench_peers_tiny_run_prints_every_contender():
    pytest.importorskip("transformers")
    out = _run(["benchmarks/bench_peers.py", "--layers", "1", "--hidden", "64", "--heads", "2",
                "--seq", "32", "--vocab", "256", "--micro-batch", "2", "--iters", "2",
                "--warmup", "1", "--repeats", "1", "--threads", "1",
                "--contenders", "ours,ours-sdpa,hf,nanogpt,ours-bf16"], timeout=400)
    for name in ("ours", "ours-sdpa", "hf", "nanogpt", "ours-bf16"):
        row = re.search(rf"^\| {re.escape(name)} \| (\d+) \| (\d+) \| ([\d.]+) \|", out, re.M)
        assert row, out
        assert int(row.group(2)) > 0
    # CPU time is counted in clock ticks: this tiny run may show none (n/a).
    assert re.search(r"^\| ours / hf \| [\d.]+x \| ([\d.]+x|n/a) \| "
                     r">= 1.15x: (met|not met) \|$", out, re.M), out
    assert re.search(r"^\| ours-bf16 / ours \| [\d.]+x \|", out, re.M), out
    assert re.search(r"^ours: [\d.]+% of this model's fp32 GEMM mix rate \(target >= 90%: "
                     r"(met|not met)\)$", out, re.M), out
    assert re.search(r"vector extensions: .*\| fused CPU bodies: (baseline|x86-64-v3|x86-64-v4) "
                     r"clone", out), out


@pytest.mark.slow
def test_gpu_run_dry_run_on_cpu(tmp_path):
    """The one GPU script, every stage on the CPU: it cannot rot before a GPU runs it. The
    parity stage holds this CPU to the losses shipped with the script."""
    out = subprocess.run(["bash", "benchmarks/gpu_run.sh", "--dry-run", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=1800,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    for stage in ("env", "build", "kernels", "parity", "bf16", "mfu", "recompute", "profile"):
        assert re.search(rf"^\| {stage} \| ok \|", out.stdout, re.M), (stage, out.stdout[-4000:])
    for name in ("megatron-124m", "megatron-1.3b", "hf-gpt2-124m", "megatron-1.3b-selective"):
        assert re.search(rf"^\| {re.escape(name)} \|", out.stdout, re.M), out.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs.tar.gz", "summary.json",
                                                          "summary.md"]
    parity = json.loads((tmp_path / "summary.json").read_text())["stages"][3]
    assert parity["name"] == "parity" and parity["details"]["max_abs_diff"] <= 1e-4


def test_gpu_run_parity_file_matches_its_flags():
    """The recorded CPU losses belong to the flags the parity stage runs (a changed flag without
    a new recording fails here, not on the GPU)."""
    import gpu_run

    recorded = json.loads(pathlib.Path(gpu_run.PARITY_FILE).read_text())
    assert recorded["flags"] == " ".join(gpu_run.PARITY_FLAGS)
    assert len(recorded["losses"]) == 6 and all(5.0 < x < 9.0 for x in recorded["losses"])


def test_gpu_run_top_kernels_reads_a_chrome_trace(tmp_path):
    import gpu_run

    events = [{"cat": "kernel", "name": "gemm", "dur": 30.0},
              {"cat": "kernel", "name": "softmax", "dur": 10.0},
              {"cat": "kernel", "name": "gemm", "dur": 20.0},
              {"cat": "cpu_op", "name": "aten::mm", "dur": 500.0}]
    (tmp_path / "a.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
    assert gpu_run.top_kernels(str(tmp_path), "kernel") == [("gemm", 50 / 60),
                                                            ("softmax", 10 / 60)]
    with pytest.raises(gpu_run.StageError, match="no cuda_runtime events"):
        gpu_run.top_kernels(str(tmp_path), "cuda_runtime")


@pytest.mark.slow
def test_bench_scaling_tiny_run_reports_every_layout():
    out = _run(["benchmarks/bench_scaling.py", "--layers", "2", "--hidden", "64", "--heads", "2",
                "--seq", "32", "--vocab", "256", "--micro-batch", "1", "--global-batch", "4",
                "--iters", "4", "--warmup", "2", "--repeats", "1", "--quiet-wait", "0",
                "--quiet-window", "0.2", "--profile-ops"], timeout=900)
    for layout in ("(1,1,1)", "(2,1,1)", "(1,2,1)", "(1,1,2)"):
        # Throughput and a measured communication share for every layout.
        row = re.search(rf"^\| {re.escape(layout)} \| \d x \d \| \d+ \| \d+ \| [\d.]+x \|"
                        rf" ([\d.]+%)", out, re.M)
        assert row, out


@pytest.mark.slow
def test_bench_checkpoint_formats_small_run_prints_every_ratio():
    out = _run(["benchmarks/bench_checkpoint_formats.py", "--small", "--repeats", "1"],
               timeout=900)
    for what in ("save time, fastest", "save time, median", "load time, fastest",
                 "load time, median", "bytes on disk"):
        assert re.search(rf"^\| {re.escape(what)} \| [\d.]+ (s|MiB) \| [\d.]+ (s|MiB) \| "
                         r"[\d.]+x \|$", out, re.M), out
    for kind in ("save", "load"):
        for what in ("peak RSS", "extra over start"):
            assert re.search(rf"^\| {kind} {what}, rank 0 / rank 1 \(median\) \| \d+ / \d+ MiB "
                             r"\| \d+ / \d+ MiB \| ([\d.]+x|n/a) \|$", out, re.M), out
    # The torch_dist checkpoint saved at TP=2 loaded at TP=1 x DP=2 (checked inside the run).
    assert re.search(r"^\| TP=1 x DP=2, distributed optimizer \| [\d.]+ s \| [\d.]+ s \|", out,
                     re.M), out


def test_peak_allocated_bytes_follows_allocations_and_frees():
    from bench_context_parallel import peak_allocated_bytes

    mib = 1024 * 1024

    def work():
        a = torch.empty(4 * mib, dtype=torch.uint8)
        b = torch.empty(8 * mib, dtype=torch.uint8)      # 12 MiB held: the peak
        del a
        c = torch.empty(2 * mib, dtype=torch.uint8)      # 10 MiB
        del b, c

    assert peak_allocated_bytes(work) == 12 * mib


@pytest.mark.slow
def test_bench_context_parallel_tiny_run_prints_each_size():
    out = _run(["benchmarks/bench_context_parallel.py", "--seq", "512", "--layers", "1",
                "--hidden", "32", "--heads", "2", "--cp-sizes", "1", "2", "--repeats", "1"],
               timeout=300)
    rows = re.findall(r"^\| ([12]) \| ([\d.]+) \| ([\d.]+) \|", out, re.M)
    assert [r[0] for r in rows] == ["1", "2"], out
    # What autograd holds at the end of the forward is part of each rank's peak. It once read
    # higher at CP 2: the census counted what a graph node that died in the forward (the
    # detached row maxima of the blockwise attention) had saved.
    for _, saved, peak in rows:
        assert 0 < float(saved) <= float(peak), out


def _mla_sizes_by_hand(layers, heads, hidden, groups, d, r, dv, lora, element=4):
    """KV cache bytes per token, worked out by hand: standard attention keeps a key and a value
    of hidden/heads per key/value head; MLA's expanded cache keeps the per-head keys (d + r) and
    values (dv); its latent cache (--cache-mla-latents) keeps lora + r."""
    head = hidden // heads
    return {"mha": layers * 2 * heads * head * element,
            "gqa": layers * 2 * groups * head * element,
            "mla": layers * heads * (d + r + dv) * element,
            "mla-latent": layers * (lora + r) * element}


def test_bench_mla_cache_of_a_generation_holds_expanded_or_latent_keys():
    import bench_mla

    a = bench_mla.parse(["--quick", "--seq", "8"])
    want = _mla_sizes_by_hand(2, 4, 64, 2, 16, 8, 16, 24)
    for kind in bench_mla.CONTENDERS:
        assert bench_mla.measure_cache(a, kind, bench_mla.build(a, kind))[0] == want[kind], kind
    latent = bench_mla.build(a, "mla", cache_mla_latents=True)
    assert bench_mla.measure_cache(a, "mla-latent", latent)[0] == want["mla-latent"]


@pytest.mark.slow
def test_bench_mla_quick_run_prints_every_contender():
    out = _run(["benchmarks/bench_mla.py", "--quick"], timeout=600)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.splitlines() if re.match(r"\| (mha|gqa|mla|mla-latent) \|", line)}
    assert sorted(rows) == ["gqa", "mha", "mla", "mla-latent"], out
    want = _mla_sizes_by_hand(2, 4, 64, 2, 16, 8, 16, 24)
    for kind, cells in rows.items():
        if kind != "mla-latent":
            assert float(cells[1]) > 0, out                           # fwd+bwd ms
        assert int(cells[2].replace(",", "")) == want[kind], out      # KV cache B/token
    assert rows["mla-latent"][1] == "-" and rows["mla-latent"][0] == rows["mla"][0], out


def test_bench_fsdp_counts_each_storage_once():
    """Parameters, gradients (``grad`` or a shared ``main_grad`` buffer) and Adam's state, each
    storage once, against the sizes written out by hand."""
    from bench_fsdp import held_bytes

    first, second = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False)
    buffer = torch.zeros(4 * 3 + 3 + 3 * 2)             # one gradient buffer, viewed per param
    offset = 0
    for param in (*first.parameters(), *second.parameters()):
        param.main_grad = buffer[offset:offset + param.numel()].view_as(param)
        offset += param.numel()
    optimizer = torch.optim.Adam([*first.parameters(), *second.parameters()])
    (second(first(torch.randn(5, 4)))).sum().backward()
    optimizer.step()
    held = held_bytes([first, second], optimizer)
    params = (12 + 3 + 6) * 4
    assert held["params"] == params
    assert held["grads"] == params + buffer.numel() * 4     # .grad of each, and the buffer
    # exp_avg and exp_avg_sq per parameter, and its step (a 0-dim fp32 tensor)
    assert held["optimizer"] == 2 * params + 3 * 4


@pytest.mark.slow
def test_bench_fsdp_quick_run_meets_the_memory_target():
    out = _run(["benchmarks/bench_fsdp.py", "--quick"], timeout=900)
    for kind in ("FSDP2", "plain DP"):
        for dp in (1, 2):
            row = re.search(rf"^\| {kind} \| {dp} \| (?:[\d.]+ \| ){{5}}([\d.]+) \| ([\d.]+) \|",
                            out, re.M)
            assert row, out
            assert abs(float(row[1]) - 1) <= 0.10, row[0]      # held / accounting
            # FSDP2 holds 1/DP of DP 1's bytes; plain DP the same bytes on every rank
            assert float(row[2]) == pytest.approx(1.0 if kind == "FSDP2" else dp, rel=0.1)
    assert re.search(r"^\| 2 \| [\d.]+ \| [\d.]+ \| [\d.]+x \|$", out, re.M), out
    assert "meets the target" in out, out


@pytest.mark.slow
def test_bench_host_memory_tiny_run_counts_both_ways_with_identical_losses():
    out = _run(["benchmarks/bench_host_memory.py", "--layers", "1", "--hidden", "64", "--heads",
                "2", "--seq", "32", "--vocab", "256", "--micro-batch", "2", "--iters", "2",
                "--warmup", "1", "--repeats", "2", "--threads", "1"], timeout=400)
    for name in ("kept", "glibc default"):
        assert re.search(rf"^\| {name} \| 4 \| \d+, \d+ \| \d+ \| \d+ \| \d+ \|$", out, re.M), out
    assert "losses of the counted steps identical both ways: True" in out, out
