#!/usr/bin/env python3
"""gpu-check-summary.py STATE OUT STAGE...: gpu-check.sh's summary. Reads the stages' results
(STATE/results.tsv and the files beside it), OUT/tests.json and OUT/bench.json; prints the summary,
writes it to OUT/summary.txt, and exits 1 when anything failed."""
import json, os, re, sys
state, out, stages = sys.argv[1], sys.argv[2], sys.argv[3:]
results = []
path = os.path.join(state, "results.tsv")
if os.path.exists(path):
    with open(path) as f:
        results = [line.rstrip("\n").split("\t", 1) for line in f if "\t" in line]
value = {k: v for k, v in results}
failures = [v for k, v in results if k == "failure"]
lines = []

def gpu():
    text = os.popen("nvidia-smi --query-gpu=name,driver_version --format=csv,noheader "
                    "2>/dev/null").read().strip()
    return text or "unknown (nvidia-smi failed)"

lines.append("octet gpu-check  " + os.popen("date -u +%Y-%m-%dT%H:%M:%SZ").read().strip())
lines.append("gpu: " + gpu())
# The device tool copies the working tree's files, not its commits: there the checkout's HEAD is
# stale, so scripts/carry.sh records the local commit in .carry/commit for the summary to quote.
recorded = ".carry/commit"
if os.path.exists(recorded):
    lines.append("commit: " + open(recorded).read().strip() + " (recorded by scripts/carry.sh)")
else:
    dirty = os.popen("git status --porcelain --untracked-files=no 2>/dev/null").read().strip()
    lines.append("commit: " + (os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip()
                              or "unknown") + (" + uncommitted changes" if dirty else ""))
lines.append("stages: " + " ".join(stages) + "  (" + ", ".join(
    f"{s} {value[s + '_seconds']}s" for s in stages if s + "_seconds" in value) + ")")
info = os.path.join(state, "build_info.txt")
if "build" in stages and os.path.exists(info):
    for line in open(info):
        lines.append("build: " + line.strip().lstrip("- "))

# Tests: gtest's JSON (a test failed when it has failures; skipped when result is SKIPPED).
if "test" in stages:
    tests_json = os.path.join(out, "tests.json")
    if os.path.exists(tests_json):
        data = json.load(open(tests_json))
        passed = failed = skipped = 0
        failed_names = []
        for suite in data.get("testsuites", []):
            for case in suite.get("testsuite", []):
                if case.get("status") == "NOTRUN":
                    continue
                if case.get("failures"):
                    failed += 1
                    failed_names.append(suite["name"] + "." + case["name"])
                elif case.get("result") == "SKIPPED":
                    skipped += 1
                else:
                    passed += 1
        shard = f" (shard {value['test_shard']})" if "test_shard" in value else ""
        lines.append(f"tests{shard}: {passed} passed, {failed} failed, {skipped} skipped")
        for name in failed_names[:10]:
            lines.append("  FAILED " + name)
        if len(failed_names) > 10:
            lines.append(f"  ... and {len(failed_names) - 10} more (tests.log)")
    elif not os.path.exists(os.path.join(out, "tests.log")):
        lines.append("tests: not run")
    else:
        # No JSON (a crash or a timeout): count what gtest printed before it stopped.
        log = os.path.join(out, "tests.log")
        text = open(log, errors="replace").read() if os.path.exists(log) else ""
        ok = len(re.findall(r"^\[       OK \]", text, re.M))
        bad = len(re.findall(r"^\[  FAILED  \] \S+\.\S+ \(", text, re.M))
        skip = len(re.findall(r"^\[  SKIPPED \] \S+\.\S+ \(", text, re.M))
        lines.append(f"tests: no tests.json (exit {value.get('test_rc', '-')}); tests.log shows "
                     f"{ok} passed, {bad} failed, {skip} skipped before it ended")

if "sanitize" in stages:
    lines.append("sanitizer (%s tests, OCTET_TEST_SMALL=1):" % value.get("sanitizer_tests", "0"))
    for tool in ("memcheck", "racecheck", "synccheck", "initcheck"):
        lines.append(f"  {tool:<10} " + value.get("sanitizer_" + tool, "not run"))

