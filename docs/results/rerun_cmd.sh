# The rows of docs/results.md measured before the faithfulness round, rerun at the current
# defaults with the results command (ARCA at the authors' defaults with its seq-mean-token-mean
# aggregation; PACT's critic on the updated actor's states with masked IS weights; adaptive
# STARE with the controller stepping before the update).
nice -n 10 .venv/bin/tokencredit compare --credit arca,pact --seeds 0,1 \
  --output-dir runs/results_rerun --steps 15 --model.lora --optim.lr 5e-5 \
  --log.eval-every 5 --log.eval-samples 0 --task.n-eval 32 --threads 2
nice -n 10 .venv/bin/tokencredit compare --credit stare --seeds 0,1 \
  --output-dir runs/results_rerun_stare_gate --steps 15 --model.lora --optim.lr 5e-5 \
  --log.eval-every 5 --log.eval-samples 0 --task.n-eval 32 --threads 2 \
  --credit-args stare.H_target=1.2 stare.variant=C2 stare.adaptive=true
