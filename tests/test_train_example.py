"""``examples/train.py`` as a user runs it: torchrun, 4 CPU processes on a 2x2 mesh, the bundled
tokenizer on the README, a checkpoint, and a resumed run that continues the uninterrupted run's
losses."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--mesh", "2x2", "--steps", "12", "--log-every", "6", "--ckpt-every", "6", "--dim", "32", "--ffn", "64",
        "--seq", "32", "--lr", "1e-2", "--warmup", "3", "--tokenizer", str(ROOT / "examples" / "data" / "tokenizer.json")]


def _train(out: Path, *extra: str) -> dict[int, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           str(ROOT / "examples" / "train.py"), *ARGS, "--out", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=out.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {int(k): v for k, v in json.loads((out / "losses.json").read_text()).items()}


@pytest.mark.slow
def test_train_example_trains_checkpoints_and_resumes_the_same_curve(tmp_path):
    whole = _train(tmp_path / "whole")
    assert sorted(whole) == list(range(12))
    assert sum(whole[s] for s in range(9, 12)) < sum(whole[s] for s in range(3))  # the loss falls
    assert (tmp_path / "whole" / "loss.png").stat().st_size > 0
    # resume from the step-6 checkpoint the same run wrote
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    (tmp_path / "resumed" / "checkpoint.json").write_text(json.dumps({"step": 6}))
    resumed = _train(tmp_path / "resumed", "--resume")
    for step in range(6, 12):
        assert abs(resumed[step] - whole[step]) <= 1e-5 * abs(whole[step]), (step, resumed[step], whole[step])
