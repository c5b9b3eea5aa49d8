"""A TRL user's script with tokencredit: own JSONL data, TRL-style reward functions, token-level
credit (credit="grpo+taco"). Three lines differ from a plain TRL script (marked "tokencredit").

    python examples/trl_own_data.py --data examples/own_data/qa.jsonl --output-dir runs/trl_own

--model takes a hub id or a local folder (default: the embedded SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from datasets import load_dataset
from trl import GRPOConfig

from tokencredit.integrations.trl import TokenCreditGRPOTrainer, checkpointing_args  # tokencredit

sys.path.insert(0, str(Path(__file__).resolve().parent / "own_data"))
from my_rewards import brevity, correct  # noqa: E402


def load_model(name: str):
    if name == "tiny":  # a tiny random model, for the test of this script
        from tokencredit.testing import tiny_model_and_tokenizer

        return tiny_model_and_tokenizer(seed=0, eos_bias=3.0)
    from tokencredit.engine.models import resolve_model  # the embedded model, a hub id or a folder

    return resolve_model(name)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(Path(__file__).resolve().parent / "own_data" / "qa.jsonl"))
    p.add_argument("--model", default="embedded:smollm2-135m-instruct")
    p.add_argument("--output-dir", default="runs/trl_own")
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--max-completion-length", type=int, default=48)
    args = p.parse_args(argv)

    ds = load_dataset("json", data_files=args.data, split="train")
    # TRL's conversational layout: the question becomes the prompt, `solution` stays a column
    # that the reward function `correct(completions, solution, **kwargs)` receives
    ds = ds.map(lambda row: {"prompt": [{"role": "user", "content": row["question"]}]}, remove_columns=["question"])
    model, tokenizer = load_model(args.model)
    config = GRPOConfig(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=args.max_completion_length, learning_rate=2e-6, reward_weights=[1.0, 0.1],
        logging_steps=1, save_strategy="steps", save_steps=args.max_steps, report_to="none", use_cpu=True,
        bf16=False, **checkpointing_args(False),
    )
    trainer = TokenCreditGRPOTrainer(  # tokencredit: was trl.GRPOTrainer
        model=model, processing_class=tokenizer, reward_funcs=[correct, brevity], args=config, train_dataset=ds,
        credit="grpo+taco", credit_config={"taco": {"lam": 0.5}},  # tokencredit: the credit spec
    )
    trainer.train()
    return trainer


if __name__ == "__main__":
    main()
