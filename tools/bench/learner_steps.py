"""Wall time of a few `Learner.train_step`s of a small MoE on whatever device the learner picks (the CPU here), for
comparing a learner change before and after, strict mode's cost first (docs/benchmarks.md, "Thirtieth session").

    TORCHDYNAMO_DISABLE=1 python tools/bench/learner_steps.py --precision nvfp4 --strict --tokens 256

The model: 2 layers, hidden 256, vocab 512, 64 experts top-8 of ffn 256, 8 heads / 2 KV groups of 32 (`MODEL`;
`--set key=value` overrides, as `minite train --set`). The batch: 4 rows of `--tokens` random token ids, loss
-mean(log p). Prints one line: every step's seconds, the last step's loss and gradient norm, and the process's peak
resident memory (ru_maxrss, the whole process, model building included)."""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MODEL = ["model.num_layers=2", "model.hidden_size=256", "model.vocab_size=512", "model.num_experts=64",
         "model.moe_router_topk=8", "model.moe_ffn_hidden_size=256", "model.head_dim=32",
         "model.num_attention_heads=8", "model.num_query_groups=2", "rl.seed=3"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precision", choices=("bf16", "nvfp4"), default="nvfp4")
    p.add_argument("--strict", action="store_true", help="alignment.strict=true")
    p.add_argument("--tokens", type=int, default=64, help="tokens per row (4 rows)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args(argv)
    if a.tokens < 2 or a.steps < 1:
        p.error("--tokens must be >= 2 and --steps >= 1")
    import torch

    from minite.config import load_config
    from minite.learner.learner import Learner

    sets = [*MODEL, f"precision.mode={a.precision}", f"model.max_position_embeddings={max(a.tokens, 64)}",
            *(["alignment.strict=true"] if a.strict else []), *a.set]
    cfg = load_config(None, sets)
    learner = Learner(cfg)
    tokens = torch.randint(0, cfg.model.vocab_size, (4, a.tokens), generator=torch.Generator().manual_seed(0))
    times, out = [], {}
    for _ in range(a.steps):
        t0 = time.perf_counter()
        out = learner.train_step(tokens, lambda lp: (-lp.mean(), {}))
        times.append(time.perf_counter() - t0)
    print(f"{a.precision} {'strict' if a.strict else 'default'} {a.tokens} tokens: steps "
          + " / ".join(f"{t:.3f}" for t in times) + f" s | loss {out['loss']:.6f} grad_norm {out['grad_norm']:.6f}"
          f" | peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
