"""Draw a run's loss, per-slot accuracy and tau curves from RUN_DIR/metrics.jsonl to PNG.

    python -m train.plot RUN_DIR [--out RUN_DIR/curves.png]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir} (is it a train.train run directory?)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} is empty: the run has not logged a step yet")
    return rows


def plot(run_dir: str | Path, out: str | Path | None = None) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("train.plot needs matplotlib: pip install matplotlib") from e
    rows = read_metrics(run_dir)
    steps = np.asarray([r["step"] for r in rows])
    fig, (ax_loss, ax_acc, ax_tau) = plt.subplots(1, 3, figsize=(15, 4))
    ax_loss.plot(steps, [r["loss"] for r in rows])
    ax_loss.set(title="loss", xlabel="step", yscale="log")
    accuracy = np.asarray([r["slot_accuracy"] for r in rows])  # [steps, G-1]
    for k in range(accuracy.shape[1]):
        ax_acc.plot(steps, accuracy[:, k], label=f"slot {k + 1}", alpha=1.0 - 0.8 * k / accuracy.shape[1])
    ax_acc.set(title="per-slot accuracy", xlabel="step", ylim=(0, 1))
    ax_acc.legend(fontsize="x-small", ncol=2)
    ax_tau.plot(steps, [r["tau_estimate"] for r in rows], label="estimate from slot accuracy")
    measured = [(r["step"], r["tau"]) for r in rows if "tau" in r]
    if measured:
        ax_tau.plot(*zip(*measured), "o-", label="generate (held-out prompts)")
    ax_tau.set(title="tau (tokens per cycle)", xlabel="step")
    ax_tau.legend(fontsize="small")
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.plot", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--out", help="PNG path (default RUN_DIR/curves.png)")
    args = p.parse_args(argv)
    try:
        print(plot(args.run_dir, args.out))
    except (ImportError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
