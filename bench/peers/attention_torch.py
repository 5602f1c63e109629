"""PyTorch's causal attention rates on this GPU, as a peer for octet_bench's attention rows.

torch.nn.functional.scaled_dot_product_attention (bf16, is_causal=True) under each backend of
torch.nn.attention.sdpa_kernel: cuDNN, FlashAttention and memory-efficient attention. Q, K and V are
strided views of one packed [B, T, 3, H, D] tensor, the layout octet's attention reads, so no backend
gets a copy made for it. Each view is detached into a leaf of its own (same storage, same strides):
the gradients are then the backend's dq, dk and dv, with no autograd pass that assembles a dqkv
from three zero-filled copies of qkv (octet's backward writes dqkv in place, so timing that assembly
would flatter octet). Passes: forward; backward alone (torch.autograd.grad on a kept graph); and
forward + backward. Shapes and FLOP counts are those of bench/attention_bench.cc: the causal half
only, 2 GEMMs forward and 5 backward (FlashAttention-2's convention), 7 for the pair, each GEMM
2*B*H*T^2*D/2 flops. CUDA-event timing, median of 20 after 5 warm-ups (gemm_torch.median_ms).
One JSON line per (shape, backend, pass); a backend that refuses a shape gets a line with "skipped".

Every backend runs twice: as PyTorch runs it by default, and under
torch.use_deterministic_algorithms(True) ("deterministic": true), the mode comparable to octet's
always-deterministic attention. A backend with no deterministic backward refuses there (a
"skipped" backward), or runs anyway: "repeats_bitwise" says whether two backward passes on the
same inputs gave the same dq, dk and dv bytes, so a backward that ignores the request shows.
"""
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gemm_torch import median_ms

# (model, B, T, H, D), as in attention_bench.cc's kCases.
SHAPES = [("gpt2_1.5b", 8, 1024, 25, 64), ("gpt2_124m", 8, 1024, 12, 64),
          ("gpt2_1.5b", 2, 4096, 25, 64), ("gpt2_124m", 2, 4096, 12, 64)]
BACKENDS = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
# Causal-half GEMMs per pass, as attention_bench.cc counts them.
GEMMS = {"forward": 2, "backward": 5, "forward+backward": 7}


def causal_gemm_flops(b, t, h, d):
    return 2.0 * b * h * t * t * d / 2


def packed_qkv(b, t, h, d):
    """q, k, v as [B, H, T, D] views of one [B, T, 3, H, D] tensor, uniform in [-1, 1] like
    attention_bench.cc's inputs, each a leaf requiring grad."""
    qkv = torch.rand(b, t, 3, h, d, device="cuda", dtype=torch.bfloat16) * 2 - 1
    return [qkv[:, :, part].transpose(1, 2).detach().requires_grad_(True) for part in range(3)]


def refusal(error):
    """A backend's refusal, as the "skipped" field gives it: the message's first line."""
    return str(error).splitlines()[0][:200]


def measure(b, t, h, d):
    """({pass: ms or the refusal's message}, whether two backwards repeat bytewise) under the
    active backend and determinism setting."""
    q, k, v = packed_qkv(b, t, h, d)
    dout = torch.rand(b, h, t, d, device="cuda", dtype=torch.bfloat16) * 2 - 1

    def forward():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def backward():
        return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    out = forward()  # raises here when the backend refuses the shape
    times = {"forward": median_ms(forward)}
    try:
        first = backward()
    except RuntimeError as e:  # no (deterministic) backward for this shape
        return {**times, "backward": refusal(e), "forward+backward": refusal(e)}, None
    repeats = all(torch.equal(x, y) for x, y in zip(first, backward()))
    times["backward"] = median_ms(backward)
    times["forward+backward"] = median_ms(lambda: torch.autograd.grad(forward(), (q, k, v), dout))
    return times, repeats


def main():
    for model, b, t, h, d in SHAPES:
        flops = causal_gemm_flops(b, t, h, d)
        for deterministic in (False, True):
            torch.use_deterministic_algorithms(deterministic)
            for name, backend in BACKENDS:
                row = {"model": model, "B": b, "T": t, "H": h, "D": d, "backend": name,
                       "deterministic": deterministic, "torch": torch.__version__}
                try:
                    with sdpa_kernel(backend):
                        times, repeats = measure(b, t, h, d)
                except RuntimeError as e:
                    times = {p: refusal(e) for p in GEMMS}
                    repeats = None
                if repeats is not None:
                    row["repeats_bitwise"] = repeats
                for pass_name, ms in times.items():
                    if isinstance(ms, str):
                        print(json.dumps({**row, "pass": pass_name, "skipped": ms}), flush=True)
                        continue
                    pass_flops = GEMMS[pass_name] * flops
                    print(json.dumps({**row, "pass": pass_name, "ms": ms,
                                      "tflops": pass_flops / ms / 1e9, "flops": pass_flops}),
                          flush=True)
                torch.cuda.empty_cache()
        torch.use_deterministic_algorithms(False)


if __name__ == "__main__":
    main()
