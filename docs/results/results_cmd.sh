nice -n 10 .venv/bin/tokencredit compare --credit grpo,dapo,taco,stare,acpo,arca,oppo,pact --seeds 0,1 \
  --output-dir runs/results --steps 15 --model.lora --optim.lr 5e-5 \
  --log.eval-every 5 --log.eval-samples 0 --task.n-eval 32 --threads 2
