"""How long is what a user sees when fxmem refuses? Each case of issue 28's error table runs in a fresh
Python process; prints the exception's last line and how many lines were printed on stderr.

    python scripts/error_lengths.py            # FXMEM_FULL_TRACEBACK=1 in front: every frame, as before
"""
from __future__ import annotations

import subprocess
import sys

SETUP = """
import torch, torch.nn.functional as F, transformers, warnings, fxmem
warnings.simplefilter("ignore")
torch.manual_seed(0)
config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                 bos_token_id=0, eos_token_id=0, use_cache=False)
model, ids = transformers.GPT2LMHeadModel(config), torch.randint(0, 64, (2, 8))
ce = lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
"""
CASES = {
    "budget far too small": "fxmem.optimize(model, budget_gb=1e-5, loss_fn=ce)(ids, target=ids)",
    "loss_fn returns a non-scalar": "fxmem.optimize(model, budget_gb=1.0, loss_fn=lambda o, t: o.logits)(ids, target=ids)",
    "opt(x, y) where loss_fn needs target=": "fxmem.optimize(model, budget_gb=1.0, loss_fn=ce)(ids, ids)",
    "opt(x) with loss_fn set": "fxmem.optimize(model, budget_gb=1.0, loss_fn=ce)(ids)",
    "torch.compile, budget far too small": "torch.compile(model, backend='fxmem', options={'budget_gb': 1e-5, "
                                           "'inner': 'aot_eager'})(ids, labels=ids)",
}


def main() -> None:
    for name, call in CASES.items():
        done = subprocess.run([sys.executable, "-c", SETUP + call], capture_output=True, text=True)
        lines = [line for line in done.stderr.splitlines() if not line.startswith("[transformers]")]
        last = next((line for line in reversed(lines) if line and not line.startswith(("(", " ", "Set "))), "")
        print(f"{name:40s} {len(lines):4d} lines  {last[:100]}")
    pipe = subprocess.run(f"{sys.executable} -m fxmem.cli.main --list-models | head -1", shell=True,
                          capture_output=True, text=True)
    print(f"{'fxmem-plan --list-models | head -1':40s} {len(pipe.stderr.splitlines()):4d} lines on stderr")


if __name__ == "__main__":
    main()
