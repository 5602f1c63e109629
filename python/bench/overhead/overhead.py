"""Host time per Linear forward+backward at a tiny shape, layer by layer: octet's C++ API
(linear_cpp.cc), the C API called from C (linear_capi.c), and the Python package over NumPy
(or PyTorch tensors on a GPU), so that each layer's own cost is a difference of two numbers.
Needs no GPU: on the CPU a tiny shape (default M = K = N = 16) leaves little but host overhead.
Builds the two programs against an octet build tree (liboctet.a and liboctet_c.so) first.

  python3 python/bench/overhead/overhead.py --build build-cpu [--device cpu] [--profile]

Prints one JSON line: microseconds per call of each path, wall time and the calling thread's CPU
time (the latter barely moves when other processes share the cores), and the differences. Each
figure is the lowest of --rounds medians, the paths taking turns. On the CPU, OMP_NUM_THREADS
defaults to 1 so that no worker thread's time escapes the count.
--profile also prints cProfile's table of the Python path to stderr.
"""
import argparse
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def make_variables(path):
    """NAME = value lines of a CMake flags.make."""
    found = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^(\w+) = (.*)$", line)
        if m:
            found[m.group(1)] = m.group(2)
    return found


def with_cuda(build):
    flags = make_variables(build / "CMakeFiles/octet.dir/flags.make")
    return "-DOCTET_WITH_CUDA=1" in flags.get("CXX_DEFINES", "")


def run(cmd, cwd=None):
    subprocess.run(cmd, cwd=cwd, check=True, shell=isinstance(cmd, str))


def build_programs(build):
    """Compiles linear_cpp (linked like the octet CLI, against liboctet.a) and linear_capi
    (against liboctet_c.so) into BUILD/overhead; returns their paths."""
    out = build / "overhead"
    out.mkdir(exist_ok=True)
    cpp, capi = out / "linear_cpp", out / "linear_capi"
    flags = make_variables(build / "CMakeFiles/octet_cli.dir/flags.make")
    obj = out / "linear_cpp.o"
    run(" ".join(["c++", flags.get("CXX_FLAGS", ""), flags.get("CXX_DEFINES", ""),
                  flags.get("CXX_INCLUDES", ""), f"-I{ROOT}/include", f"-I{ROOT}/src", "-c",
                  shlex.quote(str(HERE / "linear_cpp.cc")), "-o", shlex.quote(str(obj))]))
    link = (build / "CMakeFiles/octet_cli.dir/link.txt").read_text().strip()
    link = link.replace("CMakeFiles/octet_cli.dir/tools/octet.cc.o", shlex.quote(str(obj)))
    link = re.sub(r" -o octet ", f" -o {shlex.quote(str(cpp))} ", link)
    run(link, cwd=build)
    cuda = ["-DLINEAR_CAPI_CUDA", "-I/usr/local/cuda/include", "-L/usr/local/cuda/lib64",
            "-lcudart"] if with_cuda(build) else []
    # The C API's own include path: dlpack.h may live outside /usr/include (the GPU machine's
    # comes from .carry/include through OCTET_DLPACK_INCLUDE_DIR).
    c_api = make_variables(build / "CMakeFiles/octet_c.dir/flags.make")
    run(["cc", "-O2", "-std=c11", f"-I{ROOT}/include", *shlex.split(c_api.get("CXX_INCLUDES", "")),
         str(HERE / "linear_capi.c"), "-o", str(capi), f"-L{build}", "-loctet_c",
         f"-Wl,-rpath,{build}"] + cuda)
    return cpp, capi


def program_us(program, device, m, k, n, calls):
    """(wall, CPU) microseconds per call of one of the two programs."""
    text = subprocess.run([str(program), device, str(m), str(k), str(n), str(calls)], check=True,
                          capture_output=True, text=True).stdout
    got = json.loads(text)
    return got["us"], got["cpu_us"]


def python_step(device, m, k, n):
    """One forward+backward through octet.Linear (no autograd), as linear_capi.c makes it."""
    import octet

    lin = octet.Linear(k, n, device=device, seed=1)
    recipe, registry = octet.Recipe.delayed(), octet.Registry()
    if device == "cpu":
        import numpy

        x = numpy.full((m, k), 0.5, dtype=numpy.float32)
        dy = numpy.full((m, n), 0.25, dtype=numpy.float32)
        sync = lambda: None  # noqa: E731
    else:
        import torch

        x = torch.full((m, k), 0.5, device=device)
        dy = torch.full((m, n), 0.25, device=device)
        sync = torch.cuda.synchronize

    def step():
        with octet.fp8_autocast(recipe, registry=registry):
            y, record = lin.forward(x)
        lin.backward(dy, record)
        registry.finalize_backward()
        sync()
    return step


def python_us(step, calls):
    """(wall, CPU) microseconds per call of `step`."""
    for _ in range(20):
        step()
    wall, cpu = [], []
    for _ in range(calls):
        w, c = time.perf_counter_ns(), time.thread_time_ns()
        step()
        cpu.append(time.thread_time_ns() - c)
        wall.append(time.perf_counter_ns() - w)
    return sorted(wall)[calls // 2] / 1e3, sorted(cpu)[calls // 2] / 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", default="build", help="an octet build tree")
    p.add_argument("--device", default="cpu")
    p.add_argument("--m", type=int, default=16)
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    build = pathlib.Path(a.build).resolve()
    os.environ.setdefault("OCTET_C_LIBRARY", str(build / "liboctet_c.so"))
    if a.device == "cpu":
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # before octet (and OpenMP) load
    sys.path.insert(0, str(ROOT / "python"))
    cpp, capi = build_programs(build)
    shape = (a.m, a.k, a.n)
    step = python_step(a.device, *shape)
    paths = {"cpp": lambda: program_us(cpp, a.device, *shape, a.calls),
             "capi": lambda: program_us(capi, a.device, *shape, a.calls),
             "python": lambda: python_us(step, a.calls)}
    best = {}
    for _ in range(a.rounds):
        for name, measure in paths.items():
            got = measure()
            best[name] = tuple(map(min, zip(best.get(name, got), got)))
    result = {"device": a.device, "shape": list(shape)}
    for i, clock in enumerate(("us", "cpu_us")):
        for name in paths:
            result[f"{name}_{clock}"] = round(best[name][i], 2)
        result[f"capi_minus_cpp_{clock}"] = round(best["capi"][i] - best["cpp"][i], 2)
        result[f"python_minus_capi_{clock}"] = round(best["python"][i] - best["capi"][i], 2)
    print(json.dumps(result))
    if a.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.calls):
            step()
        prof.disable()
        print(f"=== cProfile, {a.calls} forward+backward calls through octet.Linear, by own time",
              file=sys.stderr)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
