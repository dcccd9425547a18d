export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
for flags in "" "--xla_gpu_enable_command_buffer=" "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"; do
  echo "== XLA_FLAGS=$flags"
  XLA_FLAGS="$flags" timeout 150 python3 benchmarks/mixed_step.py --cases 1024:1:256:256,1024:1:128:128 --reps 10 --out $OUT/mixed_$RANDOM.json 2>&1 | grep -v Warn | tail -4
done
