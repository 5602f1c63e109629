"""PyTorch's FP8 and BF16 GEMM rates on this GPU, as a peer for octet_bench's gemm rows.

torch._scaled_mm (E4M3 x E4M3 -> BF16, per-tensor scales, fast accumulation) and torch.matmul
(BF16) at 8192^3 and at the GPT-2 1.5B training shapes (M = 8 x 1024 tokens). Random inputs,
never zeros; CUDA-event timing, median of 20 after 5 warm-ups. One JSON line per shape.
"""
import json
import torch

SHAPES = [(8192, 8192, 8192), (8192, 4800, 1600), (8192, 1600, 1600), (8192, 6400, 1600),
          (8192, 1600, 6400)]


def median_ms(fn, warmup=5, reps=20):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def main():
    dev = "cuda"
    one = torch.ones((), device=dev)
    for m, n, k in SHAPES:
        a = torch.randn(m, k, device=dev).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn)
        fp8 = median_ms(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one,
                                                 out_dtype=torch.bfloat16, use_fast_accum=True))
        ab, bb = torch.randn(m, k, device=dev, dtype=torch.bfloat16), torch.randn(
            n, k, device=dev, dtype=torch.bfloat16)
        bf16 = median_ms(lambda: ab @ bb.t())
        flops = 2.0 * m * n * k
        print(json.dumps({"m": m, "n": n, "k": k, "fp8_ms": fp8, "fp8_tflops": flops / fp8 / 1e9,
                          "bf16_ms": bf16, "bf16_tflops": flops / bf16 / 1e9}), flush=True)


if __name__ == "__main__":
    main()
