# The OPPO row of docs/results.md after the fix (log-odds recursion, direction anchoring "flip",
# answer-only oracle template): the results command with only the oppo spec, 1 thread.
nice -n 10 .venv/bin/tokencredit compare --credit oppo --seeds 0,1 \
  --output-dir runs/results_oppo --steps 15 --model.lora --optim.lr 5e-5 \
  --log.eval-every 5 --log.eval-samples 0 --task.n-eval 32 --threads 1
