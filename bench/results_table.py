"""Markdown tables of runs/table/* (FMNIST testbed) and runs/mnist/* beside the papers' numbers.

    python bench/results_table.py [runs]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# FedReG paper, Table 6 (testbed: FMNIST, 30 clients, Dir(0.1), join 0.2, 100 rounds): (G, P) %.
FEDREG_TABLE6 = {
    "fedavg": (82.13, 98.05), "fedprox": (81.18, 98.05), "fedper": (72.27, 98.29),
    "fedrep": (59.75, 97.88), "fedbabu": (78.73, 97.76), "fedrod": (83.96, 98.01),
    "fedreg": (86.12, 98.25),
}
# FedSeq paper, Table 2, MNIST at T=100 (t = 0/100/200): personalized %.
FEDSEQ_TABLE2_T100 = {"fedavg": 91.48, "fedper": 98.30, "lg-fedavg": 97.95, "fedrep": 98.56,
                      "fedrod": 98.61, "fedbabu": 98.19, "fedseq-vanilla": 98.21,
                      "fedseq-anti": 98.34}
ORDER = ["fedavg", "fedprox", "fedper", "fedrep", "lg-fedavg", "fedbabu", "fedrod", "fedreg",
         "fedseq-vanilla", "fedseq-anti"]


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f}"


def load(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def summary(rows: list[dict]) -> dict:
    train = [r for r in rows if r["phase"] == "train"]
    g = [r["global_acc"] for r in train if r["global_acc"] is not None]
    p = [r["personal_acc"] for r in rows if r["personal_acc"] is not None]
    return {
        "rounds": len(train), "final_g": rows[-1]["global_acc"], "best_g": max(g, default=None),
        "final_p": rows[-1]["personal_acc"], "best_p": max(p, default=None),
        "note": train[-1].get("global_model"),
        "finetune": rows[-1]["phase"] == "finetune",
    }


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "runs")
    print("| algorithm | rounds | global final / best | personalized final / best | "
          "FedReG Table 6 G / P |")
    print("|---|---|---|---|---|")
    for alg in ORDER:
        rows = load(root / "table" / alg)
        if not rows:
            continue
        s = summary(rows)
        paper = FEDREG_TABLE6.get(alg)
        mark = "*" if s["note"] else ""
        ft = " (fine-tuned)" if s["finetune"] else ""
        print(f"| {alg} | {s['rounds']} | {pct(s['final_g'])}{mark} / {pct(s['best_g'])}{mark} | "
              f"{pct(s['final_p'])}{ft} / {pct(s['best_p'])} | "
              f"{f'{paper[0]:.2f} / {paper[1]:.2f}' if paper else '-'} |")
    mnist = [a for a in ORDER if load(root / "mnist" / a)]
    if mnist:
        print("\n| algorithm (MNIST) | rounds | personalized final | FedSeq Table 2, T=100 |")
        print("|---|---|---|---|")
        for alg in mnist:
            s = summary(load(root / "mnist" / alg))
            print(f"| {alg} | {s['rounds']} | {pct(s['final_p'])} | "
                  f"{FEDSEQ_TABLE2_T100.get(alg, '-')} |")


if __name__ == "__main__":
    main()
