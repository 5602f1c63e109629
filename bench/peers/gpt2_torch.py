"""PyTorch peer for `octet bench train`: the same GPT-2 shapes, trained the usual fast way.

bf16 autocast, scaled_dot_product_attention (flash), fused AdamW, eager or torch.compile.
Prints one JSON line per configuration, in the same fields as `octet bench train`:
median tokens/s over the timed steps and the peak GPU memory of the run.

  python3 bench/peers/gpt2_torch.py --model gpt2-1.5b --batch 8 --seq 1024 --mode both
"""
import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

PRESETS = {  # layers, dim, heads (GPT-2 paper sizes; vocab padded to 50304 like llm.c)
    "gpt2-124m": (12, 768, 12),
    "gpt2-350m": (24, 1024, 16),
    "gpt2-1.5b": (48, 1600, 25),
}


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers, dim, heads, vocab, max_seq):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()  # tied embeddings
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def run(args, compiled):
    # PyTorch's default initialization (N(0, 1) embeddings, tied to the head) and random tokens:
    # the reported loss is large, which changes no FLOP or byte of the step being timed.
    torch.manual_seed(0)
    layers, dim, heads = PRESETS[args.model]
    # The position table grows past GPT-2's 1024 for longer sequences, as octet's does.
    model = GPT(layers, dim, heads, args.vocab, max(1024, args.seq)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    step_model = torch.compile(model) if compiled else model
    torch.cuda.reset_peak_memory_stats()
    tokens = args.batch * args.seq
    rates = []
    for i in range(args.warmup + args.steps):
        idx = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")
        tgt = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_model(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= args.warmup:
            rates.append(tokens / (time.perf_counter() - start))
    rates.sort()
    print(json.dumps({
        "bench": "train", "peer": "pytorch-" + ("compile" if compiled else "eager"),
        "model": args.model, "precision": "bf16-autocast", "batch": args.batch, "seq": args.seq,
        "steps": args.steps, "tokens_per_s": rates[len(rates) // 2],
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "params": sum(p.numel() for p in model.parameters()), "last_loss": loss.item(),
        "torch": torch.__version__}), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2-124m", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--mode", choices=["eager", "compile", "both"], default="both")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    modes = {"eager": [False], "compile": [True], "both": [False, True]}[args.mode]
    for compiled in modes:
        run(args, compiled)


if __name__ == "__main__":
    main()