# Benchmarks: the median aggregate of each run (or its single run), with its ceiling and ratio.
if "bench" in stages:
    bench_json = os.path.join(out, "bench.json")
    runs = {}
    try:
        data = json.load(open(bench_json))
        for b in data.get("benchmarks", []):
            # Drop the settings Google Benchmark appends ("/iterations:10/manual_time").
            name = re.sub(r"/(iterations:\d+|repeats:\d+|manual_time|real_time)", "",
                          b.get("run_name", b["name"]))
            if b.get("error_occurred"):
                runs[name] = b
            elif b.get("run_type") == "aggregate":
                if b.get("aggregate_name") == "median":
                    runs[name] = b
            else:
                runs.setdefault(name, b)
        reps = [b.get("repetitions") for b in data.get("benchmarks", []) if "repetitions" in b]
        lines.append("bench: %d benchmarks, median of %s repetitions; ceilings measured in this "
                     "run" % (len(runs), reps[0] if reps else "?"))
    except (OSError, ValueError, KeyError) as e:
        ran = os.path.exists(os.path.join(out, "bench.log"))
        lines.append(f"bench: no usable bench.json ({e}); see bench.log" if ran
                     else "bench: not run")
    unsupported = 0
    for name, b in runs.items():
        if b.get("error_occurred"):
            message = b.get("error_message", "")
            if message.startswith("unsupported: "):
                unsupported += 1
                lines.append(f"  {name:<52} skipped: {message[13:][:90]}")
            else:
                failures.append(f"bench: {name}: {message}")
                lines.append(f"  {name:<52} ERROR: {message[:90]}")
            continue
        if "/cublaslt/" in name:
            continue  # the raw call is the octet row's ceiling; its ratio is only a noise check
        ms = b.get("ms", 0.0)
        if "GBps" in b:
            same = b.get("ratio_same_size")
            lines.append(f"  {name:<52} {ms:8.3f} ms {b['GBps']:8.0f} GB/s  "
                         f"ceiling {b['ceiling_GBps']:6.0f} GB/s  ratio {b['ratio']:.3f}" +
                         (f"  (same-size copy: {same:.3f})" if same else ""))
        elif "TFLOPS" in b:
            lines.append(f"  {name:<52} {ms:8.3f} ms {b['TFLOPS']:8.1f} TFLOP/s  "
                         f"ceiling {b['ceiling_TFLOPS']:6.1f} TFLOP/s  ratio {b['ratio']:.3f}")
        elif "host_us_octet" in b:
            lines.append(f"  {name:<52} host {b['host_us_octet']:6.1f} us a call "
                         f"(raw cuBLASLt {b['host_us_cublaslt']:.1f} us)")
        else:
            lines.append(f"  {name:<52} {ms:8.3f} ms")
    if unsupported:
        lines.append(f"  ({unsupported} skipped as unsupported by the library)")
    # PyTorch's SDPA at the attention rows' shapes: one line per shape and pass, every backend.
    peer = os.path.join(out, "attention-peer.jsonl")
    if os.path.exists(peer):
        rows = [json.loads(l) for l in open(peer) if l.startswith("{")]
        lines.append(f"attention peer (torch {rows[0]['torch'] if rows else '?'} SDPA, "
                     "attention-peer.jsonl):")
        groups = {}
        for r in rows:
            key = f"{r['pass']}/{r['model']}/B{r['B']}_T{r['T']}_H{r['H']}_D{r['D']}"
            # "det": under torch.use_deterministic_algorithms(True); "(repeats differ)": its
            # backward gave different bytes on a second run all the same.
            name = r["backend"] + ("/det" if r.get("deterministic") else "")
            if r.get("repeats_bitwise") is False and r["pass"] != "forward":
                name += " (repeats differ)"
            groups.setdefault(key, []).append(
                f"{name} {r['ms']:.3f} ms {r['tflops']:.1f} TFLOP/s" if "ms" in r
                else f"{name} skipped")
        for key, cells in groups.items():
            lines.append(f"  {key:<44} " + ", ".join(cells))
    else:
        lines.append("attention peer: " + value.get("attention_peer", "no attention-peer.jsonl"))

if "bindings" in stages:
    lines.append("bindings: pytest " + value.get("bindings_pytest", "not run"))
    try:
        b = json.load(open(os.path.join(state, "bench_linear.json")))
        for case in ("large", "small"):
            r = b[case]
            lines.append(f"  octet.torch.Linear fwd+bwd {'x'.join(map(str, r['shape']))}: "
                         f"{r['octet_fp8_s'] * 1e3:.3f} ms vs torch.nn.Linear BF16 autocast "
                         f"{r['torch_bf16_s'] * 1e3:.3f} ms = {r['speedup']:.2f}x")
        s = b["small"]
        if "octet_direct_s" in s:
            cpp = (runs if "bench" in stages else {}).get(
                "linear/call_latency/fp8_delayed/M128_K1024_N1024", {}).get("ms")
            lines.append(f"  small call split: octet without autograd "
                         f"{s['octet_direct_s'] * 1e3:.3f} ms" +
                         (f" (C++ {cpp:.3f} ms)" if cpp else "") +
                         f", autograd floor {s['autograd_floor_s'] * 1e3:.3f} ms, "
                         f"module glue {s['module_glue_s'] * 1e3:.3f} ms")
    except (OSError, ValueError, KeyError):
        lines.append("  bench_linear.py: no result (bindings.log)")
    path = os.path.join(state, "cross_thread.txt")
    cross = [line for line in open(path).read().split("\n") if line] if os.path.exists(path) else []
    lines.extend("  cross_thread: " + line for line in cross)
    if not cross:
        lines.append("  cross_thread.py: no result (bindings.log)")
    lines.append("  " + (value.get("bindings_readme") or "README example: no result"))
    lines.append("  " + (value.get("bindings_pip") or "pip install ./python: no result"))

if "soak" in stages:
    lines.append("soak: guard soak (OCTET_GPU_SOAK=1) " + value.get("soak_guard", "not run"))
    lines.append("  " + value.get("soak_sweep", "seed sweep: not run"))
    lines.append("  snapshot: " + (value.get("soak_snapshot") or "no fp8_snapshot row"))

if "moe" in stages:
    lines.append("moe: field-shape repeatability, 8 runs: " + value.get("moe_repeat", "not run"))
    lines.append("moe (octet bench train --model moe-16x2048):")
    path = os.path.join(state, "moe_summary.txt")
    lines.extend(open(path).read().rstrip("\n").split("\n") if os.path.exists(path) else ["  not run"])

if "convergence" in stages:
    table = os.path.join(state, "convergence_table.txt")
    lines.append("convergence (scripts/convergence.sh gpu):")
    lines.extend(open(table).read().rstrip("\n").split("\n") if os.path.exists(table)
                 else ["  not run"])

lines.append("result: " + ("FAILED" if failures else "OK"))
for f in failures:
    lines.append("  " + f)
text = "\n".join(lines) + "\n"
open(os.path.join(out, "summary.txt"), "w").write(text)
sys.stdout.write(text)
sys.exit(1 if failures else 0)
