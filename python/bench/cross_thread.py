"""What running a backward on another thread costs octet's small Linear call: the same
forward+backward through octet's framework-free API, with the backward on the calling thread,
then on a second Python thread (as PyTorch's autograd engine runs every CUDA backward on a
thread of its own), then on the calling thread again. Prints the host microseconds a step and
of each half; the step is pipelined (no synchronize per call). Needs a GPU and PyTorch.

  PYTHONPATH=python OCTET_C_LIBRARY=build/liboctet_c.so python3 python/bench/cross_thread.py
"""
import argparse
import queue
import threading
import time

import torch

import octet
import octet.torch as ot


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=128)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--calls", type=int, default=1000)
    a = p.parse_args()
    torch.manual_seed(0)
    x = torch.randn(a.m, a.k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(a.m, a.n, device="cuda", dtype=torch.bfloat16)
    module = ot.Linear(a.k, a.n, device="cuda")
    core, device = module._core, module._device
    recipe, registry = octet.Recipe.delayed(), octet.default_registry()
    spent = {"forward": 0.0, "backward": 0.0}

    def forward():
        start = time.perf_counter()
        with octet.fp8_autocast(recipe, registry=registry):
            _, record = core.forward(ot._to_dlpack(x), "training", None, ot._stream(device),
                                     ot._to_torch)
        spent["forward"] += time.perf_counter() - start
        return record

    def backward(record):
        start = time.perf_counter()
        core.backward(ot._to_dlpack(dy), record, ot._stream(device), ot._to_torch)
        registry.finalize_backward()
        spent["backward"] += time.perf_counter() - start

    records, done = queue.Queue(), queue.Queue()

    def worker():
        while True:
            backward(records.get())
            done.put(None)

    threading.Thread(target=worker, daemon=True).start()

    def on_caller():
        backward(forward())

    def on_worker():
        records.put(forward())
        done.get()

    for name, step in (("backward on the calling thread", on_caller),
                       ("backward on a second thread", on_worker),
                       ("backward on the calling thread again", on_caller)):
        for _ in range(50):
            step()
        torch.cuda.synchronize()
        spent["forward"] = spent["backward"] = 0.0
        start = time.perf_counter()
        for _ in range(a.calls):
            step()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        us = 1e6 / a.calls
        print(f"{name}: step {elapsed * us:.1f} us, forward {spent['forward'] * us:.1f} us, "
              f"backward {spent['backward'] * us:.1f} us")


if __name__ == "__main__":
    main()
