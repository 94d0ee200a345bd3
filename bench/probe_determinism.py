"""Where does a GPU training run stop being bit-reproducible? (probe for the exact-resume test)

Runs the CLI job of tests/test_trainer.py (tiny random model, 6 steps, checkpoint every 2) several
ways and prints, per pair, the first metrics row/key that differs and how many weights differ:

    A, B   two uninterrupted runs (run-to-run determinism across processes)
    D1, D2 the same under torch.use_deterministic_algorithms(True) + CUBLAS_WORKSPACE_CONFIG
    K      D-mode killed after the step-4 checkpoint, then resumed

    PYTHONPATH=. OUT=$OUT python3 bench/probe_determinism.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from safetensors.torch import load_file  # noqa: E402

from jetrl.models.llama import CausalLM  # noqa: E402
from jetrl.models.loader import save_pretrained  # noqa: E402
from jetrl.models.tiny import build_tiny_tokenizer, tiny_model_config  # noqa: E402

PRE = "import sys, torch; torch.use_deterministic_algorithms(True); from jetrl.cli import main; sys.exit(main(sys.argv[1:]))"


def job(ckpt: Path, run_dir: Path, recipe: str, det: bool) -> list[str]:
    head = [sys.executable, "-c", PRE] if det else [sys.executable, "-m", "jetrl"]
    return head + ["train", "--preset", "tiny", "--run-dir", str(run_dir), f"model.name={ckpt}", f"recipe={recipe}",
                   "task.num_train=64", "task.num_eval=8", "grpo.max_steps=6", "save_steps=2",
                   "grpo.generation_batch_size=16", "grpo.num_generations=4", "grpo.per_device_train_batch_size=8",
                   "grpo.gradient_accumulation_steps=2", "grpo.max_completion_length=6", "progress=false",
                   "tensorboard=false", "task.reward_funcs=['tests.test_trainer:length_reward']"]


def final(run_dir: Path):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]
    return rows, load_file(run_dir / "checkpoints" / "step_000006" / "model.safetensors")


def compare(a, b) -> dict:
    (ra, wa), (rb, wb) = a, b
    first = None
    for i, (x, y) in enumerate(zip(ra, rb)):
        for k in x:
            if x.get(k) != y.get(k):
                first = (i, k, x.get(k), y.get(k))
                break
        if first:
            break
    ndiff = sum(not torch.equal(wa[k], wb[k]) for k in wa)
    return {"rows_equal": ra == rb, "first_diff": first, "weights_differ": ndiff, "weights": len(wa)}


def main() -> None:
    out = Path(os.environ.get("OUT", "."))
    tmp = Path(tempfile.mkdtemp())
    ckpt = tmp / "ckpt"
    torch.manual_seed(0)
    save_pretrained(CausalLM(tiny_model_config()), tiny_model_config(), ckpt, dtype=torch.float32)
    build_tiny_tokenizer().save_pretrained(str(ckpt))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
           "PYTHONPATH": os.pathsep.join(filter(None, [".", os.environ.get("PYTHONPATH", "")]))}
    report = {}
    for recipe in os.environ.get("RECIPES", "bf16,jet").split(","):
        runs = {}
        for name, det in (("A", False), ("B", False), ("D1", True), ("D2", True))[:int(os.environ.get("RUNS", 4))]:
            t = time.time()
            p = subprocess.run(job(ckpt, tmp / f"{recipe}{name}", recipe, det), capture_output=True, text=True, env=env)
            if p.returncode != 0:
                report[f"{recipe}/{name}"] = p.stderr[-1500:]
                print(recipe, name, "FAILED", p.stderr[-1500:], flush=True)
                continue
            runs[name] = final(tmp / f"{recipe}{name}")
            print(recipe, name, f"{time.time() - t:.0f}s", flush=True)
        if not os.environ.get("RUNS"):
            killed = tmp / f"{recipe}K"
            p = subprocess.Popen(job(ckpt, killed, recipe, True), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
            while not (killed / "checkpoints" / "step_000004" / "trainer_state.pt").exists() and p.poll() is None:
                time.sleep(0.05)
            p.send_signal(signal.SIGKILL)
            p.wait()
            head = [sys.executable, "-c", PRE]
            r = subprocess.run(head + ["train", "--run-dir", str(killed), "--resume"], capture_output=True, text=True, env=env)
            if r.returncode == 0:
                runs["K"] = final(killed)
            else:
                report[f"{recipe}/K"] = r.stderr[-1500:]
        for x, y in (("A", "B"), ("D1", "D2"), ("A", "D1"), ("D1", "K")):
            if x in runs and y in runs:
                report[f"{recipe}: {x} vs {y}"] = compare(runs[x], runs[y])
                print(recipe, x, "vs", y, report[f"{recipe}: {x} vs {y}"], flush=True)
    (out / "determinism.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
