"""Run verl's own PPO entry point (``python -m verl.trainer.main_ppo``) on the CPU with the plugin,
as a user's dry run does (docs/integrations.md), and read back what it logged and captured.

The verl environment is ``.venv-verl`` (verl 0.9.1 without TRL, whose 1.16 release removed a
class verl's actor build imports), or ``$TC_VERL_PYTHON``. Each run gets its own output folder:
``metrics.jsonl`` (verl's file logger), ``capture/`` (``tc_capture``), ``ckpt/`` (verl's
checkpoints), ``log.txt`` (everything the run printed) and ``peak_rss_mb`` (the largest summed
RSS of the run's process tree and Ray's processes, sampled every second: a scan of every process
costs ~27 ms of a core, 14% of one at 5 Hz: a measurement for the closing note, never asserted on).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(ROOT, "examples", "verl")


def verl_python() -> Optional[str]:
    py = os.environ.get("TC_VERL_PYTHON") or os.path.join(ROOT, ".venv-verl", "bin", "python")
    return py if os.path.exists(py) else None


def example_overrides(script: str, env: Dict[str, str]) -> List[str]:
    """The hydra overrides of ``examples/verl/<script>`` (its ``DRY_RUN=1`` output) under ``env``."""
    out = subprocess.run(["bash", os.path.join(EXAMPLES, script)], env={**os.environ, **env, "DRY_RUN": "1"},
                         capture_output=True, text=True, check=True)
    return [line for line in out.stdout.splitlines() if line.strip()]


@dataclass
class Run:
    out: str
    rc: int
    wall_s: float
    peak_rss_mb: float
    log: str = field(repr=False)

    def metrics(self) -> List[dict]:
        path = os.path.join(self.out, "metrics.jsonl")
        rows = []
        if os.path.exists(path):
            with open(path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
        return rows

    def captured(self, kind: str) -> List[dict]:
        from safetensors import safe_open

        recs = []
        for path in sorted(glob.glob(os.path.join(self.out, "capture", f"{kind}-*.safetensors")),
                           key=lambda p: (os.path.getmtime(p), p)):
            with safe_open(path, framework="pt") as f:
                rec = {k: f.get_tensor(k) for k in f.keys()}
                rec["meta"] = json.loads(f.metadata()["meta"])
            _, pid, index = os.path.basename(path)[: -len(".safetensors")].split("-")
            rec["meta"]["pid"], rec["meta"]["index"] = int(pid), int(index)  # process, its n-th call
            recs.append(rec)
        return recs

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.splitlines()[-n:])


def _tree_rss_mb(pid: int) -> float:
    import psutil

    total = 0
    seen = set()
    try:
        procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        procs = []
    # Ray's workers are children of its raylet, not of the driver: count every process of the run's session
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
        except psutil.Error:
            continue
        if "ray::" in cmd or "raylet" in cmd or "gcs_server" in cmd or (p.info["name"] or "").startswith("ray::"):
            procs.append(p)
    for p in procs:
        if p.pid in seen:
            continue
        seen.add(p.pid)
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def run_main_ppo(out: str, overrides: List[str], *, extra_env: Optional[Dict[str, str]] = None, timeout: int = 900) -> Run:
    """``python -m verl.trainer.main_ppo OVERRIDES`` with the CPU platform and the capture module."""
    py = verl_python()
    os.makedirs(out, exist_ok=True)
    env = {
        **os.environ,
        "VERL_USE_EXTERNAL_MODULES": "tokencredit.integrations.verl_cpu,tc_capture",
        "VERL_PLATFORM": "cpu",
        "VERL_FILE_LOGGER_PATH": os.path.join(out, "metrics.jsonl"),
        "TC_CAPTURE_DIR": os.path.join(out, "capture"),
        "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "PYTHONWARNINGS": "ignore",
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_DEDUP_LOGS": "0",
        **(extra_env or {}),
    }
    env.pop("VIRTUAL_ENV", None)
    log_path = os.path.join(out, "log.txt")
    t0 = time.time()
    peak = [0.0]
    with open(log_path, "w") as log:
        # a session of its own: a run past its timeout is killed with every process it started (Ray's too)
        proc = subprocess.Popen([py, "-m", "verl.trainer.main_ppo", *overrides], cwd=out, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        done = threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], _tree_rss_mb(proc.pid))
                done.wait(1.0)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            import signal

            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
        finally:
            done.set()
            sampler.join()
    wall = time.time() - t0
    with open(log_path) as f:
        text = f.read()
    with open(os.path.join(out, "peak_rss_mb"), "w") as f:
        f.write(f"{peak[0]:.0f}\n")
    return Run(out=out, rc=rc, wall_s=wall, peak_rss_mb=peak[0], log=text)


if __name__ == "__main__":  # python tests/verl_e2e/runner.py OUT override... (by hand)
    r = run_main_ppo(sys.argv[1], sys.argv[2:])
    print(r.rc, f"{r.wall_s:.0f}s", f"{r.peak_rss_mb:.0f}MB")
