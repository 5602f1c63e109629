"""octet.torch.Linear against torch.nn.Linear under BF16 autocast, in one run (issue 17's targets):
FP8 forward+backward at M = 16384, K = N = 8192, and the per-call overhead of a small Linear
(M = 128, K = N = 1024). Prints one JSON line. Needs a GPU (or --device cpu with small --m/--k/--n
to check that it runs). --profile also prints, to stderr, where the small case's host time goes
(cProfile over its forward+backward calls, and torch.profiler's CPU-side table).

The small case also splits octet.torch.Linear's time (octet_fp8_s): octet_direct_s is the same
octet Linear driven through octet's framework-free API exactly as octet.torch drives it (DLPack
capsules, the current stream, fp8_autocast, finalize) with no autograd; autograd_floor_s is a
torch.nn.Module around an autograd Function that takes the same inputs and does nothing. So
octet_fp8_s - octet_direct_s is what autograd and octet.torch's glue add (module_glue_s: that
minus the floor), and octet_direct_s minus octet_bench's linear/call_latency (the C++ API) is
what octet's Python and C layers add.

  PYTHONPATH=python OCTET_C_LIBRARY=build/liboctet_c.so python3 python/bench/bench_linear.py
"""
import argparse
import contextlib
import json
import time

import torch

import octet
import octet.torch as ot


def timed(step, device, iters, warmup=5):
    """Median seconds of `step` over `iters` runs (device-synchronized per run)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def fwd_bwd(module, x, dy, context):
    def step():
        with context():
            y = module(x)
        y.backward(dy)
    return step


def direct_fwd_bwd(module, x, dy, recipe):
    """module's octet Linear called as octet.torch calls it, without autograd."""
    core, device, registry = module._core, module._device, octet.default_registry()

    def step():
        with octet.fp8_autocast(recipe, registry=registry):
            y, record = core.forward(ot._to_dlpack(x), "training", None, ot._stream(device),
                                     ot._to_torch)
        core.backward(ot._to_dlpack(dy), record, ot._stream(device), ot._to_torch)
        registry.finalize_backward()
    return step


class _Nothing(torch.autograd.Function):
    """octet.torch.Linear's Function signature and outputs, without the work."""

    @staticmethod
    def forward(ctx, x, weight, bias, module, scope, grad_enabled):
        ctx.x_shape = x.shape
        return x.new_empty(x.shape[:-1] + (weight.shape[0],))

    @staticmethod
    def backward(ctx, dy):
        return dy.new_empty(ctx.x_shape), None, None, None, None, None


class _Floor(torch.nn.Module):
    """The autograd floor: a module with octet.torch.Linear's inputs around _Nothing."""

    def __init__(self, like):
        super().__init__()
        self.weight, self.bias = like.weight, like.bias

    def forward(self, x):
        return _Nothing.apply(x, self.weight, self.bias, self, octet.active_scope(),
                              torch.is_grad_enabled())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--small", default="128,1024,1024",
                   help="M,K,N of the per-call overhead case (e.g. 16,16,16 on a CPU, where the "
                        "issue's 128x1024x1024 is mostly arithmetic)")
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    torch.manual_seed(0)
    dev = a.device
    recipe = octet.Recipe.delayed()
    results = {}
    small = tuple(int(v) for v in a.small.split(","))
    for name, (m, k, n) in {"large": (a.m, a.k, a.n), "small": small}.items():
        # A small call takes about a millisecond on a GPU: more calls for a steadier median.
        iters = max(a.iters, 200) if name == "small" and dev.startswith("cuda") else a.iters
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        fp8 = ot.Linear(k, n, device=dev)
        ref = torch.nn.Linear(k, n, device=dev)
        t_fp8 = timed(fwd_bwd(fp8, x, dy, lambda: octet.fp8_autocast(recipe)), dev, iters)
        t_bf16 = timed(fwd_bwd(ref, x, dy, lambda: torch.autocast(dev.split(":")[0],
                                                                   dtype=torch.bfloat16)), dev, iters)
        flops = 3 * 2 * m * k * n
        results[name] = {"shape": [m, k, n], "octet_fp8_s": t_fp8, "torch_bf16_s": t_bf16,
                         "speedup": t_bf16 / t_fp8, "octet_tflops": flops / t_fp8 / 1e12}
        if name == "small":
            t_direct = timed(direct_fwd_bwd(fp8, x, dy, recipe), dev, iters)
            t_floor = timed(fwd_bwd(_Floor(fp8), x, dy, contextlib.nullcontext), dev, iters)
            results[name].update({"octet_direct_s": t_direct, "autograd_floor_s": t_floor,
                                  "module_glue_s": t_fp8 - t_direct - t_floor})
    print(json.dumps(results))
    if a.profile:
        profile_small(dev, recipe)


def profile_small(dev, recipe, calls=200):
    """Where a small call's host time goes: the Python frames (cProfile), then PyTorch's ops."""
    import cProfile
    import pstats
    import sys

    x = torch.randn(128, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(128, 1024, device=dev, dtype=torch.bfloat16)
    step = fwd_bwd(ot.Linear(1024, 1024, device=dev), x, dy, lambda: octet.fp8_autocast(recipe))
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    for _ in range(10):
        step()
    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step()
        sync()
    prof.disable()
    print(f"=== cProfile, {calls} small forward+backward calls, by own time", file=sys.stderr)
    pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(20)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        for _ in range(calls):
            step()
            sync()
    print(f"=== torch.profiler, the same {calls} calls", file=sys.stderr)
    print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=20), file=sys.stderr)


if __name__ == "__main__":
    main()
