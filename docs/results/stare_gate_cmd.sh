# STARE with its gate open at this scale: H_target above the policy's entropy (~0.9 nats)
nice -n 10 .venv/bin/tokencredit compare --credit stare --seeds 0,1 \
  --output-dir runs/results_stare_gate --steps 15 --model.lora --optim.lr 5e-5 \
  --log.eval-every 5 --log.eval-samples 0 --task.n-eval 32 --threads 2 \
  --credit-args stare.H_target=1.2 stare.variant=C2 stare.adaptive=true
