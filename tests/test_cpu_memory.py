"""retain_memory: on glibc a CPU run keeps freed memory for the next step instead of unmapping
it, so re-allocating a large tensor touches no fresh pages. Measured in page faults (deterministic),
never in time. Each case runs in its own process: the setting is process-wide."""

import json
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's"
)

# allocate and touch 256 MB and free it, as a step does with its gradients, 8 times (glibc's heap
# settles after 2-3: posix_memalign leaves remainders it reuses only later), then count the minor
# page faults of 4 more, per 256 MB
PROBE = textwrap.dedent(
    """
    import json, resource, sys, torch
    SETUP
    def touch():
        t = torch.empty(64 * 1024 * 1024, dtype=torch.float32)
        t.fill_(1.0)
        return float(t[-1])
    for _ in range(8):
        touch()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        touch()
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4
    print(json.dumps({"faults": faults, "pages": 256 * 1024 * 1024 // resource.getpagesize()}))
    """
)


def _faults(setup: str) -> dict:
    code = PROBE.replace("SETUP", textwrap.dedent(setup).strip())
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_retained_memory_is_reused_without_fresh_pages():
    default = _faults("pass")
    retained = _faults("from tokencredit.engine.cpu_memory import retain_freed_memory\nassert retain_freed_memory()")
    # glibc's default: the 256 MB block is mmapped afresh and every page faults on first touch
    assert default["faults"] > 0.5 * default["pages"], default
    assert retained["faults"] < 0.05 * retained["pages"], retained


TRAINER = """
from tokencredit.train.config import ModelConfig, TaskConfig, TrainConfig
from tokencredit.testing import tiny_model_and_tokenizer
from tokencredit.train.trainer import Trainer
import tempfile
model, tok = tiny_model_and_tokenizer(seed=0)
Trainer(TrainConfig(output_dir=tempfile.mkdtemp() + "/run", device="cpu", retain_memory=RETAIN,
                    model=ModelConfig(name="tiny"), task=TaskConfig(name="add1", n_train=4, n_eval=2)),
        model=model, tokenizer=tok)
"""


@pytest.mark.parametrize("retain", [True, False])
def test_the_trainer_retains_memory_on_cpu_unless_told_not_to(retain):
    r = _faults(TRAINER.replace("RETAIN", str(retain)))
    if retain:
        assert r["faults"] < 0.05 * r["pages"], r
    else:
        assert r["faults"] > 0.5 * r["pages"], r


TRL_TRAINER = """
import pathlib, sys, tempfile
sys.path.insert(0, TESTS)
from test_trl import RewardLog, _args, _dataset
from tokencredit.integrations.trl import TokenCreditGRPOTrainer
from tokencredit.testing import tiny_model_and_tokenizer
model, tok = tiny_model_and_tokenizer(seed=0, eos_bias=2.0)
TokenCreditGRPOTrainer(model=model, reward_funcs=RewardLog(), args=_args(pathlib.Path(tempfile.mkdtemp())),
                       train_dataset=_dataset(), processing_class=tok, credit="grpo", retain_memory=RETAIN)
"""


@pytest.mark.parametrize("retain", [True, False])
def test_the_trl_trainer_retains_memory_on_cpu_unless_told_not_to(retain):
    pytest.importorskip("trl")
    import os

    tests = repr(os.path.dirname(os.path.abspath(__file__)))
    r = _faults(TRL_TRAINER.replace("TESTS", tests).replace("RETAIN", str(retain)))
    if retain:
        assert r["faults"] < 0.05 * r["pages"], r
    else:
        assert r["faults"] > 0.5 * r["pages"], r
