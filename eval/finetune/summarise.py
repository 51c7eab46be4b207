"""out/finetune/<name> (a recipes/finetune_lora.py run) -> RUN_FOLDER/summary.json: final metrics + loss curve.

    python eval/finetune/summarise.py tiny_yarn_4x WALL_SECONDS "machine note" \
        eval/results/tiny/finetune_yarn_4x-1k-n200

RUN_FOLDER follows eval/README.md's rule, <model>/finetune_<recipe>-<target length>-n<passkey prompts>[-<qualifier>];
the run's console output, where it was kept, goes beside it as train.log.
"""

import json
import statistics
import sys
from pathlib import Path

name, wall, note, folder = sys.argv[1], float(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
run = Path("out/finetune") / name
log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines() if line.strip()]
every = max(len(log) // 10, 1)
curve = log[every - 1 :: every]
if curve[-1] is not log[-1]:
    curve.append(log[-1])
summary = json.loads((run / "summary.json").read_text())
out = {
    "config": f"recipes/configs/{name}.yaml",
    "command": f"python recipes/finetune_lora.py --config recipes/configs/{name}.yaml --merge --set train.threads=1",
    "steps": summary["steps"], "final_loss": summary["final_loss"],
    "train_minutes": round(log[-1]["elapsed_s"] / 60, 1), "wall_minutes_with_eval": round(wall / 60, 1),
    "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in log), "machine": note,
    "eval": summary["eval"],
    "loss_curve": [{"step": r["step"], "loss": round(r["loss"], 4), "lr": r["lr"]} for r in curve],
}
folder.mkdir(parents=True, exist_ok=True)
(folder / "summary.json").write_text(json.dumps(out, indent=1) + "\n")
print(json.dumps({k: v for k, v in out.items() if k != "loss_curve"}, indent=1))
